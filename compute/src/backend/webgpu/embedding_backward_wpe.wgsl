// dwpe[t, c] += sum over b of dout[b, t, c]; one thread per (t, c).
struct P { n: u32, seq: u32, width: u32, batch: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> dwpe: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i < p.n) {
        var acc = dwpe[i];
        let stride = p.seq * p.width;
        for (var b = 0u; b < p.batch; b = b + 1u) {
            acc = acc + dout[b * stride + i];
        }
        dwpe[i] = acc;
    }
}
