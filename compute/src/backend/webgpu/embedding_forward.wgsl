// out[i, c] = wte[tokens[i], c] + wpe[i % seq, c]; a token outside the vocabulary reads zeros
// (the host checks tokens before upload).
struct P { n: u32, seq: u32, width: u32, vocab: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> wte: array<f32>;
@group(0) @binding(4) var<storage, read> wpe: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i < p.n) {
        let row = i / p.width;
        let c = i % p.width;
        let tok = tokens[row];
        let t = row % p.seq;
        var e = 0.0;
        if (tok < p.vocab) {
            e = wte[tok * p.width + c];
        }
        out[i] = e + wpe[t * p.width + c];
    }
}
