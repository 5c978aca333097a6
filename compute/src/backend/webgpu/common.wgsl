// Shared by every kernel (prepended to each source, after the reductions of
// reduce_workgroup.wgsl or reduce_subgroup.wgsl). Element-wise kernels run 256 threads per
// workgroup over a 2-D grid of workgroups (one dimension holds at most 65535).

const WG: u32 = 256u;

fn flat_index(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * WG + li;
}

// exp(x) on the range softmax and GELU need: below -87 it flushes to ~0, above 88 it saturates.
fn exp_clamped(x: f32) -> f32 {
    return exp(clamp(x, -87.0, 88.0));
}

// tanh through exp, as the CPU reference computes it: saturates correctly at both ends.
fn tanh_ref(u: f32) -> f32 {
    return 1.0 - 2.0 / (exp_clamped(2.0 * u) + 1.0);
}
