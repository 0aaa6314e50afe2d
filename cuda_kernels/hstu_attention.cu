// HSTU attention over a jagged batch whose history K/V live in pages or in contiguous rows,
// split over keys. bf16 in/out, fp32 accumulation on tensor cores (mma.sync m16n8k16).
//
// For user b, the query rows are its n_new new history tokens, then its n_cand candidates
// (rows q_start[b] .. q_start[b+1]). History keys 0..hist-1 come either from pages
// (paged[b] != 0: key j is slot j % page_size of page pages[page_ptr[b] + j / page_size] in a
// layer's store [pages, 2, page_size, H, D]) or from contiguous rows kv_row[b] + j of k/v.
// New history token i (position hist - n_new + i) attends keys 0..its position; a candidate
// attends every history key and its own key (row-aligned with its query in k/v), never another
// candidate. A = SiLU(alpha q k^T) * inv_n, with inv_n = 1/N for the fixed N of the model.
//
// HSTU has no softmax, so partial sums of P V over key ranges simply add. Keys are cut into
// chunks of KC (HSTU_KC, 512) positions; rows into tiles of BM = 128. A work item is (user,
// row tile, a range of key tiles, a workspace slot); the host's plan picks, per batch, either
//   - direct (hstu_attn_fwd<D, true>): one item per row tile over all its keys, folding each
//     chunk's partial into the tile's fp32 slot (slot = slot + chunk; the first: 0 + chunk);
//   - split (hstu_attn_fwd<D, false>): one item per (row tile, chunk), each chunk's partial in
//     its own slot,
// then hstu_attn_merge adds a tile's slots in chunk order (0 + s0 + s1 + ...: one slot in the
// direct plan), adds a candidate's own key and writes bf16. Both plans add the same fp32 chunk
// partials in the same order with the same rounding, so a row's output does not depend on the
// plan: a cached batch (split) equals its recompute (direct) bit for bit. A chunk partial
// starts from zero and walks its key tiles in order, k16 step by k16 step; a masked or
// zero-filled key contributes an exact zero.
//
// Block: 4 warps x 2 m-tiles of 16 query rows (each K/V fragment feeds two MMAs; a warp whose
// second m-tile has no rows computes one). K/V tiles of BN keys (64) arrive by cp.async,
// STAGES deep (2), and are computed SUB keys (32) at a time: S = Q K^T stays in registers,
// SiLU and the mask apply there, P is repacked in registers as the A operand of O += P V
// (FlashAttention-2's register reuse). SiLU takes one MUFU op (tanh), not two (exp and a
// reciprocal). Shared rows are padded by 16 bytes so ldmatrix's eight row addresses fall in
// distinct bank groups. Q, K, V are read through row strides (views of one fused projection
// need no copy). A thin tile (<= 16 rows: a cached user's few rows past its full tiles) runs
// on all four warps, split over keys for S and over columns for P V, with the same MMAs as the
// main path. BN, STAGES, SUB and KC are macros (HSTU_BN, HSTU_STAGES, HSTU_SUB, HSTU_KC) the
// wrapper sets; hstu_attention_wgmma.cu is the same work on Hopper's warpgroup MMA (without
// the thin-tile path).
// No torch headers: compiled by NVRTC through CuPy's RawModule.

#include <cuda_bf16.h>

#include "hstu_params.cuh"

namespace {

constexpr int MT = 2;                // 16-row m-tiles per warp
constexpr int WARPS = 4;
constexpr int BM = 16 * MT * WARPS;  // query rows per block (a row tile)
#ifndef HSTU_BN
#define HSTU_BN 64
#endif
#ifndef HSTU_STAGES
#define HSTU_STAGES 2
#endif
#ifndef HSTU_SUB
#define HSTU_SUB 32
#endif
constexpr int BN = HSTU_BN;          // keys per tile (one cp.async stage)
constexpr int SUB = HSTU_SUB;        // keys per compute step (S registers: MT x SUB / 8 x 4)
#ifndef HSTU_KC
#define HSTU_KC 512
#endif
constexpr int KC = HSTU_KC;          // keys per chunk (the unit of the split and of the fold)
constexpr int TPC = KC / BN;         // key tiles per chunk
constexpr int STAGES = HSTU_STAGES;  // K/V tiles in flight
// Thin tiles (<= 16 rows) on all four warps: 16 keys of a 64-key tile per warp, D / 4 columns.
template <int D>
constexpr bool kThin = BN == 64 && WARPS == 4 && D >= 64;
// With TAILS (a template flag; the plan's choice, `max_rows`), a tile may carry a tail of up
// to TAIL rows past its BM, run like a thin tile on the same K/V tiles: a user's few rows past
// its full tiles then cost no block of their own. A slot then holds SR rows (the merge's
// `slot_rows`); without TAILS, BM, and the code is that of a kernel without the option.
constexpr int TAIL = 16;
constexpr int SR = BM + TAIL;

template <int N>
struct IntC {
    static constexpr int value = N;
};

#include "hstu_common.cuh"

#include "mma_ops.cuh"

}  // namespace

