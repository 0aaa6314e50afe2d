// The T5 encoder's additive attention bias, dense: relative-position bias plus key padding,
// [rows, heads, S, S] bf16, written once per batch for the fused attention kernel
// (streamgr/kernels/encoder_bias.py holds the torch reference).
//
// out[r, h, i, j] = keep[r, j] ? bf16(table[h, j - i + S - 1]) : masked
// The torch expression (a [1, H, S, S] bias broadcast-added to a [R, 1, 1, S] mask) ran as a
// generic strided elementwise kernel at ~0.8 TB/s (0.22 ms for gen-ref's 177 MB); here each
// thread writes 8 consecutive keys as one 16-byte store, and the [H, 2S - 1] table (a few KB)
// stays in cache.
#include <cuda_bf16.h>

// table: [H, 2S - 1] fp32; keep: [R, S] bytes (0/1), 8-byte aligned rows; S % 8 == 0;
// out: [R, H, S, S] bf16. Grid (ceil(S * S / 8 / 256), R * H): no 64-bit division per vector.
extern "C" __global__ void __launch_bounds__(256)
encoder_bias_bf16(const float* __restrict__ table, const unsigned char* __restrict__ keep,
                  int H, int S, unsigned short masked_bits, __nv_bfloat16* __restrict__ out) {
  const int per_row = S >> 3;  // 16-byte vectors per [i, :] row
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= S * per_row) return;
  const int rh = blockIdx.y, h = rh % H, r = rh / H;
  const int i = idx / per_row;
  const int j0 = (idx - i * per_row) * 8;
  const float* t = table + (long long)h * (2 * S - 1) + (S - 1 - i) + j0;
  const uint2 k8 = *reinterpret_cast<const uint2*>(keep + (long long)r * S + j0);
  const unsigned char* k = reinterpret_cast<const unsigned char*>(&k8);
  __align__(16) unsigned short w[8];
#pragma unroll
  for (int q = 0; q < 8; ++q)
    w[q] = k[q] ? __bfloat16_as_ushort(__float2bfloat16_rn(t[q])) : masked_bits;
  reinterpret_cast<uint4*>(out)[((long long)rh * S + i) * per_row + (j0 >> 3)] =
      *reinterpret_cast<const uint4*>(w);
}
