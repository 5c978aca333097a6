// One workgroup per row: dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd.
struct P { rows: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> dinp: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<storage, read> inp: array<f32>;
@group(0) @binding(4) var<storage, read> weight: array<f32>;
@group(0) @binding(5) var<storage, read> mean: array<f32>;
@group(0) @binding(6) var<storage, read> rstd: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32 /*SUBGROUP_ARGS*/) {
    /*SUBGROUP_INIT*/
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.width;
    let mu = mean[row];
    let s = rstd[row];
    var a1 = 0.0;
    var a2 = 0.0;
    for (var c = li; c < p.width; c = c + WG) {
        let dn = weight[c] * dout[base + c];
        a1 = a1 + dn;
        a2 = a2 + dn * (inp[base + c] - mu) * s;
    }
    let mean_dn = workgroup_sum(li, a1) / f32(p.width);
    let mean_dn_n = workgroup_sum(li, a2) / f32(p.width);
    for (var c = li; c < p.width; c = c + WG) {
        let dn = weight[c] * dout[base + c];
        let n = (inp[base + c] - mu) * s;
        dinp[base + c] = dinp[base + c] + (dn - mean_dn - n * mean_dn_n) * s;
    }
}
