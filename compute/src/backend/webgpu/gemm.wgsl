// Batched, strided matrix product C = alpha * A * B (+ C when accumulating), tiled through
// workgroup memory: a 16x16 workgroup computes a 64x64 block of C, 4x4 values per thread,
// over 16-wide slices of k. Element (i, k) of A is at a_off + i*a_rs + k*a_cs, and likewise
// for B and C, so transposes and the per-head views of attention are strides, not copies.
// Workgroup z is a batch index split as (outer = z / heads, head = z % heads), each with its
// own stride, which is how attention addresses (sequence, head) blocks.
struct P {
    m: u32, n: u32, k: u32, heads: u32,
    a_off: u32, a_rs: u32, a_cs: u32, a_so: u32,
    a_sh: u32, b_off: u32, b_rs: u32, b_cs: u32,
    b_so: u32, b_sh: u32, c_off: u32, c_rs: u32,
    c_cs: u32, c_so: u32, c_sh: u32, accumulate: u32,
    alpha: f32, _0: u32, _1: u32, _2: u32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;
var<workgroup> ta: array<f32, 1024>; // [TK][TM]
var<workgroup> tb: array<f32, 1024>; // [TK][TN]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let outer = wg.z / p.heads;
    let head = wg.z % p.heads;
    let a0 = p.a_off + outer * p.a_so + head * p.a_sh;
    let b0 = p.b_off + outer * p.b_so + head * p.b_sh;
    let c0 = p.c_off + outer * p.c_so + head * p.c_sh;
    let row0 = wg.y * TM;
    let col0 = wg.x * TN;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        acc[i] = 0.0;
    }
    for (var k0 = 0u; k0 < p.k; k0 = k0 + TK) {
        // Neighbouring threads load neighbouring addresses: along k when it is contiguous.
        for (var e = 0u; e < 4u; e = e + 1u) {
            let idx = li + 256u * e;
            var mm: u32;
            var kk: u32;
            if (p.a_cs == 1u) {
                mm = idx / TK;
                kk = idx % TK;
            } else {
                kk = idx / TM;
                mm = idx % TM;
            }
            let gi = row0 + mm;
            let gk = k0 + kk;
            var v = 0.0;
            if (gi < p.m && gk < p.k) {
                v = a[a0 + gi * p.a_rs + gk * p.a_cs];
            }
            ta[kk * TM + mm] = v;
        }
        for (var e = 0u; e < 4u; e = e + 1u) {
            let idx = li + 256u * e;
            var nn: u32;
            var kk: u32;
            if (p.b_rs == 1u && p.b_cs != 1u) {
                nn = idx / TK;
                kk = idx % TK;
            } else {
                kk = idx / TN;
                nn = idx % TN;
            }
            let gj = col0 + nn;
            let gk = k0 + kk;
            var v = 0.0;
            if (gj < p.n && gk < p.k) {
                v = b[b0 + gk * p.b_rs + gj * p.b_cs];
            }
            tb[kk * TN + nn] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk = kk + 1u) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i = i + 1u) {
                av[i] = ta[kk * TM + lid.y + 16u * i];
                bv[i] = tb[kk * TN + lid.x + 16u * i];
            }
            for (var i = 0u; i < 4u; i = i + 1u) {
                for (var j = 0u; j < 4u; j = j + 1u) {
                    acc[i * 4u + j] = acc[i * 4u + j] + av[i] * bv[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let gi = row0 + lid.y + 16u * i;
        for (var j = 0u; j < 4u; j = j + 1u) {
            let gj = col0 + lid.x + 16u * j;
            if (gi < p.m && gj < p.n) {
                let at = c0 + gi * p.c_rs + gj * p.c_cs;
                var v = p.alpha * acc[i * 4u + j];
                if (p.accumulate != 0u) {
                    v = v + c[at];
                }
                c[at] = v;
            }
        }
    }
}
