// out[i] = row[i % width]: every row of out starts as `row` (a linear layer's bias).
struct P { n: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> row: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i < p.n) {
        out[i] = row[i % p.width];
    }
}
