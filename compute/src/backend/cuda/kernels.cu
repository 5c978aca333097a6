// Every operation of a stage that is not a matrix product (those go to cuBLAS), compiled at
// run time by NVRTC. Semantics follow the CPU reference (compute/src/backend/cpu.rs);
// element-wise kernels take one thread per value, row kernels one block of 256 per row.

#define BLOCK 256
#define SUM_BLOCK 4096

// Sum of v over the block; every thread gets the result.
__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float r = 0.0f;
    if (threadIdx.x < BLOCK / 32) r = shared[threadIdx.x];
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) r += __shfl_down_sync(0xffffffff, r, o);
        if (lane == 0) shared[0] = r;
    }
    __syncthreads();
    r = shared[0];
    __syncthreads();
    return r;
}

// Maximum of v over the block; every thread gets the result.
__device__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float r = -3.4e38f;
    if (threadIdx.x < BLOCK / 32) r = shared[threadIdx.x];
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) r = fmaxf(r, __shfl_down_sync(0xffffffff, r, o));
        if (lane == 0) shared[0] = r;
    }
    __syncthreads();
    r = shared[0];
    __syncthreads();
    return r;
}

__device__ unsigned int flat_index() {
    return (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ unsigned int row_index() {
    return blockIdx.y * gridDim.x + blockIdx.x;
}

__device__ float exp_clamped(float x) {
    return expf(fminf(fmaxf(x, -87.0f), 88.0f));
}

__device__ float tanh_ref(float u) {
    return 1.0f - 2.0f / (exp_clamped(2.0f * u) + 1.0f);
}

extern "C" __global__ void fill(float* out, float value, unsigned int n) {
    unsigned int i = flat_index();
    if (i < n) out[i] = value;
}

extern "C" __global__ void add(float* out, const float* a, const float* b, unsigned int n) {
    unsigned int i = flat_index();
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void add_assign(float* acc, const float* x, unsigned int n) {
    unsigned int i = flat_index();
    if (i < n) acc[i] += x[i];
}

extern "C" __global__ void broadcast_rows(float* out, const float* row, unsigned int n,
                                          unsigned int width) {
    unsigned int i = flat_index();
    if (i < n) out[i] = row[i % width];
}

extern "C" __global__ void sum_squares(float* partials, const float* x, unsigned int n) {
    __shared__ float shared[32];
    unsigned int block = row_index();
    unsigned int start = block * SUM_BLOCK;
    float acc = 0.0f;
    for (unsigned int e = 0; e < SUM_BLOCK / BLOCK; e++) {
        unsigned int i = start + e * BLOCK + threadIdx.x;
        if (i < n) acc += x[i] * x[i];
    }
    float total = block_sum(acc, shared);
    if (threadIdx.x == 0 && start < n) partials[block] = total;
}

#define GELU_SCALE 0.7978846f
#define GELU_CUBE 0.044715f

extern "C" __global__ void gelu_forward(float* out, const float* inp, unsigned int n) {
    unsigned int i = flat_index();
    if (i < n) {
        float x = inp[i];
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanh_ref(u));
    }
}

extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout,
                                         unsigned int n) {
    unsigned int i = flat_index();
    if (i < n) {
        float x = inp[i];
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        float th = tanh_ref(u);
        float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
        dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
    }
}

extern "C" __global__ void adamw(float* param, const float* grad, float* m, float* v,
                                 unsigned int n, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, float bc1, float bc2, float grad_scale) {
    unsigned int i = flat_index();
    if (i < n) {
        float g = grad[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float w = param[i];
        param[i] = w - lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + weight_decay * w);
    }
}

extern "C" __global__ void embedding_forward(float* out, const unsigned int* tokens,
                                             const float* wte, const float* wpe, unsigned int n,
                                             unsigned int seq, unsigned int width,
                                             unsigned int vocab) {
    unsigned int i = flat_index();
    if (i < n) {
        unsigned int row = i / width, c = i % width;
        unsigned int tok = tokens[row];
        float e = tok < vocab ? wte[(size_t)tok * width + c] : 0.0f;
        out[i] = e + wpe[(row % seq) * width + c];
    }
}

extern "C" __global__ void embedding_backward_wpe(float* dwpe, const float* dout, unsigned int n,
                                                  unsigned int seq, unsigned int width,
                                                  unsigned int batch) {
    unsigned int i = flat_index();
    if (i < n) {
        float acc = dwpe[i];
        for (unsigned int b = 0; b < batch; b++) acc += dout[(size_t)b * seq * width + i];
        dwpe[i] = acc;
    }
}

// One thread per column walks the positions in order (no atomics, and a fixed sum order), in
// groups of 8: a group's values for one token are added together first, so its 8 rows are
// distinct and their loads overlap instead of waiting on each other's stores.
#define WTE_GROUP 8
extern "C" __global__ void embedding_backward_wte(float* dwte, const float* dout,
                                                  const unsigned int* tokens, unsigned int rows,
                                                  unsigned int width, unsigned int vocab) {
    unsigned int c = flat_index();
    if (c >= width) return;
    for (unsigned int i0 = 0; i0 < rows; i0 += WTE_GROUP) {
        unsigned int tok[WTE_GROUP];
        float v[WTE_GROUP], row[WTE_GROUP];
#pragma unroll
        for (unsigned int j = 0; j < WTE_GROUP; j++) {
            bool in = i0 + j < rows;
            tok[j] = in ? tokens[i0 + j] : vocab;
            v[j] = in ? dout[(size_t)(i0 + j) * width + c] : 0.0f;
        }
        // A repeated token's value goes to its first occurrence in the group.
#pragma unroll
        for (unsigned int j = 1; j < WTE_GROUP; j++) {
            for (unsigned int k = 0; k < j; k++) {
                if (tok[j] < vocab && tok[k] == tok[j]) {
                    v[k] += v[j];
                    tok[j] = vocab;
                }
            }
        }
#pragma unroll
        for (unsigned int j = 0; j < WTE_GROUP; j++)
            if (tok[j] < vocab) row[j] = dwte[(size_t)tok[j] * width + c];
#pragma unroll
        for (unsigned int j = 0; j < WTE_GROUP; j++)
            if (tok[j] < vocab) dwte[(size_t)tok[j] * width + c] = row[j] + v[j];
    }
}

extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd,
                                             const float* inp, const float* weight,
                                             const float* bias, unsigned int rows,
                                             unsigned int width) {
    __shared__ float shared[32];
    unsigned int row = row_index();
    if (row >= rows) return;
    const float* x = inp + (size_t)row * width;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) s += x[c];
    float mu = block_sum(s, shared) / width;
    float q = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) {
        float d = x[c] - mu;
        q += d * d;
    }
    float rs = 1.0f / sqrtf(block_sum(q, shared) / width + 1e-5f);
    float* o = out + (size_t)row * width;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK)
        o[c] = (x[c] - mu) * rs * weight[c] + bias[c];
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

