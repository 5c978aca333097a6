// Softmax of each logit row in place and losses[row] = -ln p[target]. One workgroup per row.
struct P { rows: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> losses: array<f32>;
@group(0) @binding(3) var<storage, read> targets: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32 /*SUBGROUP_ARGS*/) {
    /*SUBGROUP_INIT*/
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.width;
    // The target's logit, read before any thread overwrites the row (a barrier orders
    // workgroup memory, not this storage buffer, between threads).
    let tgt = min(targets[row], p.width - 1u);
    let logit_t = logits[base + tgt];
    var mx = -3.4e38;
    for (var c = li; c < p.width; c = c + WG) {
        mx = max(mx, logits[base + c]);
    }
    let m = workgroup_max(li, mx);
    var s = 0.0;
    for (var c = li; c < p.width; c = c + WG) {
        let e = exp_clamped(logits[base + c] - m);
        logits[base + c] = e;
        s = s + e;
    }
    let inv = 1.0 / workgroup_sum(li, s);
    if (li == 0u) {
        losses[row] = -log(max(exp_clamped(logit_t - m) * inv, 1.17549435e-38));
    }
    for (var c = li; c < p.width; c = c + WG) {
        logits[base + c] = logits[base + c] * inv;
    }
}
