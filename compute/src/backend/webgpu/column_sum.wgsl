// acc[j] += sum over rows of x[r, j]; one thread per column.
struct P { rows: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> acc: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let j = flat_index(wg, nwg, li);
    if (j < p.width) {
        var s = 0.0;
        for (var r = 0u; r < p.rows; r = r + 1u) {
            s = s + x[r * p.width + j];
        }
        acc[j] = acc[j] + s;
    }
}
