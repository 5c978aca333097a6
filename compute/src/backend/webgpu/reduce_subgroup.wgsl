// Workgroup reductions with subgroup operations: each subgroup reduces in registers, then every
// thread adds the subgroups' results in subgroup order (deterministic, no tree of barriers).
// Kernels that reduce pass their subgroup built-ins to subgroup_init first. (wgpu enables the
// subgroup built-ins with the device feature; its WGSL front end has no `enable subgroups`.)

var<private> sg_lane: u32;
var<private> sg_id: u32;
var<private> sg_count: u32;

fn subgroup_init(lane: u32, id: u32, count: u32) {
    sg_lane = lane;
    sg_id = id;
    sg_count = count;
}

var<workgroup> red: array<f32, 256>;

// Sum of `v` over the workgroup; every thread gets the result. Call from uniform control flow.
fn workgroup_sum(li: u32, v: f32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[sg_id] = s;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < sg_count; i = i + 1u) {
        total = total + red[i];
    }
    workgroupBarrier();
    return total;
}

// Maximum of `v` over the workgroup; every thread gets the result.
fn workgroup_max(li: u32, v: f32) -> f32 {
    let s = subgroupMax(v);
    if (sg_lane == 0u) {
        red[sg_id] = s;
    }
    workgroupBarrier();
    var m = red[0];
    for (var i = 1u; i < sg_count; i = i + 1u) {
        m = max(m, red[i]);
    }
    workgroupBarrier();
    return m;
}
