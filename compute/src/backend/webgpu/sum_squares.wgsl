// Each workgroup sums the squares of a block of BLOCK values into one partial; the host adds
// the partials in f64.
const BLOCK: u32 = 4096u;
struct P { n: u32, _0: u32, _1: u32, _2: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> partials: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32 /*SUBGROUP_ARGS*/) {
    /*SUBGROUP_INIT*/
    let block = wg.y * nwg.x + wg.x;
    let start = block * BLOCK;
    var acc = 0.0;
    for (var e = 0u; e < BLOCK / WG; e = e + 1u) {
        let i = start + e * WG + li;
        if (i < p.n) {
            let v = x[i];
            acc = acc + v * v;
        }
    }
    let total = workgroup_sum(li, acc);
    if (li == 0u && start < p.n) {
        partials[block] = total;
    }
}
