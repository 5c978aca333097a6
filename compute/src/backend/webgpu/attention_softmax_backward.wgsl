// Causal softmax backward of each row in place: d = p * (d - sum(p * d)) * scale on the first
// i + 1 values of row i of a block, 0 after them. One workgroup per row.
struct P { rows: u32, seq: u32, scale: f32, _0: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> d: array<f32>;
@group(0) @binding(2) var<storage, read> probs: array<f32>;

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
    var s = 0.0;
    for (var c = li; c < len; c = c + WG) {
        s = s + probs[base + c] * d[base + c];
    }
    let total = workgroup_sum(li, s);
    for (var c = li; c < p.seq; c = c + WG) {
        if (c < len) {
            d[base + c] = probs[base + c] * (d[base + c] - total) * p.scale;
        } else {
            d[base + c] = 0.0;
        }
    }
}
