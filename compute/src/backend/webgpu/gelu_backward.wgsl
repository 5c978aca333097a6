const GELU_SCALE: f32 = 0.7978846;
const GELU_CUBE: f32 = 0.044715;
struct P { n: u32, _0: u32, _1: u32, _2: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> dinp: array<f32>;
@group(0) @binding(2) var<storage, read> inp: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i < p.n) {
        let x = inp[i];
        let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        let th = tanh_ref(u);
        let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
        dinp[i] = dout[i] * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
    }
}
