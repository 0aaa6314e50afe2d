// An HSTU layer's glue around its GEMMs and attention (the torch references are in
// streamgr/kernels/hstu_glue.py). The end of a layer before its output projection, in one launch:
//   y  = bf16(bf16(LayerNorm(attn) * w + b) * u)      the projection's input
//   xb = bf16(x + out_bias)                          the residual its GEMM adds (beta = 1)
// so that x + W_o y + b_o is one GEMM (torch.addmm(xb, y, W_o^T)) instead of a norm, a multiply,
// a GEMM with bias and an add. The norm's statistics are fp32 (two passes over the row, which
// the first pass brings into L1: no catastrophic cancellation), and y is rounded to bf16
// twice, after the norm and after the multiply, as torch's unfused ops round it.
// One warp per row, 16-byte loads: N (attention width) and M (model width) multiples of 8,
// rows 16-byte aligned (the wrapper checks). u may be the projection before its SiLU
// (u_silu = 1): the SiLU is then applied here, rounded to bf16 (silu_bf16 below), so
// the v, q, k blocks alone need the separate SiLU pass (hstu_silu).
// Also: the input LayerNorm (hstu_layer_norm), that SiLU pass (hstu_silu), and the token
// embedding (hstu_embed), each one launch where torch takes one (the norm, ~3x off bandwidth
// in torch's kernel at width 512) or seven (the embedding's where/lookup/add ops).
// No torch headers: compiled by NVRTC via CuPy.
#include <cuda_bf16.h>

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return raw;
}

// F.silu in fp32, rounded to bf16: x / (1 + exp(-x)) with the fast exponential (ex2.approx)
// and division (rcp.approx), a few fp32 ulps from torch's IEEE form, which the bf16 rounding
// hides nearly always (the GPU test allows one bf16 unit). torch's exact form made the SiLU
// pass compute-bound: 135 us over a recompute batch's v, q, k against ~80 us of traffic.
__device__ __forceinline__ float silu_bf16(float v) {
    return __bfloat162float(__float2bfloat16(__fdividef(v, 1.0f + __expf(-v))));
}

// Mean and 1/std of one row of n_vecs 16-byte vectors, by one warp (two passes in fp32; the
// second re-reads the row from L1).
__device__ __forceinline__ void row_stats(const uint4* a, int n_vecs, float eps, int lane,
                                          float& mean, float& rstd) {
    const float n = (float)(n_vecs * 8);
    float f[8], s = 0.0f;
    for (int c = lane; c < n_vecs; c += 32) {
        unpack8(a[c], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += f[i];
    }
    mean = warp_sum(s) / n;
    float q = 0.0f;
    for (int c = lane; c < n_vecs; c += 32) {
        unpack8(a[c], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) q = __fmaf_rn(f[i] - mean, f[i] - mean, q);
    }
    rstd = rsqrtf(warp_sum(q) / n + eps);
}

// One warp per row: the calling warp's row and its lane.
__device__ __forceinline__ long long warp_row(int& lane) {
    lane = threadIdx.x & 31;
    return ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}

}  // namespace

__global__ void __launch_bounds__(256) hstu_norm_mul(
    const uint4* __restrict__ attn, const uint4* __restrict__ u, long long u_stride_vecs,
    const uint4* __restrict__ w, const uint4* __restrict__ b, const uint4* __restrict__ x,
    const uint4* __restrict__ out_bias, uint4* __restrict__ y, uint4* __restrict__ xb,
    long long rows, int n_vecs, int m_vecs, float eps, int u_silu) {
    int lane;
    const long long row = warp_row(lane);
    if (row >= rows) return;
    const uint4* a = attn + row * n_vecs;
    float mean, rstd, f[8];
    row_stats(a, n_vecs, eps, lane, mean, rstd);
    const uint4* ur = u + row * u_stride_vecs;
    for (int c = lane; c < n_vecs; c += 32) {
        float g[8], bb[8], uu[8];
        unpack8(a[c], f), unpack8(w[c], g), unpack8(b[c], bb), unpack8(ur[c], uu);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float normed = __bfloat162float(__float2bfloat16(
                __fmaf_rn((f[i] - mean) * rstd, g[i], bb[i])));
            f[i] = normed * (u_silu ? silu_bf16(uu[i]) : uu[i]);
        }
        y[row * n_vecs + c] = pack8(f);
    }
    for (int c = lane; c < m_vecs; c += 32) {
        float r[8], ob[8];
        unpack8(x[row * m_vecs + c], r), unpack8(out_bias[c], ob);
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] += ob[i];
        xb[row * m_vecs + c] = pack8(r);
    }
}

// y = bf16(LayerNorm(x) * w + b): torch.nn.LayerNorm's result rounded once. One warp per row.
__global__ void __launch_bounds__(256) hstu_layer_norm(
    const uint4* __restrict__ x, long long x_stride_vecs, const uint4* __restrict__ w,
    const uint4* __restrict__ b, uint4* __restrict__ y, long long rows, int m_vecs, float eps) {
    int lane;
    const long long row = warp_row(lane);
    if (row >= rows) return;
    const uint4* a = x + row * x_stride_vecs;
    float mean, rstd, f[8];
    row_stats(a, m_vecs, eps, lane, mean, rstd);
    for (int c = lane; c < m_vecs; c += 32) {
        float g[8], bb[8];
        unpack8(a[c], f), unpack8(w[c], g), unpack8(b[c], bb);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __fmaf_rn((f[i] - mean) * rstd, g[i], bb[i]);
        y[row * m_vecs + c] = pack8(f);
    }
}

// dst = bf16(SiLU(src)) for n_vecs vectors of each row of src (a column block of a wider row),
// dst contiguous. One warp per row (no 64-bit division of a flat index: it cost ~30% here).
__global__ void __launch_bounds__(256) hstu_silu(
    const uint4* __restrict__ src, long long src_stride_vecs, uint4* __restrict__ dst,
    long long rows, int n_vecs) {
    int lane;
    const long long row = warp_row(lane);
    if (row >= rows) return;
    const uint4* s = src + row * src_stride_vecs;
    uint4* d = dst + row * n_vecs;
    for (int c = lane; c < n_vecs; c += 32) {
        float f[8];
        unpack8(s[c], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = silu_bf16(f[k]);
        d[c] = pack8(f);
    }
}

// out[t] = (is_action[t] ? actions[ids[t]] : items[ids[t]]) + positions[pos[t]], the bf16 add
// rounded once as torch's. Ids are validated before a batch is built. One warp per token.
__global__ void __launch_bounds__(256) hstu_embed(
    const long long* __restrict__ ids, const bool* __restrict__ is_action,
    const long long* __restrict__ pos, const uint4* __restrict__ items,
    const uint4* __restrict__ actions, const uint4* __restrict__ positions,
    uint4* __restrict__ out, long long rows, int m_vecs) {
    int lane;
    const long long t = warp_row(lane);
    if (t >= rows) return;
    const uint4* e = (is_action[t] ? actions : items) + ids[t] * m_vecs;
    const uint4* p = positions + pos[t] * m_vecs;
    for (int c = lane; c < m_vecs; c += 32) {
        float a[8], b[8];
        unpack8(e[c], a), unpack8(p[c], b);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] += b[k];
        out[t * m_vecs + c] = pack8(a);
    }
}
