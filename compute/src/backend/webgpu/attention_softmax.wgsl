// Causal softmax of each row of the (batch, heads, seq, seq) scores in place: row i of a
// block keeps its first i + 1 values, the rest become 0. One workgroup per row.
struct P { rows: u32, seq: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> probs: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32 /*SUBGROUP_ARGS*/) {
    /*SUBGROUP_INIT*/
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.seq;
    let len = row % p.seq + 1u;
    var mx = -3.4e38;
    for (var c = li; c < len; c = c + WG) {
        mx = max(mx, probs[base + c]);
    }
    let m = workgroup_max(li, mx);
    var s = 0.0;
    for (var c = li; c < len; c = c + WG) {
        let e = exp_clamped(probs[base + c] - m);
        probs[base + c] = e;
        s = s + e;
    }
    let inv = 1.0 / workgroup_sum(li, s);
    for (var c = li; c < p.seq; c = c + WG) {
        if (c < len) {
            probs[base + c] = probs[base + c] * inv;
        } else {
            probs[base + c] = 0.0;
        }
    }
}