#include "hstu_slots.cuh"

// grid (items, H), or (items x H) with the head fastest (block_item_head, hstu_common.cuh);
// 128 threads. DIRECT: items fold their chunks into their slot; else each item (one chunk)
// writes its own slot.
template <int D, bool DIRECT, bool TAILS>
__global__ void __launch_bounds__(128, 2) hstu_attn_fwd(HSTU_FWD_PARAMS, int max_rows) {
    constexpr int SP = D + 8;  // padded shared row (bf16)
    constexpr int PSP = BN + 8;  // padded P row (bf16) of the cooperative m-tile
    constexpr int QR = TAILS ? SR : BM;  // query rows in shared memory, rows per slot
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [QR][SP]
    __nv_bfloat16* Ks = Qs + QR * SP;                             // [STAGES][BN][SP]
    __nv_bfloat16* Vs = Ks + STAGES * BN * SP;                    // [STAGES][BN][SP]
    // P of the cooperative m-tile [16][PSP]: past V with tails; else Q's rows 16.., which a
    // thin tile leaves zero-filled and unused.
    __nv_bfloat16* Ps = TAILS ? Vs + STAGES * BN * SP : Qs + 16 * SP;

    int item, h;
    block_item_head(H, item, h);
    const int b = item_user[item], row0 = item_row0[item];
    const int kt0 = item_kt0[item], kt1 = item_kt1[item];
    const int qs = q_start[b], hist = hist_len[b], nn = n_new[b], nc = n_cand[b];
    const int nrows = tile_rows(nn + nc - row0, max_rows);
    if (nrows <= 0 || kt0 >= kt1) return;  // padding item, or a tile without keys
    const int start = hist - nn;  // absolute position of the user's first new token
    const float half_alpha = 0.5f * alpha;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wrow = warp * 16 * MT;  // the warp's first row in the tile
    const long long HD = (long long)H * D;
    constexpr int VEC = 8;  // bf16 per 16-byte copy

    constexpr int CPR = D / VEC, RPP = 128 / CPR;  // 16-byte copies per row, rows per pass
    {  // Q: the thread's column of every RPP-th row (the K/V loads' mapping, below)
        const int r0 = tid / CPR, c0 = (tid % CPR) * VEC;
        const __nv_bfloat16* qp = q + (qs + row0 + r0) * sq + h * D + c0;
#pragma unroll 2
        for (int r = r0; r < QR; r += RPP) {
            const bool ok = r < nrows;
            cp_async16(Qs + r * SP + c0, ok ? qp : q, ok ? 16 : 0);
            qp += RPP * sq;
        }
    }
    cp_async_commit();

    // Keys any row of this tile may see; past it K/V are zero-filled (garbage could be NaN).
    const int key_lim = (row0 + nrows > nn) ? hist : start + row0 + nrows;
    // The first row's bound: key tiles wholly below it need no mask.
    const int min_lim = (row0 < nn) ? start + row0 + 1 : hist;
    const bool is_paged = paged[b] != 0;
    const int* upages = pages + (is_paged ? page_ptr[b] : 0);
    const long long krow = kv_row[b];
    const int page_shift = page_shift_of(page_size);

    // A thread copies the 16-byte column c of rows r0, r0 + RPP, ... of every tile (the
    // mapping of copy i = tid + 128 m to row i / CPR, column i % CPR, with the arithmetic
    // hoisted): per copy its shared offset and contiguous source move by fixed strides, and a
    // paged copy costs one page-table load and one multiply. (Recomputing the row, column and
    // 64-bit address per copy cost ~15 instructions each, issued by the warps that do the
    // MMAs; on the wgmma kernel's producer the same change was 1.19x, session 11.)
    constexpr int PASSES = BN * CPR / 128;
    static_assert(BN * CPR % 128 == 0, "whole passes of 128 copies per tile");
    auto load_kv = [&](int stage, int kt) {
        // (per tile, not hoisted: live across the kernel they spill the D = 128 tails build)
        const int r0 = tid / CPR, c0 = (tid % CPR) * VEC;
        const long long col = (long long)h * D + c0;
        const long long v_off = (long long)page_size * HD;  // a page's V rows follow its K rows
        __nv_bfloat16* kd = Ks + stage * BN * SP + r0 * SP + c0;
        __nv_bfloat16* vd = Vs + stage * BN * SP + r0 * SP + c0;
        const int j0 = kt * BN + r0;
        if (is_paged) {
#pragma unroll 4  // (fully unrolled, the D = 128 tails build spills)
            for (int m = 0; m < PASSES; ++m) {
                const int j = j0 + m * RPP;
                const bool ok = j < key_lim;  // past it zero-filled (garbage could be NaN)
                const __nv_bfloat16* kp =
                    ok ? store + page_row(upages, j, page_size, page_shift) * HD + col : q;
                cp_async16(kd + m * RPP * SP, kp, ok ? 16 : 0);
                cp_async16(vd + m * RPP * SP, ok ? kp + v_off : q, ok ? 16 : 0);
            }
        } else {
            const __nv_bfloat16* kp = k + (krow + j0) * sk + col;
            const __nv_bfloat16* vp = v + (krow + j0) * sv + col;
#pragma unroll
            for (int m = 0; m < PASSES; ++m) {
                const bool ok = j0 + m * RPP < key_lim;
                cp_async16(kd + m * RPP * SP, ok ? kp : q, ok ? 16 : 0);
                cp_async16(vd + m * RPP * SP, ok ? vp : q, ok ? 16 : 0);
                kp += RPP * sk;
                vp += RPP * sv;
            }
        }
    };

    float acc[MT][D / 8][4];
    auto zero_acc = [&]() { zero_tiles<MT>(acc); };  // each chunk's partial starts from zero
    zero_acc();

    float* w = ws + ((long long)item_slot[item] * H + h) * QR * D;
    auto flush = [&](bool first) {  // the chunk's partial into the slot (DIRECT: folded)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                const int r = wrow + m * 16 + g + hl * 8;
                if (r >= nrows) continue;
                fold_row<D / 8, DIRECT>(w + r * D + 2 * t, acc[m], hl, first);
            }
    };

    // One key tile for the warp's first A m-tiles (A = 1 when its second m-tile has no rows).
    auto tile_step = [&](auto act, const __nv_bfloat16* Kt, const __nv_bfloat16* Vt, int kt) {
        constexpr int A = decltype(act)::value;
        float S[MT][SUB / 8][4];
        qk_tile<A, MT, SUB, D, SP>(S, Qs, Kt, wrow, lane);

        const int kbase = kt * SUB;
        const bool need_mask = kbase + SUB > min_lim;
#pragma unroll
        for (int m = 0; m < A; ++m)
#pragma unroll
            for (int n = 0; n < SUB / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float pv = silu_n(S[m][n][e], half_alpha, inv_n);
                    if (need_mask) {
                        const int j = kbase + n * 8 + 2 * t + (e & 1);
                        const int lr = row0 + wrow + m * 16 + g + (e >> 1) * 8;
                        const bool ok = (lr < nn) ? (j <= start + lr) : (j < hist);
                        pv = ok ? pv : 0.0f;
                    }
                    S[m][n][e] = pv;
                }

        pv_tile<A, MT, SUB, D, SP>(acc, S, Vt, lane);
    };

    // The item's key tiles through the cp.async pipeline: `step` computes one tile, `fold`
    // writes a chunk's partial to the slot (DIRECT: at each chunk's end; else once).
    auto pipeline = [&](auto step, auto fold) {
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) {
            if (kt0 + i < kt1) load_kv(i, kt0 + i);
            cp_async_commit();
        }
        for (int kt = kt0; kt < kt1; ++kt) {
            const int it = kt - kt0;
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // tile `it` landed for all; the stage refilled below was read by all
            if (kt + STAGES - 1 < kt1) load_kv((it + STAGES - 1) % STAGES, kt + STAGES - 1);
            cp_async_commit();
            step(Ks + (it % STAGES) * BN * SP, Vs + (it % STAGES) * BN * SP, kt);
            if (DIRECT && ((kt + 1) % TPC == 0 || kt + 1 == kt1)) fold(kt < TPC);
        }
        cp_async_wait<0>();
        if (!DIRECT) fold(true);
    };

    // The cooperative m-tile (rows rbase .. rbase + 15: a thin tile's, or a tile's tail) on
    // all four warps: warp w computes S for keys 16 w .. 16 w + 15 of each K/V tile and shares
    // P through shared memory, then P V for its D / 4 output columns. Every S and P V fragment
    // is the same MMA on the same operands, accumulated in the same key order, as in the
    // per-warp path above, so the bits do not depend on which path ran a row.
    constexpr int DPW = D >= 64 ? D / 64 : 1;  // 16-column V fragments per warp (D >= 64)
    float tacc[2 * DPW][4];
    auto tzero = [&]() {
#pragma unroll
        for (int n = 0; n < 2 * DPW; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) tacc[n][e] = 0.0f;
    };
    auto coop_step = [&](int rbase, const __nv_bfloat16* Kt, const __nv_bfloat16* Vt, int kt) {
        float S2[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) S2[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned a[4], bb[4];
            ldmatrix_x4(a, Qs + (rbase + (lane & 7) + ((lane >> 3) & 1) * 8) * SP + kk * 16
                               + (lane >> 4) * 8);
            ldmatrix_x4(bb, Kt + (warp * 16 + (lane & 7) + (lane >> 4) * 8) * SP + kk * 16
                                + ((lane >> 3) & 1) * 8);
            mma_bf16(S2[0], a, bb[0], bb[1]);
            mma_bf16(S2[1], a, bb[2], bb[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = kt * BN + warp * 16 + n * 8 + 2 * t + (e & 1);
                const int lr = row0 + rbase + g + (e >> 1) * 8;
                const bool ok = (lr < nn) ? (j <= start + lr) : (j < hist);
                S2[n][e] = ok ? silu_n(S2[n][e], half_alpha, inv_n) : 0.0f;
            }
            const int col = warp * 16 + n * 8 + 2 * t;
            *reinterpret_cast<unsigned*>(Ps + g * PSP + col) = pack_bf16(S2[n][0], S2[n][1]);
            *reinterpret_cast<unsigned*>(Ps + (g + 8) * PSP + col) = pack_bf16(S2[n][2], S2[n][3]);
        }
        __syncthreads();  // P complete (the next tile's writes wait for the loop's barrier)
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            unsigned pa[4];
            ldmatrix_x4(pa, Ps + ((lane & 7) + ((lane >> 3) & 1) * 8) * PSP + kc * 16
                                + (lane >> 4) * 8);
#pragma unroll
            for (int i = 0; i < DPW; ++i) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, Vt + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP
                                          + (warp * DPW + i) * 16 + (lane >> 4) * 8);
                mma_bf16(tacc[2 * i], pa, vb[0], vb[1]);
                mma_bf16(tacc[2 * i + 1], pa, vb[2], vb[3]);
            }
        }
    };
    auto coop_fold = [&](int rbase, bool first) {
#pragma unroll
        for (int hl = 0; hl < 2; ++hl) {
            const int r = rbase + g + hl * 8;
            if (r < nrows)
                fold_row<2 * DPW, DIRECT>(w + r * D + warp * DPW * 16 + 2 * t, tacc, hl, first);
        }
        tzero();
    };
    tzero();

    if (kThin<D> && nrows <= 16) {  // a thin tile: its one m-tile on all four warps
        pipeline([&](const __nv_bfloat16* Kt, const __nv_bfloat16* Vt, int kt) {
            coop_step(0, Kt, Vt, kt);
        }, [&](bool first) { coop_fold(0, first); });
        return;
    }
    const bool tail = TAILS && kThin<D> && nrows > BM;  // (the plan: tails only where kThin<D>)
    pipeline([&](const __nv_bfloat16* Kt, const __nv_bfloat16* Vt, int kt) {
#pragma unroll
        for (int sub = 0; sub < BN / SUB; ++sub) {  // kt in SUB units: kt * (BN / SUB) + sub
            const int ks = kt * (BN / SUB) + sub;
            const __nv_bfloat16 *Ksub = Kt + sub * SUB * SP, *Vsub = Vt + sub * SUB * SP;
            if (wrow + 16 < nrows) tile_step(IntC<MT>{}, Ksub, Vsub, ks);
            else if (wrow < nrows) tile_step(IntC<1>{}, Ksub, Vsub, ks);
        }  // warps past the tile's rows only help load
        if (tail) coop_step(BM, Kt, Vt, kt);
    }, [&](bool first) {
        flush(first);
        zero_acc();
        if (tail) coop_fold(BM, first);
    });
}

#define HSTU_FWD_INSTANCE(D, DIRECT, TAILS) \
    template __global__ void hstu_attn_fwd<D, DIRECT, TAILS>(HSTU_FWD_PARAM_TYPES, int);
#define HSTU_ATTN_INSTANCES(D)                                                                  \
    HSTU_FWD_INSTANCE(D, true, false)                                                           \
    HSTU_FWD_INSTANCE(D, false, false)                                                          \
    HSTU_FWD_INSTANCE(D, true, true)                                                            \
    HSTU_FWD_INSTANCE(D, false, true)                                                           \
    template __global__ void hstu_attn_merge<D>(                                                \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,      \
        const float*, const int*, const int*, const int*, const int*, const int*, const int*,   \
        const int*, int, long long, long long, long long, float, float, int, int);

HSTU_ATTN_INSTANCES(32)
HSTU_ATTN_INSTANCES(64)
HSTU_ATTN_INSTANCES(128)
