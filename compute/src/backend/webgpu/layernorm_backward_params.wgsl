// dweight[c] += sum over rows of dout * norm, dbias[c] += sum of dout; one thread per column.
struct P { rows: u32, width: u32, _0: u32, _1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(2) var<storage, read_write> dbias: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<f32>;
@group(0) @binding(5) var<storage, read> mean: array<f32>;
@group(0) @binding(6) var<storage, read> rstd: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let c = flat_index(wg, nwg, li);
    if (c < p.width) {
        var dw = 0.0;
        var db = 0.0;
        for (var r = 0u; r < p.rows; r = r + 1u) {
            let g = dout[r * p.width + c];
            dw = dw + g * (inp[r * p.width + c] - mean[r]) * rstd[r];
            db = db + g;
        }
        dweight[c] = dweight[c] + dw;
        dbias[c] = dbias[c] + db;
    }
}
