// The end of an HSTU layer before its output projection, in one launch (the torch reference is
// streamgr/kernels/hstu_glue.py):
//   y  = bf16(bf16(LayerNorm(attn) * w + b) * u)      the projection's input
//   xb = bf16(x + out_bias)                          the residual its GEMM adds (beta = 1)
// so that x + W_o y + b_o is one GEMM (torch.addmm(xb, y, W_o^T)) instead of a norm, a multiply,
// a GEMM with bias and an add. The norm's statistics are fp32 (two passes over the row, which
// the first pass brings into L1: no catastrophic cancellation), and y is rounded to bf16
// twice, after the norm and after the multiply, as torch's unfused ops round it.
// One warp per row, 16-byte loads: N (attention width) and M (model width) multiples of 8,
// rows 16-byte aligned (the wrapper checks). No torch headers: compiled by NVRTC via CuPy.
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

}  // namespace

__global__ void __launch_bounds__(256) hstu_norm_mul(
    const uint4* __restrict__ attn, const uint4* __restrict__ u, long long u_stride_vecs,
    const uint4* __restrict__ w, const uint4* __restrict__ b, const uint4* __restrict__ x,
    const uint4* __restrict__ out_bias, uint4* __restrict__ y, uint4* __restrict__ xb,
    long long rows, int n_vecs, int m_vecs, float eps) {
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const uint4* a = attn + row * n_vecs;
    const float n = (float)(n_vecs * 8);
    float f[8], s = 0.0f;
    for (int c = lane; c < n_vecs; c += 32) {
        unpack8(a[c], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += f[i];
    }
    const float mean = warp_sum(s) / n;
    float q = 0.0f;
    for (int c = lane; c < n_vecs; c += 32) {
        unpack8(a[c], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) q = __fmaf_rn(f[i] - mean, f[i] - mean, q);
    }
    const float rstd = rsqrtf(warp_sum(q) / n + eps);
    const uint4* ur = u + row * u_stride_vecs;
    for (int c = lane; c < n_vecs; c += 32) {
        float g[8], bb[8], uu[8];
        unpack8(a[c], f), unpack8(w[c], g), unpack8(b[c], bb), unpack8(ur[c], uu);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float normed = __bfloat162float(__float2bfloat16(
                __fmaf_rn((f[i] - mean) * rstd, g[i], bb[i])));
            f[i] = normed * uu[i];
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
