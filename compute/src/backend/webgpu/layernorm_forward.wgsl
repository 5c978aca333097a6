// One workgroup per row: mean, then variance around it (two passes, as the CPU reference).
struct P { rows: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read_write> mean: array<f32>;
@group(0) @binding(3) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<f32>;
@group(0) @binding(5) var<storage, read> weight: array<f32>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32 /*SUBGROUP_ARGS*/) {
    /*SUBGROUP_INIT*/
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.width;
    var s = 0.0;
    for (var c = li; c < p.width; c = c + WG) {
        s = s + inp[base + c];
    }
    let mu = workgroup_sum(li, s) / f32(p.width);
    var q = 0.0;
    for (var c = li; c < p.width; c = c + WG) {
        let d = inp[base + c] - mu;
        q = q + d * d;
    }
    let variance = workgroup_sum(li, q) / f32(p.width);
    let rs = 1.0 / sqrt(variance + 1e-5);
    for (var c = li; c < p.width; c = c + WG) {
        out[base + c] = (inp[base + c] - mu) * rs * weight[c] + bias[c];
    }
    if (li == 0u) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}
