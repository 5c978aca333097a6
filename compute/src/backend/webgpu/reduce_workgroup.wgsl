// Workgroup reductions through workgroup memory: a tree over the 256 threads. Used where the
// adapter has no subgroup operations.

var<workgroup> red: array<f32, 256>;

// Sum of `v` over the workgroup; every thread gets the result. Call from uniform control flow.
fn workgroup_sum(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (li < s) {
            red[li] = red[li] + red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Maximum of `v` over the workgroup; every thread gets the result.
fn workgroup_max(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

