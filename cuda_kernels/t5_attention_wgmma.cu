// arch: sm_90a (wgmma). The T5 encoder self-attention of t5_attention.cu (softmax(q k^T + bias)
// v, the bias from the [H, 2S - 1] distance table, -inf on padding keys, no 1/sqrt(d), bf16 in
// and out, fp32 softmax; streamgr/kernels/t5_attention.py holds the torch reference) on
// Hopper's warpgroup MMA, in the structure of hstu_attention_wgmma.cu (FlashAttention-3's):
//   - a block is three warpgroups: a producer that issues every copy (Q, then each K/V tile of
//     BN keys once its stage is free, by cp.async into the 128-byte swizzled layout wgmma
//     reads, signalled on mbarriers), and two consumers of 64 query rows each;
//   - S = Q K^T by wgmma from shared memory, the bias, mask and online softmax on S in
//     registers (log2 domain, distances pre-scaled, one exp2 per score), P repacked in
//     registers as the A operand of O += P V (V an MN-major B operand from shared memory);
//   - S of tile kt + 1 is in flight with P V of tile kt (the softmax of kt + 1 runs while P V of
//     kt does; O's rescale waits for it), and the two consumers take turns issuing (ping-pong).
// The mma.sync kernel ran gen-ref's layer ([32, 784, 8, 64]) at ~190 TFLOP/s, 8 warps an SM.
// BIAS = false is the decoder's cross-attention (softmax(q k^T) v over a request's encoder
// positions, -inf on padding, no bias): Sq query rows (a request's beams) against S keys,
// the same loop without the distances (cuDNN ran gen-ref's at ~200 TFLOP/s).
// Head dim 64 only (gen-ref's; the wrapper keeps t5_attention.cu for 32). The body is empty
// for targets without wgmma, where the wrapper never launches it.
// No torch headers: compiled by NVRTC (-arch=sm_90a) through CuPy.

#include <cuda_bf16.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define T5_WGMMA 1
#endif

namespace {

// Query rows per block: 128 (two consumer warpgroups of 64, one block an SM) or 64 (one
// consumer, two blocks an SM: one block's prologue and fill under the other's math).
#ifndef T5_WG_BM
#define T5_WG_BM 128
#endif
constexpr int BM = T5_WG_BM;
constexpr int CONSUMERS = BM / 64;
#ifndef T5_WG_BN
#define T5_WG_BN 128
#endif
constexpr int BN = T5_WG_BN;  // keys per tile (64 or 128)
#ifndef T5_WG_PINGPONG
#define T5_WG_PINGPONG 1
#endif
#ifndef T5_WG_STAGES
#define T5_WG_STAGES 3
#endif
constexpr int STAGES = T5_WG_STAGES;
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int CT = THREADS - 128;  // consumer threads
// Registers: one block of 384 (128 x 40 + 256 x 224 <= 64 K) or two of 256, each within 32 K
// (128 x 40 + 128 x 216).
constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 224 : 216;
constexpr float LOG2E = 1.4426950408889634f;
static_assert(STAGES >= 2, "S of one tile and P V of the previous need two stages");
static_assert((BM == 128 || BM == 64) && (BN == 64 || BN == 128) && LOG2E > 1.0f,
              "a producer and two consumer warpgroups of 64 rows, whole k16 steps");

#ifdef T5_WGMMA
#include "hstu_common.cuh"

#include "wgmma_ops.cuh"

#include "wgmma_tiles.cuh"

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// 2^x as one MUFU op (exp2f's denormal handling costs three more instructions a score, and the
// softmax's instruction issue, not the tensor cores, bounds this kernel: ncu, session 16).
// Results below 2^-126 flush to zero, far under what P's bf16 rounding keeps beside the max.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// A key tile's scores (this thread's S fragment, rows g and g + 8, keys 8 n + 2 t (+ 1)) with
// their distances (bp: tb at this thread's first score; score (hl, n, e) takes bp[8 (n - hl) +
// e]) and, where MASKED, the keys' mask (ka: kadd at key 2 t of the tile), in place, in the
// log2 domain; mx: each row half's max over this thread's scores.
template <bool MASKED, bool BIAS>
__device__ __forceinline__ void biased_scores(float (&s)[BN / 2], const float* bp,
                                              const float* ka, float (&mx)[2]) {
#pragma unroll
    for (int hl = 0; hl < 2; ++hl) {
        float m = neg_inf();
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            float b0 = 0.0f, b1 = 0.0f;
            if constexpr (BIAS) {
                b0 = bp[8 * (n - hl)];
                b1 = bp[8 * (n - hl) + 1];
            }
            if constexpr (MASKED) {
                const float2 kv = *reinterpret_cast<const float2*>(ka + n * 8);
                b0 += kv.x;
                b1 += kv.y;
            }
            const float x0 = fmaf(s[4 * n + 2 * hl], LOG2E, b0);
            const float x1 = fmaf(s[4 * n + 2 * hl + 1], LOG2E, b1);
            s[4 * n + 2 * hl] = x0;
            s[4 * n + 2 * hl + 1] = x1;
            m = fmaxf(m, fmaxf(x0, x1));
        }
        mx[hl] = m;
    }
}
#endif  // T5_WGMMA

}  // namespace

