// Probabilities become logit gradients in place: d = (p - onehot(target)) * scale.
struct P { n: u32, width: u32, scale: f32, _0: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> probs: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i < p.n) {
        var v = probs[i];
        if (i % p.width == targets[i / p.width]) {
            v = v - 1.0;
        }
        probs[i] = v * p.scale;
    }
}
