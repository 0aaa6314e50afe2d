// T5 encoder self-attention with its relative-position bias computed inside: softmax(q k^T +
// bias) v per (request, head), no 1/sqrt(d) (T5 folds it into its weights), fp32 softmax, bf16
// in and out (streamgr/kernels/t5_attention.py holds the torch reference).
//
// bias(i, j) = bf16(table[h, j - i + S - 1]) (a [H, 2S - 1] fp32 table of distances, rounded
// to bf16 as it is read, as the dense bias it replaces was), and -inf where key j of the
// request is padding. cuDNN's fused attention took that bias only as a dense [R, H, S, S]
// tensor: 260 us per gen-ref layer ([32, 8, 784, 64]) plus 174 us per batch to write it,
// against 141 us with no bias at all (docs/benchmarks.md, session 13). Here the block reads
// the BM + S - 1 distances its rows need and the request's key mask into shared memory once.
//
// FlashAttention-2's forward, on mma.sync m16n8k16 (the fragment code of hstu_attention.cu):
// a block owns BM = 128 query rows of one (request, head), 4 warps x 2 m-tiles of 16 rows;
// K/V tiles of BN = 64 keys arrive by cp.async, STAGES deep, into padded shared rows; S
// stays in registers, the online softmax runs there in the log2 domain (one exp2 per score;
// the distances are stored pre-scaled, so a score costs one FMA before its max),
// P is repacked in registers as the A operand of O += P V. Each row's sum of P stays a
// per-thread partial until the end. The output is written as [R, S, H, D] rows, the layout the
// output projection reads, so no transpose copy follows.
// No torch headers: compiled by NVRTC through CuPy's RawModule.

#include <cuda_bf16.h>

namespace {

#include "hstu_common.cuh"

#include "mma_ops.cuh"

constexpr int MT = 2;                // 16-row m-tiles per warp
constexpr int WARPS = 4;
constexpr int BM = 16 * MT * WARPS;  // query rows per block
constexpr int BN = 64;               // keys per tile
// K/V tiles in flight (the wrapper's smem_bytes follows it). Three ran no faster than two on
// gen-ref's shapes (0.2110 against 0.2124 ms a layer; docs/benchmarks.md, session 15).
constexpr int STAGES = 2;
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

}  // namespace