// grid (ceil(Sq / BM), H, R), THREADS threads; arguments as t5_attn_fwd (t5_attention.cu) with the
// query count Sq beside the key count S (the encoder: Sq = S; out [R, Sq, H, D]); without BIAS
// `table` is unused. Dynamic
// shared memory (the wrapper's wg_smem_bytes): 1 KB of alignment slack, Q, STAGES K and V tiles,
// 2 STAGES + 1 mbarriers, then BM + SR distances and SR key offsets (fp32).
template <int D, bool BIAS>
__global__ void __launch_bounds__(THREADS, 3 - CONSUMERS) t5_attn_fwd_wg(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, long long sq_r, long long sq_t, long long sk_r,
    long long sk_t, long long sv_r, long long sv_t, const float* __restrict__ table,
    const unsigned char* __restrict__ keep, int Sq, int S, int H,
    __nv_bfloat16* __restrict__ out) {
#ifdef T5_WGMMA
    static_assert(D == 64, "the swizzled copy loop below is written for 64-column rows");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // Swizzle atoms must start at 1,024-byte boundaries (the wrapper adds 1 KB for this).
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [BM x D] (tile_off)
    __nv_bfloat16* Ks = Qs + BM * D;                              // [STAGES][BN x D]
    __nv_bfloat16* Vs = Ks + STAGES * BN * D;                     // [STAGES][BN x D]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(Vs + STAGES * BN * D);
    unsigned long long* empty = full + STAGES;
    unsigned long long* q_full = empty + STAGES;
    const int SR = (S + BN - 1) / BN * BN;  // keys rounded up to whole tiles
    float* tb = reinterpret_cast<float*>(q_full + 2);  // [BM + SR] distances (x log2 e)
    float* kadd = tb + BM + SR;                        // [SR] 0 or -inf per key
    int* tmask = reinterpret_cast<int*>(kadd + SR);    // [SR / BN] 1: the tile has a masked key

    const int q0 = blockIdx.x * BM, h = blockIdx.y, r = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, wq = (tid >> 5) & 3;
    const int consumers = CONSUMERS == 2 && Sq - q0 > 64 ? 2 : 1;  // warpgroups with rows
    const int ntiles = SR / BN;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + s, 128);             // every producer thread's copies of the stage
            mbar_init(empty + s, 4 * consumers);  // every consumer warp done with it
        }
        mbar_init(q_full, 128);
    }
    for (int i = tid - 128; i >= 0 && i < ntiles; i += CT) tmask[i] = 0;  // (set after the sync)
    __syncthreads();  // the barriers initialized, for all (the last block-wide barrier)

    constexpr int CH = D / 8;  // 16-byte chunks per row
    if (wg == 0) {  // the producer
        set_max_regs_dec<40>();
        for (int i = tid; i < BM * CH; i += 128) {  // Q rows q0 .. q0 + BM - 1 (past Sq zero)
            int rr, c;
            copy_rc<D>(i, rr, c);
            const bool ok = q0 + rr < Sq;
            cp_async16(Qs + tile_off<D, BM>(rr, c),
                       ok ? q + r * sq_r + (long long)(q0 + rr) * sq_t + h * D + c : q,
                       ok ? 16 : 0);
        }
        cp_async_mbar_arrive(q_full);
        // A thread copies one 16-byte column c of every RS-th row (its shared offset moves by
        // whole rows, keeping the swizzle phase), K and V of the same rows.
        constexpr int RS = 128 / CH, PASSES = BN * CH / 128;
        static_assert(RS % 8 == 0, "rows per pass keep the swizzle phase");
        const int r0 = tid / CH, c = (tid % CH) * 8;
        const int so = tile_off<D, BN>(r0, c);
        for (int kt = 0; kt < ntiles; ++kt) {
            const int stage = kt % STAGES;
            mbar_wait(empty + stage, ((kt / STAGES) & 1) ^ 1);
            __nv_bfloat16* kd = Ks + stage * BN * D + so;
            __nv_bfloat16* vd = Vs + stage * BN * D + so;
            const int j0 = kt * BN + r0;
            const __nv_bfloat16* kp = k + r * sk_r + (long long)j0 * sk_t + h * D + c;
            const __nv_bfloat16* vp = v + r * sv_r + (long long)j0 * sv_t + h * D + c;
#pragma unroll 4
            for (int m = 0; m < PASSES; ++m) {
                const bool ok = j0 + m * RS < S;  // past S zero-filled (garbage could be NaN)
                cp_async16(kd + m * RS * 64, ok ? kp : k, ok ? 16 : 0);
                cp_async16(vd + m * RS * 64, ok ? vp : v, ok ? 16 : 0);
                kp += RS * sk_t;
                vp += RS * sv_t;
            }
            cp_async_mbar_arrive(full + stage);
        }
        cp_async_wait<0>();
        return;
    }

    // The consumers: warpgroup cw owns rows 64 cw .. 64 cw + 63 of the tile.
    set_max_regs_inc<CONSUMER_REGS>();
    const int cw = wg - 1;
    // Distances: tb[j - li + BM - 1] = bf16(table[h, j - (q0 + li) + S - 1]) log2(e) for local
    // row li; the key mask as an additive 0 / -inf. The consumers fill them while the
    // producer's first copies are in flight, then meet at named barrier 3 (both warpgroups,
    // also one without rows, which leaves after it).
    // Loads in rounds of U per thread, all issued before their stores (a load, then its
    // store, in a loop took one L2 round trip per element: ~8 per block for gen-ref, before
    // any softmax could run).
    {
        constexpr int U = 4;
        const int ct = tid - 128;
        const float* th = table + (long long)h * (2 * S - 1);
        const unsigned char* kr = keep + (long long)r * S;
        const int base = S - q0 - BM;  // table index of tb[0]
        const int fill = BIAS ? BM + SR : SR;  // (no distances without the bias)
        for (int x0 = ct; x0 < fill; x0 += CT * U) {
            float tv[U];
            unsigned char kv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int x = x0 + CT * u, ti = x + base;
                tv[u] = (BIAS && x < BM + SR && ti >= 0 && ti < 2 * S - 1) ? th[ti] : 0.0f;
                kv[u] = x < S ? kr[x] : 0;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int x = x0 + CT * u;
                if (BIAS && x < BM + SR)
                    tb[x] = __bfloat162float(__float2bfloat16_rn(tv[u])) * LOG2E;
                if (x < SR) {
                    kadd[x] = kv[u] ? 0.0f : neg_inf();
                    if (!kv[u]) tmask[x / BN] = 1;  // (every writer writes the same)
                }
            }
        }
        named_sync(3, CT);
    }
    if (cw >= consumers) return;  // no rows (its warps are not counted in `empty`)
    const int g = lane >> 2, t = lane & 3;
    const int wrow = cw * 64 + wq * 16;  // the warp's first row in the tile

    float acc[D / 2];  // O: rows wrow + g (+ 8), columns 8 n + 2 t (+ 1): acc[4 n + 2 hl + e]
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
    float mrow[2] = {neg_inf(), neg_inf()}, lsum[2] = {0.0f, 0.0f}, resc[2];

    float s[BN / 2];  // S of one key tile, the same layout over keys
    auto issue_s = [&](int stage) {
        const __nv_bfloat16* Kt = Ks + stage * BN * D;
        fence_regs(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_s_ss<BN>(s, kmaj_desc<D, BM>(Qs, cw * 64, kk), kmaj_desc<D, BN>(Kt, 0, kk),
                           kk > 0);
        wg_commit();
    };
    // S (landed) of tile kt -> P (bf16 A fragments), with the running max and sum; resc: the
    // factor O must take (once the P V in flight has completed) before this P is added.
    auto softmax_p = [&](int kt, unsigned (&p)[BN / 16][4]) {
        fence_regs(s);
        const int kb = kt * BN;
        // score (row wrow + g + 8 hl, key kb + 8 n + 2 t + e) takes tb[B0 + 8 (n - hl) + e]
        const int B0 = kb + 2 * t - wrow - g + BM - 1;
        float mxs[2];
        // two copies of the loop, so that a tile of real keys issues no mask work
        if (tmask[kt]) biased_scores<true, BIAS>(s, tb + B0, kadd + kb + 2 * t, mxs);
        else biased_scores<false, BIAS>(s, tb + B0, kadd + kb + 2 * t, mxs);
#pragma unroll
        for (int hl = 0; hl < 2; ++hl) {
            float mx = mxs[hl];
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[hl], mx);
            const float ref = mnew == neg_inf() ? 0.0f : mnew;  // all masked so far
            resc[hl] = ex2(mrow[hl] - ref);
            mrow[hl] = mnew;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = ex2(s[4 * n + 2 * hl + e] - ref);
                    s[4 * n + 2 * hl + e] = pv;
                    sum += pv;
                }
            lsum[hl] = lsum[hl] * resc[hl] + sum;
        }
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            p[kc][0] = pack_bf16(s[8 * kc + 0], s[8 * kc + 1]);
            p[kc][1] = pack_bf16(s[8 * kc + 2], s[8 * kc + 3]);
            p[kc][2] = pack_bf16(s[8 * kc + 4], s[8 * kc + 5]);
            p[kc][3] = pack_bf16(s[8 * kc + 6], s[8 * kc + 7]);
        }
    };
    auto rescale = [&]() {
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                acc[4 * n + 2 * hl] *= resc[hl];
                acc[4 * n + 2 * hl + 1] *= resc[hl];
            }
    };
    auto issue_pv = [&](unsigned (&p)[BN / 16][4], int kt) {
        const __nv_bfloat16* Vt = Vs + (kt % STAGES) * BN * D;
        fence_regs(p);
        fence_regs(acc);
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) wgmma_pv<D>(acc, p[kc], v_desc<D, BN>(Vt, kc), 1);
        wg_commit();
    };
    auto wait_full = [&](int kt) {
        mbar_wait(full + kt % STAGES, (kt / STAGES) & 1);
        fence_async_smem();
    };
    auto release = [&](int kt) {  // this warp's MMAs on tile kt's stage have completed
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + kt % STAGES);
    };
    // Ping-pong turns (wgmma_tiles.cuh): the first S, then one issue point per tile.
    PingPong turns(T5_WG_PINGPONG && consumers == 2, cw, 1 + ntiles);

    mbar_wait(q_full, 0);
    wait_full(0);
    turns.wait();
    issue_s(0);
    turns.hand_over();
    wg_wait<0>();
    unsigned pa[BN / 16][4], pb[BN / 16][4];
    softmax_p(0, pa);  // (O is zero: no rescale)
    // Two P buffers swapped by unrolling two tiles per trip, the last tile peeled off (see
    // hstu_attention_wgmma.cu: otherwise ptxas serializes every wgmma).
    auto step = [&](int kt, unsigned (&cur)[BN / 16][4], unsigned (&nxt)[BN / 16][4]) {
        wait_full(kt + 1);
        turns.wait();
        issue_s((kt + 1) % STAGES);
        issue_pv(cur, kt);
        turns.hand_over();
        wg_wait<1>();  // S of tile kt + 1 (P V of tile kt may still run)
        softmax_p(kt + 1, nxt);
        wg_wait<0>();
        fence_regs(acc);
        fence_regs(cur);
        release(kt);
        rescale();
    };
    auto last = [&](int kt, unsigned (&cur)[BN / 16][4]) {
        turns.wait();
        issue_pv(cur, kt);
        turns.hand_over();
        wg_wait<0>();
        fence_regs(acc);
        fence_regs(cur);
        release(kt);
    };
    int kt = 0;
    for (; kt + 2 < ntiles; kt += 2) {
        step(kt, pa, pb);
        step(kt + 1, pb, pa);
    }
    if (kt + 1 < ntiles) {
        step(kt, pa, pb);
        last(kt + 1, pb);
    } else {
        last(kt, pa);
    }

    const long long HD = (long long)H * D;
#pragma unroll
    for (int hl = 0; hl < 2; ++hl) {
        float l = lsum[hl];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int i = q0 + wrow + g + hl * 8;
        if (i >= Sq) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // a request with no real key: 0
        __nv_bfloat16* o = out + ((long long)r * Sq + i) * HD + h * D + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(o + n * 8) =
                pack_bf16(acc[4 * n + 2 * hl] * inv, acc[4 * n + 2 * hl + 1] * inv);
    }
#endif  // T5_WGMMA
}

// Explicit instances for nvcc's build check (NVRTC instantiates through the name expression).
template __global__ void t5_attn_fwd_wg<64, true>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, long long, long long,
    long long, long long, long long, long long, const float*, const unsigned char*, int, int,
    int, __nv_bfloat16*);
template __global__ void t5_attn_fwd_wg<64, false>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, long long, long long,
    long long, long long, long long, long long, const float*, const unsigned char*, int, int,
    int, __nv_bfloat16*);
