// HSTU attention over a jagged batch whose history K/V live in pages or in contiguous rows.
// bf16 in/out, fp32 accumulation on tensor cores (WMMA 16x16x16).
//
// For user b, the query rows are its n_new new history tokens, then its n_cand candidates
// (rows q_start[b] .. q_start[b+1]). History keys 0..hist-1 come either from pages
// (paged[b] != 0: key j is slot j % page_size of page pages[page_ptr[b] + j / page_size] in a
// layer's store [pages, 2, page_size, H, D]) or from contiguous rows kv_row[b] + j of k/v.
// New history token i (position hist - n_new + i) attends keys 0..its position; a candidate
// attends every history key and its own key (row-aligned with its query in k/v), never another
// candidate. A = SiLU(alpha q k^T) * inv_n, with inv_n = 1/N for the fixed N of the model.
//
// One CUDA block = 64 query rows of one user and one head (a tile from the host's tile list),
// 4 warps of 16 rows. Per 64-key tile: S = Q K^T (tensor cores), pointwise SiLU and mask in
// fp32, P to bf16 in shared memory, O += P V (tensor cores). No softmax, so no running max:
// tiles simply accumulate. The key loop stops at the tile's last visible key (causal).
// No torch headers: compiled by NVRTC through CuPy's RawModule.

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

constexpr int BM = 64;
constexpr int BN = 64;