extern "C" __global__ void layernorm_backward_input(float* dinp, const float* dout,
                                                    const float* inp, const float* weight,
                                                    const float* mean, const float* rstd,
                                                    unsigned int rows, unsigned int width) {
    __shared__ float shared[32];
    unsigned int row = row_index();
    if (row >= rows) return;
    size_t base = (size_t)row * width;
    float mu = mean[row], s = rstd[row];
    float a1 = 0.0f, a2 = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) {
        float dn = weight[c] * dout[base + c];
        a1 += dn;
        a2 += dn * (inp[base + c] - mu) * s;
    }
    float mean_dn = block_sum(a1, shared) / width;
    float mean_dn_n = block_sum(a2, shared) / width;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) {
        float dn = weight[c] * dout[base + c];
        float n = (inp[base + c] - mu) * s;
        dinp[base + c] += (dn - mean_dn - n * mean_dn_n) * s;
    }
}

// Column sums over many rows, in two passes so that every multiprocessor takes part: a block
// sums a tile of 32 columns over one chunk of rows (its 8 warps take every 8th row, each warp
// reading 32 consecutive values, and add their sums in warp order), writing one partial per
// column and chunk; then one thread per column adds its partials in chunk order. The order is
// fixed, so results are the same on every run.
#define COLS 32
#define ROW_LANES (BLOCK / COLS)

// Adds the ROW_LANES sums of each column of the tile and writes them to out[column].
__device__ void tile_total(float v, float (*shared)[COLS + 1], float* out, unsigned int col,
                           unsigned int width) {
    unsigned int lane = threadIdx.x % COLS, lane_row = threadIdx.x / COLS;
    shared[lane_row][lane] = v;
    __syncthreads();
    if (lane_row == 0 && col < width) {
        float t = 0.0f;
        for (unsigned int k = 0; k < ROW_LANES; k++) t += shared[k][lane];
        out[col] = t;
    }
    __syncthreads();
}

// partials[chunk][c] = sum of x[r][c] over the chunk's rows.
extern "C" __global__ void column_sum_partials(float* partials, const float* x, unsigned int rows,
                                               unsigned int width, unsigned int chunk) {
    __shared__ float shared[ROW_LANES][COLS + 1];
    unsigned int col = blockIdx.x * COLS + threadIdx.x % COLS;
    unsigned int first = blockIdx.y * chunk, end = min(first + chunk, rows);
    float s = 0.0f;
    if (col < width)
        for (unsigned int r = first + threadIdx.x / COLS; r < end; r += ROW_LANES)
            s += x[(size_t)r * width + col];
    tile_total(s, shared, partials + (size_t)blockIdx.y * width, col, width);
}

