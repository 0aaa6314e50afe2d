// The slots side of hstu_attention.cu: a chunk partial folded into its fp32 slot, a row's
// total written as bf16 (with a candidate's own key), and the merge kernel that adds a tile's
// slots in chunk order. Included after the kernel's constants (BM, and the helpers of
// hstu_common.cuh); the loader inlines it for NVRTC.

namespace {

// The rows of the tile at row0 of a user with `left` rows from there on: all of them when they
// fit in max_rows (BM, or SR where tiles carry tails: the plan's rule in plan_host), else BM.
__device__ __forceinline__ int tile_rows(int left, int max_rows) {
    return left <= max_rows ? left : BM;
}

struct Batch {
    const __nv_bfloat16* q;
    const __nv_bfloat16* k;
    const __nv_bfloat16* v;
    __nv_bfloat16* out;
    long long sq, sk, sv;  // row strides (elements) of q, k, v; a head's D elements are contiguous
    int H;
    float alpha, inv_n;
};

// One row's chunk partial (columns 8 n + 2 t (+ 1) of `x`'s NT n-tiles, halves hl of its fragments) into
// its slot at `w`: stored, or (DIRECT) added to what the slot holds (0 for the first chunk).
// Every old value is loaded before any store: the stores could alias later loads for all the
// compiler knows, which would make each of the D / 8 loads a full global round trip in turn.
template <int NT, bool DIRECT>
__device__ __forceinline__ void fold_row(float* w, const float (&x)[NT][4], int hl,
                                         bool first) {
    float2 o[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n)
        o[n] = (DIRECT && !first) ? *reinterpret_cast<const float2*>(w + n * 8)
                                  : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        float2 v = make_float2(x[n][2 * hl], x[n][2 * hl + 1]);
        if (DIRECT) v = make_float2(__fadd_rn(o[n].x, v.x), __fadd_rn(o[n].y, v.y));
        *reinterpret_cast<float2*>(w + n * 8) = v;
    }
}

// Writes one query row (global row `g`, head h) from its attention total o (lane holds
// d = lane + 32 i), adding a candidate's own key. Both the direct and the merge path end here,
// so their arithmetic is the same instruction for instruction.
template <int D>
__device__ __forceinline__ void store_row(const Batch& p, float (&o)[D / 32], long long g, int h,
                                          bool cand, int lane) {
    if (cand) {
        const __nv_bfloat16* qr = p.q + g * p.sq + h * D;
        const __nv_bfloat16* kr = p.k + g * p.sk + h * D;
        const __nv_bfloat16* vr = p.v + g * p.sv + h * D;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
            dot = __fmaf_rn(__bfloat162float(qr[lane + 32 * i]), __bfloat162float(kr[lane + 32 * i]), dot);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, s));
        const float self = silu_n(dot, 0.5f * p.alpha, p.inv_n);
#pragma unroll
        for (int i = 0; i < D / 32; ++i) o[i] = __fmaf_rn(self, __bfloat162float(vr[lane + 32 * i]), o[i]);
    }
    __nv_bfloat16* orow = p.out + g * (long long)(p.H * D) + h * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) orow[lane + 32 * i] = __float2bfloat16(o[i]);
}

}  // namespace

// grid (row tiles x slot_rows / 4, H), 128 threads, one warp per row:
// out = bf16(0 + slot0 + slot1 + ... (+ own key)). Slot loads are issued four at a time ahead of
// their adds (the adds stay in slot order).
template <int D>
__global__ void __launch_bounds__(128) hstu_attn_merge(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out,
    const float* __restrict__ ws, const int* __restrict__ fin_user,
    const int* __restrict__ fin_row0, const int* __restrict__ fin_slot0,
    const int* __restrict__ fin_nslots, const int* __restrict__ q_start,
    const int* __restrict__ n_new, const int* __restrict__ n_cand,
    int H, long long sq, long long sk, long long sv, float alpha, float inv_n, int max_rows,
    int slot_rows) {
    const int PER = slot_rows / 4;  // blocks per row tile
    const int f = blockIdx.x / PER, h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = (blockIdx.x % PER) * 4 + warp;
    const int b = fin_user[f], row0 = fin_row0[f], slot0 = fin_slot0[f], ns = fin_nslots[f];
    const int qs = q_start[b], nn = n_new[b];
    if (r >= tile_rows(nn + n_cand[b] - row0, max_rows)) return;
    const Batch p{q, k, v, out, sq, sk, sv, H, alpha, inv_n};
    const long long slot_stride = (long long)H * slot_rows * D;
    const float* w = ws + ((long long)slot0 * H + h) * slot_rows * D + r * D + lane;
    float o[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) o[i] = 0.0f;
    int s = 0;
    for (; s + 4 <= ns; s += 4) {
        float x[4][D / 32];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < D / 32; ++i) x[j][i] = w[(s + j) * slot_stride + 32 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < D / 32; ++i) o[i] = __fadd_rn(o[i], x[j][i]);
    }
    for (; s < ns; ++s)
#pragma unroll
        for (int i = 0; i < D / 32; ++i) o[i] = __fadd_rn(o[i], w[s * slot_stride + 32 * i]);
    const int lr = row0 + r;
    store_row<D>(p, o, qs + lr, h, lr >= nn, lane);
}
