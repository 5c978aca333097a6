// dwte[tokens[i], c] += dout[i, c]. Repeated tokens hit the same row, so each thread owns one
// column c and walks the positions in order: no atomics, and the sum order of the CPU reference.
struct P { rows: u32, width: u32, vocab: u32, _0: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> dwte: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<storage, read> tokens: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let c = flat_index(wg, nwg, li);
    if (c < p.width) {
        for (var i = 0u; i < p.rows; i = i + 1u) {
            let tok = tokens[i];
            if (tok < p.vocab) {
                let j = tok * p.width + c;
                dwte[j] = dwte[j] + dout[i * p.width + c];
            }
        }
    }
}