// The layernorm's parameter gradients per chunk: dweight partials in the first gridDim.y
// planes of `partials`, dbias partials in the next.
extern "C" __global__ void layernorm_params_partials(float* partials, const float* dout,
                                                     const float* inp, const float* mean,
                                                     const float* rstd, unsigned int rows,
                                                     unsigned int width, unsigned int chunk) {
    __shared__ float shared[ROW_LANES][COLS + 1];
    unsigned int col = blockIdx.x * COLS + threadIdx.x % COLS;
    unsigned int first = blockIdx.y * chunk, end = min(first + chunk, rows);
    float dw = 0.0f, db = 0.0f;
    if (col < width)
        for (unsigned int r = first + threadIdx.x / COLS; r < end; r += ROW_LANES) {
            float g = dout[(size_t)r * width + col];
            dw += g * (inp[(size_t)r * width + col] - mean[r]) * rstd[r];
            db += g;
        }
    tile_total(dw, shared, partials + (size_t)blockIdx.y * width, col, width);
    tile_total(db, shared, partials + (size_t)(gridDim.y + blockIdx.y) * width, col, width);
}

// acc[c] += the sum of partials[k][c] over k < chunks, in order.
extern "C" __global__ void add_column_partials(float* acc, const float* partials,
                                               unsigned int chunks, unsigned int width) {
    unsigned int c = flat_index();
    if (c < width) {
        float t = 0.0f;
        for (unsigned int k = 0; k < chunks; k++) t += partials[(size_t)k * width + c];
        acc[c] += t;
    }
}

// Causal softmax in place: row i of each (sequence, head) block keeps its first i + 1 values.
extern "C" __global__ void attention_softmax(float* probs, unsigned int rows, unsigned int seq) {
    __shared__ float shared[32];
    unsigned int row = row_index();
    if (row >= rows) return;
    float* p = probs + (size_t)row * seq;
    unsigned int len = row % seq + 1;
    float mx = -3.4e38f;
    for (unsigned int c = threadIdx.x; c < len; c += BLOCK) mx = fmaxf(mx, p[c]);
    float m = block_max(mx, shared);
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < len; c += BLOCK) {
        float e = exp_clamped(p[c] - m);
        p[c] = e;
        s += e;
    }
    float inv = 1.0f / block_sum(s, shared);
    for (unsigned int c = threadIdx.x; c < seq; c += BLOCK) p[c] = c < len ? p[c] * inv : 0.0f;
}

extern "C" __global__ void attention_softmax_backward(float* d, const float* probs,
                                                      unsigned int rows, unsigned int seq,
                                                      float scale) {
    __shared__ float shared[32];
    unsigned int row = row_index();
    if (row >= rows) return;
    size_t base = (size_t)row * seq;
    unsigned int len = row % seq + 1;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < len; c += BLOCK) s += probs[base + c] * d[base + c];
    float total = block_sum(s, shared);
    for (unsigned int c = threadIdx.x; c < seq; c += BLOCK)
        d[base + c] = c < len ? probs[base + c] * (d[base + c] - total) * scale : 0.0f;
}

extern "C" __global__ void cross_entropy_forward(float* logits, float* losses,
                                                 const unsigned int* targets, unsigned int rows,
                                                 unsigned int width) {
    __shared__ float shared[32];
    unsigned int row = row_index();
    if (row >= rows) return;
    float* l = logits + (size_t)row * width;
    unsigned int tgt = min(targets[row], width - 1);
    float logit_t = l[tgt];  // before any thread overwrites the row
    float mx = -3.4e38f;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) mx = fmaxf(mx, l[c]);
    float m = block_max(mx, shared);
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) {
        float e = exp_clamped(l[c] - m);
        l[c] = e;
        s += e;
    }
    float inv = 1.0f / block_sum(s, shared);
    if (threadIdx.x == 0) losses[row] = -logf(fmaxf(exp_clamped(logit_t - m) * inv, 1.17549435e-38f));
    for (unsigned int c = threadIdx.x; c < width; c += BLOCK) l[c] *= inv;
}

extern "C" __global__ void cross_entropy_backward(float* probs, const unsigned int* targets,
                                                  unsigned int n, unsigned int width,
                                                  float scale) {
    unsigned int i = flat_index();
    if (i < n) {
        float v = probs[i];
        if (i % width == targets[i / width]) v -= 1.0f;
        probs[i] = v * scale;
    }
}