// grid (ceil(S / BM), H, R), 128 threads. q/k/v: [R, S, H, D] through (request, token)
// strides in elements, unit head and column strides; table [H, 2S - 1] fp32; keep [R, S] bytes
// (0: padding); out [R, S, H, D] contiguous. Dynamic shared memory: t5_smem_bytes below.
template <int D>
__global__ void __launch_bounds__(128, 2) t5_attn_fwd(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, long long sq_r, long long sq_t, long long sk_r,
    long long sk_t, long long sv_r, long long sv_t, const float* __restrict__ table,
    const unsigned char* __restrict__ keep, int S, int H, __nv_bfloat16* __restrict__ out) {
    constexpr int SP = D + 8;  // padded shared row (bf16): ldmatrix rows in distinct banks
    const int SR = (S + BN - 1) / BN * BN;  // keys rounded up to whole tiles
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [BM][SP]
    __nv_bfloat16* Ks = Qs + BM * SP;                             // [STAGES][BN][SP]
    __nv_bfloat16* Vs = Ks + STAGES * BN * SP;                    // [STAGES][BN][SP]
    float* tb = reinterpret_cast<float*>(Vs + STAGES * BN * SP);  // [BM + SR] distances
    float* kadd = tb + BM + SR;                                   // [SR] 0 or -inf per key

    const int q0 = blockIdx.x * BM, h = blockIdx.y, r = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wrow = warp * 16 * MT;
    constexpr int VEC = 8, CPR = D / VEC, RPP = 128 / CPR;  // 16-byte copies per row, rows/pass

    {  // Q rows q0 .. q0 + BM - 1 (past S zero-filled)
        const int r0 = tid / CPR, c0 = (tid % CPR) * VEC;
        const __nv_bfloat16* qp = q + r * sq_r + (long long)(q0 + r0) * sq_t + h * D + c0;
#pragma unroll 2
        for (int i = r0; i < BM; i += RPP) {
            const bool ok = q0 + i < S;
            cp_async16(Qs + i * SP + c0, ok ? qp : q, ok ? 16 : 0);
            qp += RPP * sq_t;
        }
    }
    cp_async_commit();
    // Distances: tb[j - li + BM - 1] = table[h, j - (q0 + li) + S - 1] for local row li.
    const float* th = table + (long long)h * (2 * S - 1);
    const int base = S - q0 - BM;  // table index of tb[0]
    for (int x = tid; x < BM + SR; x += 128) {
        const int ti = x + base;
        tb[x] = (ti >= 0 && ti < 2 * S - 1)
                    ? __bfloat162float(__float2bfloat16_rn(th[ti])) * LOG2E : 0.0f;
    }
    for (int j = tid; j < SR; j += 128)
        kadd[j] = (j < S && keep[(long long)r * S + j]) ? 0.0f : neg_inf();

    auto load_kv = [&](int stage, int kt) {
        const int r0 = tid / CPR, c0 = (tid % CPR) * VEC;
        const int j0 = kt * BN + r0;
        const __nv_bfloat16* kp = k + r * sk_r + (long long)j0 * sk_t + h * D + c0;
        const __nv_bfloat16* vp = v + r * sv_r + (long long)j0 * sv_t + h * D + c0;
        __nv_bfloat16* kd = Ks + stage * BN * SP + r0 * SP + c0;
        __nv_bfloat16* vd = Vs + stage * BN * SP + r0 * SP + c0;
#pragma unroll
        for (int m = 0; m < BN * CPR / 128; ++m) {
            const bool ok = j0 + m * RPP < S;  // past S zero-filled (garbage could be NaN)
            cp_async16(kd + m * RPP * SP, ok ? kp : k, ok ? 16 : 0);
            cp_async16(vd + m * RPP * SP, ok ? vp : v, ok ? 16 : 0);
            kp += RPP * sk_t;
            vp += RPP * sv_t;
        }
    };

    float acc[MT][D / 8][4];
    float mrow[MT][2], lsum[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
#pragma unroll
        for (int hl = 0; hl < 2; ++hl) mrow[m][hl] = neg_inf(), lsum[m][hl] = 0.0f;
    }
    // A warp whose rows all lie past S computes nothing (its loads still run with the block).
    const bool active = q0 + wrow < S;

    auto tile_step = [&](const __nv_bfloat16* Kt, const __nv_bfloat16* Vt, int kt) {
        float Sc[MT][BN / 8][4];
        qk_tile<MT, MT, BN, D, SP>(Sc, Qs, Kt, wrow, lane);
        // Bias, mask, online softmax (log2 domain) per row half hl (rows g and g + 8).
        // Score (li, j) needs tb[j - li + BM - 1]; for this thread j - li = B0 + 8 a + e with
        // a = n - 2 m - hl in [-(2 MT - 1), BN / 8 - 1] and e in {0, 1}: 2 (BN / 8 + 2 MT - 1)
        // distinct distances per tile (22), read once, not once per score (64: the shared
        // loads outnumbered the MMAs). The key mask is per column: BN / 4 values.
        const int kb = kt * BN;
        constexpr int NA = BN / 8 + 2 * MT - 1;
        const int B0 = kb + 2 * t - wrow - g + BM - 1 - 8 * (2 * MT - 1);
        float bias[NA][2], madd[BN / 8][2];
#pragma unroll
        for (int a = 0; a < NA; ++a) bias[a][0] = tb[B0 + 8 * a], bias[a][1] = tb[B0 + 8 * a + 1];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            const float2 kv = *reinterpret_cast<const float2*>(kadd + kb + n * 8 + 2 * t);
            madd[n][0] = kv.x, madd[n][1] = kv.y;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                float mx = neg_inf();
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        // distances are pre-scaled by log2(e) (tb below)
                        const float s = fmaf(Sc[m][n][hl * 2 + e], LOG2E,
                                             bias[n - 2 * m - hl + 2 * MT - 1][e] + madd[n][e]);
                        Sc[m][n][hl * 2 + e] = s;
                        mx = fmaxf(mx, s);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mnew = fmaxf(mrow[m][hl], mx);
                const float ref = mnew == neg_inf() ? 0.0f : mnew;  // all masked so far
                const float scale = exp2f(mrow[m][hl] - ref);
                mrow[m][hl] = mnew;
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(Sc[m][n][hl * 2 + e] - ref);
                        Sc[m][n][hl * 2 + e] = p;
                        sum += p;
                    }
                lsum[m][hl] = lsum[m][hl] * scale + sum;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    acc[m][n][hl * 2] *= scale;
                    acc[m][n][hl * 2 + 1] *= scale;
                }
            }
        pv_tile<MT, MT, BN, D, SP>(acc, Sc, Vt, lane);
    };

    const int ntiles = SR / BN;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {  // tiles 0 .. STAGES - 2 in flight
        if (st < ntiles) load_kv(st, st);
        cp_async_commit();
    }
    for (int kt = 0; kt < ntiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        // tile kt (and Q, the distances, the mask) landed for all, and every warp is done
        // with tile kt - 1, whose stage the load below refills
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < ntiles) load_kv(nk % STAGES, nk);
        cp_async_commit();
        if (active) tile_step(Ks + (kt % STAGES) * BN * SP, Vs + (kt % STAGES) * BN * SP, kt);
    }
    cp_async_wait<0>();
    if (!active) return;

    const long long HD = (long long)H * D;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int hl = 0; hl < 2; ++hl) {
            float l = lsum[m][hl];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int i = q0 + wrow + m * 16 + g + hl * 8;
            if (i >= S) continue;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // a request with no real key: 0
            __nv_bfloat16* o = out + ((long long)r * S + i) * HD + h * D + 2 * t;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<unsigned*>(o + n * 8) =
                    pack_bf16(acc[m][n][hl * 2] * inv, acc[m][n][hl * 2 + 1] * inv);
        }
}

// Explicit instances for nvcc's build check (NVRTC instantiates through name expressions).
template __global__ void t5_attn_fwd<32>(const __nv_bfloat16*, const __nv_bfloat16*,
                                         const __nv_bfloat16*, long long, long long, long long,
                                         long long, long long, long long, const float*,
                                         const unsigned char*, int, int, __nv_bfloat16*);
template __global__ void t5_attn_fwd<64>(const __nv_bfloat16*, const __nv_bfloat16*,
                                         const __nv_bfloat16*, long long, long long, long long,
                                         long long, long long, long long, const float*,
                                         const unsigned char*, int, int, __nv_bfloat16*);
