// Per-row max and log-sum-exp of bf16 logits: the generate head's log-softmax without writing
// the fp32 [rows, vocab] matrix (streamgr/kernels/head_lse.py holds the torch reference).
//
// One block per row. The row is read from global memory once, in 16-byte vectors where the
// row's address allows, into shared memory (when it fits; else read twice), then reduced
// twice: the max, then sum(exp(x - max)) in fp32, as torch's log_softmax does (its epilogue
// is (x - max) - log(sum), which the caller applies to just the columns it gathers).
#include <cuda_bf16.h>

namespace {

// NVRTC has no <math.h> (no INFINITY): -inf by its bits.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <int THREADS>
__device__ float block_reduce(float v, float* scratch, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? scratch[lane] : (is_max ? neg_inf() : 0.f);
    for (int o = 16; o > 0; o >>= 1) {
      float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  v = scratch[32];
  __syncthreads();  // scratch is reused by the next reduction
  return v;
}

}  // namespace

// x: [rows, row_stride] bf16; the first n_cols columns of each row are the vocabulary.
// use_smem: the row (n_cols bf16) is staged in dynamic shared memory.
extern "C" __global__ void __launch_bounds__(512)
row_lse_bf16(const __nv_bfloat16* __restrict__ x, long long row_stride, int n_cols, int use_smem,
             float* __restrict__ row_max, float* __restrict__ row_logsum) {
  constexpr int THREADS = 512;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float scratch[33];
  __nv_bfloat16* srow = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const __nv_bfloat16* row = x + (long long)blockIdx.x * row_stride;
  const bool vec = (reinterpret_cast<unsigned long long>(row) % 16) == 0;
  const int n_vec = vec ? n_cols / 8 : 0;

  float m = neg_inf();
  // U loads issued before any is used: with one 16-byte load in flight per thread (a load,
  // its store and its max per trip) gen-ref's [8192, 24640] read at ~3.6 TB/s (session 17).
  constexpr int U = 4;
  for (int i0 = threadIdx.x; i0 < n_vec; i0 += U * THREADS) {
    uint4 u[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int i = i0 + k * THREADS;
      if (i < n_vec) u[k] = reinterpret_cast<const uint4*>(row)[i];
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int i = i0 + k * THREADS;
      if (i >= n_vec) break;
      if (use_smem) reinterpret_cast<uint4*>(srow)[i] = u[k];
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&u[k]);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, __bfloat162float(h[j]));
    }
  }
  for (int i = n_vec * 8 + threadIdx.x; i < n_cols; i += THREADS) {
    __nv_bfloat16 h = row[i];
    if (use_smem) srow[i] = h;
    m = fmaxf(m, __bfloat162float(h));
  }
  m = block_reduce<THREADS>(m, scratch, true);  // its __syncthreads also publishes srow

  // exp(x - m) as exp2(x log2e - m log2e): one FMA and ex2 per element where expf took ~10
  // instructions, and 16-byte reads, so that this pass hides under the next block's loads
  // (the kernel was ~2x its bytes' time at gen-ref's [8192, 24640]; session 14).
  const __nv_bfloat16* src = use_smem ? srow : row;
  const float l2e = 1.4426950408889634f, ml2e = -m * l2e;
  float s = 0.f;
  for (int i = threadIdx.x; i < n_vec; i += THREADS) {
    uint4 u = reinterpret_cast<const uint4*>(src)[i];
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += exp2f(fmaf(__bfloat162float(h[j]), l2e, ml2e));
  }
  for (int i = n_vec * 8 + threadIdx.x; i < n_cols; i += THREADS)
    s += exp2f(fmaf(__bfloat162float(src[i]), l2e, ml2e));
  s = block_reduce<THREADS>(s, scratch, false);
  if (threadIdx.x == 0) {
    row_max[blockIdx.x] = m;
    row_logsum[blockIdx.x] = logf(s);
  }
}