template <int D>
__global__ void __launch_bounds__(128) hstu_attention_fwd(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ store,
    __nv_bfloat16* __restrict__ out,
    const int* __restrict__ tile_user, const int* __restrict__ tile_row0,
    const int* __restrict__ q_start, const int* __restrict__ hist_len,
    const int* __restrict__ n_new, const int* __restrict__ n_cand,
    const int* __restrict__ paged, const int* __restrict__ kv_row,
    const int* __restrict__ page_ptr, const int* __restrict__ pages,
    int H, int page_size, float alpha, float inv_n) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [BM][D]
    __nv_bfloat16* Ks = Qs + BM * D;                              // [BN][D]
    __nv_bfloat16* Vs = Ks + BN * D;                              // [BN][D]
    float* Sf = reinterpret_cast<float*>(Vs + BN * D);            // [BM][BN]
    __nv_bfloat16* Pb = reinterpret_cast<__nv_bfloat16*>(Sf + BM * BN);  // [BM][BN]

    const int tile = blockIdx.x, h = blockIdx.y;
    const int b = tile_user[tile], row0 = tile_row0[tile];
    const int qs = q_start[b], hist = hist_len[b], nn = n_new[b], nc = n_cand[b];
    const int nrows = min(BM, nn + nc - row0);
    const int start = hist - nn;  // absolute position of the user's first new token
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long HD = (long long)H * D;
    constexpr int VEC = 8;  // bf16 per 16-byte load

    for (int i = threadIdx.x; i < BM * D / VEC; i += blockDim.x) {
        const int r = i / (D / VEC), c = (i % (D / VEC)) * VEC;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < nrows) val = *reinterpret_cast<const uint4*>(q + (qs + row0 + r) * HD + h * D + c);
        *reinterpret_cast<uint4*>(Qs + r * D + c) = val;
    }
    // A tile holding a candidate sees all history; else its last row's position bounds the keys.
    const int key_end = (row0 + nrows > nn) ? hist : start + row0 + nrows;
    const bool is_paged = paged[b] != 0;
    const int pbase = is_paged ? page_ptr[b] : 0;
    const long long krow = kv_row[b];

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);

    for (int key0 = 0; key0 < key_end; key0 += BN) {
        __syncthreads();  // the previous tile's K/V are no longer read
        for (int i = threadIdx.x; i < BN * D / VEC; i += blockDim.x) {
            const int r = i / (D / VEC), c = (i % (D / VEC)) * VEC;
            const int j = key0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (j < key_end) {  // zeros past the end: garbage could be NaN, and NaN * 0 = NaN
                const __nv_bfloat16 *kp, *vp;
                if (is_paged) {
                    const long long pg = pages[pbase + j / page_size];
                    const int off = j % page_size;
                    kp = store + ((pg * 2) * page_size + off) * HD + h * D + c;
                    vp = store + ((pg * 2 + 1) * page_size + off) * HD + h * D + c;
                } else {
                    kp = k + (krow + j) * HD + h * D + c;
                    vp = v + (krow + j) * HD + h * D + c;
                }
                kv = *reinterpret_cast<const uint4*>(kp);
                vv = *reinterpret_cast<const uint4*>(vp);
            }
            *reinterpret_cast<uint4*>(Ks + r * D + c) = kv;
            *reinterpret_cast<uint4*>(Vs + r * D + c) = vv;
        }
        __syncthreads();

        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s[BN / 16];
#pragma unroll
        for (int n = 0; n < BN / 16; ++n) wmma::fill_fragment(s[n], 0.0f);
#pragma unroll
        for (int d0 = 0; d0 < D; d0 += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
            wmma::load_matrix_sync(a, Qs + warp * 16 * D + d0, D);
#pragma unroll
            for (int n = 0; n < BN / 16; ++n) {
                // K^T as a column-major [D][BN] matrix is K row-major [BN][D].
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kb;
                wmma::load_matrix_sync(kb, Ks + n * 16 * D + d0, D);
                wmma::mma_sync(s[n], a, kb, s[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < BN / 16; ++n)
            wmma::store_matrix_sync(Sf + warp * 16 * BN + n * 16, s[n], BN, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 16 * BN; e += 32) {
            const int r = warp * 16 + e / BN, c = e % BN;
            const int lr = row0 + r, j = key0 + c;
            bool ok = false;
            if (r < nrows && j < hist) ok = (lr < nn) ? (j <= start + lr) : true;
            const float x = Sf[r * BN + c] * alpha;
            Pb[r * BN + c] = __float2bfloat16(ok ? x / (1.0f + __expf(-x)) * inv_n : 0.0f);
        }
        __syncwarp();
#pragma unroll
        for (int k0 = 0; k0 < BN; k0 += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> pa;
            wmma::load_matrix_sync(pa, Pb + warp * 16 * BN + k0, BN);
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> vb;
                wmma::load_matrix_sync(vb, Vs + k0 * D + n * 16, D);
                wmma::mma_sync(acc[n], pa, vb, acc[n]);
            }
        }
    }
    __syncthreads();  // K/V smem is reused for the fp32 output tile
    float* Of = reinterpret_cast<float*>(Ks);  // [BM][D] floats fit in Ks + Vs when BM == BN
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
        wmma::store_matrix_sync(Of + warp * 16 * D + n * 16, acc[n], D, wmma::mem_row_major);
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
        const int tr = warp * 16 + r;
        if (tr >= nrows) break;
        const int lr = row0 + tr;
        const long long g = (long long)(qs + lr) * HD + h * D;
        const bool cand = lr >= nn;
        float self = 0.0f;
        if (cand) {  // the candidate's own key and value sit in its own row of k/v
            float dot = 0.0f;
            for (int d = lane; d < D; d += 32)
                dot += __bfloat162float(Qs[tr * D + d]) * __bfloat162float(k[g + d]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            const float x = dot * alpha;
            self = x / (1.0f + __expf(-x)) * inv_n;
        }
        for (int d = lane; d < D; d += 32) {
            float o = Of[tr * D + d];
            if (cand) o += self * __bfloat162float(v[g + d]);
            out[g + d] = __float2bfloat16(o);
        }
    }
}

template __global__ void hstu_attention_fwd<32>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
    __nv_bfloat16*, const int*, const int*, const int*, const int*, const int*, const int*,
    const int*, const int*, const int*, const int*, int, int, float, float);
template __global__ void hstu_attention_fwd<64>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
    __nv_bfloat16*, const int*, const int*, const int*, const int*, const int*, const int*,
    const int*, const int*, const int*, const int*, int, int, float, float);
template __global__ void hstu_attention_fwd<128>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
    __nv_bfloat16*, const int*, const int*, const int*, const int*, const int*, const int*,
    const int*, const int*, const int*, const int*, int, int, float, float);
