// arch: sm_90a (wgmma). HSTU attention forward on Hopper's warpgroup MMA: the same work items,
// workspace slots and merge as hstu_attention.cu (whose hstu_attn_merge finishes these rows),
// so a plan runs on either kernel; only the forward pass differs:
//   - a block is two warpgroups, each owning 64 of the tile's 128 query rows;
//   - S = Q K^T by wgmma with Q and K read by the tensor cores straight from shared memory
//     (no ldmatrix round trip through registers, the limit of the mma.sync kernel);
//   - SiLU and the mask on S in registers, P repacked in registers as the A operand of
//     O += P V, with V read from shared memory as an MN-major B operand (trans-b);
//   - K/V tiles of BN keys (128; 64 for A/B) by cp.async, STAGES deep (3), in the 128-byte
//     swizzled layout wgmma reads (D >= 64; core matrices of 8 rows x 16 bytes for D = 32);
//   - warp-specialized (FlashAttention-3's structure): a third, producer warpgroup issues every
//     copy (Q, then the K/V tiles with their page lookups) and signals each stage's arrival on
//     an mbarrier (cp.async.mbarrier.arrive); the two consumer warpgroups only wait for full
//     stages, run the MMAs and the SiLU, and hand each stage back on another mbarrier once
//     their P V on it has completed. No block-wide barrier per tile, and the consumers issue
//     no loads (session 4's kernel: both warpgroups loaded and met at __syncthreads each tile,
//     long-scoreboard stalls, the tensor pipe 23% busy).
// Arithmetic per row and chunk is the same in the split and direct plans (one code path), so a
// cached batch still equals its recompute bit for bit. Compiled for sm_90a only (wgmma); for
// other targets the kernel body is empty and the wrapper never launches it.
// No torch headers: compiled by NVRTC (-arch=sm_90a) through CuPy.

#include <cuda_bf16.h>

#include "hstu_params.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HSTU_WGMMA 1
#endif

namespace {

constexpr int BM = 128;     // query rows per block: two warpgroups of 64
#ifndef HSTU_WG_BN
#define HSTU_WG_BN 128
#endif
constexpr int BN = HSTU_WG_BN;  // keys per tile (64 or 128)
// keys per tile of the plan's kt0 / kt1 (hstu_plan's BN)
[[maybe_unused]] constexpr int PLAN_BN = 64;
#ifndef HSTU_KC
#define HSTU_KC 512
#endif
constexpr int KC = HSTU_KC; // keys per chunk, as in hstu_attention.cu
constexpr int TPC = KC / BN;
#ifndef HSTU_WG_STAGES
#define HSTU_WG_STAGES 3
#endif
#ifndef HSTU_WG_OVERLAP
#define HSTU_WG_OVERLAP 1
#endif
#ifndef HSTU_WG_PINGPONG
#define HSTU_WG_PINGPONG 1
#endif
#ifndef HSTU_WG_QREG
#define HSTU_WG_QREG 0
#endif
constexpr int STAGES = HSTU_WG_STAGES;
constexpr int THREADS = 384;  // warpgroup 0 produces (copies), 1 and 2 consume (64 rows each)
static_assert(BM == 2 * 64 && TPC * BN == KC && (BN == 64 || BN == 128),
              "two warpgroups of 64 rows, whole tiles of 64 or 128 keys per chunk");
// S of tile kt + 1 and P V of tile kt in flight together, two P buffers (the only loop: a
// one-buffer variant failed a GPU test, session 9, and ran no faster).
static_assert(HSTU_WG_OVERLAP == 1 && STAGES >= 3, "the overlapped loop keeps two tiles resident");

#ifdef HSTU_WGMMA
#include "hstu_common.cuh"

#include "wgmma_ops.cuh"

#include "wgmma_tiles.cuh"
#endif  // HSTU_WGMMA

}  // namespace

#ifdef HSTU_WGMMA
// store_row: a row's bf16 output as the merge writes it
#include "hstu_slots.cuh"
#endif

// grid (items, H) or (items x H) (block_item_head), 384 threads; arguments as hstu_attn_fwd in
// hstu_attention.cu. Shared memory: Q, STAGES K and V tiles, then 2 STAGES + 1 mbarriers
// (the wrapper sizes it).
template <int D, bool DIRECT>
__global__ void __launch_bounds__(THREADS, 1) hstu_attn_fwd_wg(HSTU_FWD_PARAMS,
                                                                 __nv_bfloat16* __restrict__ out) {
#ifdef HSTU_WGMMA
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // Swizzle atoms must start at 1,024-byte boundaries (the wrapper adds 1 KB for this).
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [BM x D] (tile_off)
    __nv_bfloat16* Ks = Qs + BM * D;                              // [STAGES][BN x D]
    __nv_bfloat16* Vs = Ks + STAGES * BN * D;                     // [STAGES][BN x D]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(Vs + STAGES * BN * D);
    unsigned long long* empty = full + STAGES;
    unsigned long long* q_full = empty + STAGES;

    // The plan's key tiles are 64 keys; this kernel's are BN (a chunk starts on one of both).
    int item, h;
    block_item_head(H, item, h);
    const int b = item_user[item], row0 = item_row0[item];
    const int kt0 = item_kt0[item] * PLAN_BN / BN;
    const int kt1 = (item_kt1[item] * PLAN_BN + BN - 1) / BN;
    const int qs = q_start[b], hist = hist_len[b], nn = n_new[b], nc = n_cand[b];
    const int nrows = min(BM, nn + nc - row0);
    if (nrows <= 0) return;  // a padding item
    // DIRECT: the block writes its rows' bf16 output itself (no merge kernel), exactly as the
    // merge would from the tile's one slot: o = 0 + slot (a candidate adds its own key).
    const Batch out_p{q, k, v, out, sq, sk, sv, H, alpha, inv_n};
    if (kt0 >= kt1) {  // a tile without keys (candidates of a user without history)
        if (DIRECT) {
            float o[D / 32];
            for (int r = threadIdx.x >> 5; r < nrows; r += THREADS / 32) {
#pragma unroll
                for (int i = 0; i < D / 32; ++i) o[i] = 0.0f;
                const int lr = row0 + r;
                store_row<D>(out_p, o, qs + lr, h, lr >= nn, threadIdx.x & 31);
            }
        }
        return;
    }
    const int start = hist - nn;
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, wq = (tid >> 5) & 3;  // warpgroup, warp in the warpgroup
    const int consumers = nrows > 64 ? 2 : 1;  // consumer warpgroups with rows
    constexpr int CH = D / 8;  // 16-byte chunks per row
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + s, 128);           // every producer thread's copies of the stage
            mbar_init(empty + s, 4 * consumers);  // every consumer warp done with it
        }
        mbar_init(q_full, 128);
    }
    __syncthreads();  // the barriers initialized, for all (the last block-wide barrier)

    if (wg == 0) {  // the producer: Q, then each K/V tile once its stage is free
        set_max_regs_dec<48>();  // 40 spills the producer's copy loop
        const int key_lim = (row0 + nrows > nn) ? hist : start + row0 + nrows;
        const bool is_paged = paged[b] != 0;
        const int* upages = pages + (is_paged ? page_ptr[b] : 0);
        const long long krow = kv_row[b];
        const long long HD = (long long)H * D;
        // 8 consecutive threads fill one core matrix (8 rows x 16 bytes): conflict-free stores.
        for (int i = tid; i < BM * CH; i += 128) {
            int r, c;
            copy_rc<D>(i, r, c);
            const bool ok = r < nrows;
            cp_async16(Qs + tile_off<D, BM>(r, c), ok ? q + (qs + row0 + r) * sq + h * D + c : q,
                       ok ? 16 : 0);
        }
        cp_async_mbar_arrive(q_full);
        const int page_shift = page_shift_of(page_size);
        if constexpr (kSwizzle<D>) {
            // A thread copies one 16-byte column c of every RS-th row: its shared-memory offset
            // moves by whole rows (the swizzle's row & 7 stays: RS % 8 == 0), its contiguous
            // source by RS rows, and a paged copy costs one page-table load and one multiply.
            // (The generic loop below recomputed row, column and a 64-bit address per copy,
            // ~15 instructions, issued on the consumers' schedulers: recompute b8 ran at 300
            // TFLOP/s with it, 355 without; docs/benchmarks.md, session 11.)
            constexpr int RS = 128 / CH, PASSES = BN * CH / 128;
            static_assert(RS % 8 == 0, "rows per pass keep the swizzle phase");
            const int r0 = tid / CH, c = (tid % CH) * 8;
            const int so = tile_off<D, BN>(r0, c);
            for (int kt = kt0; kt < kt1; ++kt) {
                const int it = kt - kt0, stage = it % STAGES;
                mbar_wait(empty + stage, ((it / STAGES) & 1) ^ 1);
                __nv_bfloat16* kd = Ks + stage * BN * D + so;
                __nv_bfloat16* vd = Vs + stage * BN * D + so;
                const int j0 = kt * BN + r0;
                if (is_paged) {
                    const long long col = (long long)h * D + c;
#pragma unroll 4
                    for (int m = 0; m < PASSES; ++m) {
                        const int j = j0 + m * RS;
                        const bool ok = j < key_lim;  // past it zero-filled
                        const __nv_bfloat16* kp =
                            ok ? store + page_row(upages, j, page_size, page_shift) * HD + col : q;
                        cp_async16(kd + m * RS * 64, kp, ok ? 16 : 0);
                        cp_async16(vd + m * RS * 64, ok ? kp + (long long)page_size * HD : q,
                                   ok ? 16 : 0);
                    }
                } else {
                    const __nv_bfloat16* kp = k + (krow + j0) * sk + h * D + c;
                    const __nv_bfloat16* vp = v + (krow + j0) * sv + h * D + c;
#pragma unroll 4
                    for (int m = 0; m < PASSES; ++m) {
                        const bool ok = j0 + m * RS < key_lim;
                        cp_async16(kd + m * RS * 64, ok ? kp : q, ok ? 16 : 0);
                        cp_async16(vd + m * RS * 64, ok ? vp : q, ok ? 16 : 0);
                        kp += RS * sk;
                        vp += RS * sv;
                    }
                }
                cp_async_mbar_arrive(full + stage);
            }
            cp_async_wait<0>();
            return;
        } else {  // D = 32 (core matrices): the copy's row and column per copy
            for (int kt = kt0; kt < kt1; ++kt) {
                const int it = kt - kt0, stage = it % STAGES;
                mbar_wait(empty + stage, ((it / STAGES) & 1) ^ 1);
                __nv_bfloat16* kd = Ks + stage * BN * D;
                __nv_bfloat16* vd = Vs + stage * BN * D;
#pragma unroll 4
                for (int i = tid; i < BN * CH; i += 128) {
                    int r, c;
                    copy_rc<D>(i, r, c);
                    const int j = kt * BN + r;
                    const __nv_bfloat16 *kp = q, *vp = q;
                    const bool ok = j < key_lim;  // past it zero-filled (garbage could be NaN)
                    if (ok) {
                        if (is_paged) {
                            const long long off =
                                page_row(upages, j, page_size, page_shift) * HD + h * D + c;
                            kp = store + off;
                            vp = store + off + (long long)page_size * HD;
                        } else {
                            kp = k + (krow + j) * sk + h * D + c;
                            vp = v + (krow + j) * sv + h * D + c;
                        }
                    }
                    cp_async16(kd + tile_off<D, BN>(r, c), kp, ok ? 16 : 0);
                    cp_async16(vd + tile_off<D, BN>(r, c), vp, ok ? 16 : 0);
                }
                cp_async_mbar_arrive(full + stage);
            }
            cp_async_wait<0>();
            return;
        }
    }

    // The consumers: warpgroup cw owns rows 64 cw .. 64 cw + 63 of the tile.
    set_max_regs_inc<224>();  // 128 x 48 + 256 x 224 <= 64 K registers
    const int cw = wg - 1;
    if (cw >= consumers) return;  // no rows (its warps are not counted in `empty`)
    const float half_alpha = 0.5f * alpha;
    const int g = lane >> 2, t = lane & 3;
    const int wrow = cw * 64 + wq * 16;  // the warp's first row in the tile
    const int min_lim = (row0 < nn) ? start + row0 + 1 : hist;

    float acc[D / 2];  // O: this thread's rows wrow + g (+ 8), columns 8 i + 2 t (+ 1)
    // Zeroed once: a chunk's first P V overwrites O (scale-d 0), but each wgmma's asm reads
    // its accumulators, and leaving them undefined changes ptxas's allocation (untested).
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;

    float* w = ws + ((long long)item_slot[item] * H + h) * BM * D;
    auto flush = [&](bool first) {  // as fold_row in hstu_attention.cu: all loads, then stores
        // In rounds of G column pairs of both of the thread's rows: each round's old values
        // loaded before its stores (so the loads overlap: one L2 latency per round), with few
        // registers beside the accumulators (acc, S and the next tile's P stay live here).
        constexpr int G = D / 8 < 8 ? D / 8 : 8;
        float* row = w + (wrow + g) * D + 2 * t;
#pragma unroll
        for (int n0 = 0; n0 < D / 8; n0 += G) {
            float2 o[2][G];
#pragma unroll
            for (int hl = 0; hl < 2; ++hl)
#pragma unroll
                for (int n = 0; n < G; ++n)
                    o[hl][n] = (DIRECT && !first && wrow + g + hl * 8 < nrows)
                                   ? *reinterpret_cast<const float2*>(row + hl * 8 * D + (n0 + n) * 8)
                                   : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                if (wrow + g + hl * 8 >= nrows) continue;
#pragma unroll
                for (int n = 0; n < G; ++n) {
                    const int m = n0 + n;
                    float2 x = make_float2(acc[4 * m + 2 * hl], acc[4 * m + 2 * hl + 1]);
                    if (DIRECT)
                        x = make_float2(__fadd_rn(o[hl][n].x, x.x), __fadd_rn(o[hl][n].y, x.y));
                    *reinterpret_cast<float2*>(row + hl * 8 * D + m * 8) = x;
                }
            }
        }
    };


#if HSTU_WG_QREG
    // Q as register A fragments (S reads only K from shared memory: with Q there too, each
    // m64n64k16 reads 4 KB in 32 tensor cycles, the shared memory's whole bandwidth).
    unsigned qa[D / 16][4];
    auto load_q = [&]() {  // from the core-matrix layout, after Q landed
        auto at = [&](int r, int c) {
            return *reinterpret_cast<const unsigned*>(Qs + tile_off<D, BM>(r, c & ~7) + (c & 7));
        };
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            qa[kk][0] = at(wrow + g, kk * 16 + 2 * t);
            qa[kk][1] = at(wrow + g + 8, kk * 16 + 2 * t);
            qa[kk][2] = at(wrow + g, kk * 16 + 8 + 2 * t);
            qa[kk][3] = at(wrow + g + 8, kk * 16 + 8 + 2 * t);
        }
        fence_regs(qa);
    };
#endif
    float s[BN / 2];             // S of one key tile: rows as acc, keys 8 n + 2 t (+ 1)
    unsigned pa[BN / 16][4];     // P of the tile whose P V is being issued (A fragments)
    auto issue_s = [&](int stage) {  // S = Q K^T of the tile in `stage`, one commit group
        const __nv_bfloat16* Kt = Ks + stage * BN * D;
        fence_regs(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#if HSTU_WG_QREG
            wgmma_s_rs<BN>(s, qa[kk], kmaj_desc<D, BN>(Kt, 0, kk), kk > 0);
#else
            wgmma_s_ss<BN>(s, kmaj_desc<D, BM>(Qs, cw * 64, kk), kmaj_desc<D, BN>(Kt, 0, kk),
                           kk > 0);
#endif
        wg_commit();
    };
    auto silu_p = [&](int kt, unsigned (&out)[BN / 16][4]) {  // S (landed) -> P, masked
        fence_regs(s);
        const int kbase = kt * BN;
        const bool need_mask = kbase + BN > min_lim;
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            float x[8];
#pragma unroll
            for (int e8 = 0; e8 < 8; ++e8) {
                const int n = 2 * kc + (e8 >> 2), e = e8 & 3;
                float pv = silu_n(s[4 * n + e], half_alpha, inv_n);
                if (need_mask) {
                    const int j = kbase + n * 8 + 2 * t + (e & 1);
                    const int lr = row0 + wrow + g + (e >> 1) * 8;
                    const bool ok = (lr < nn) ? (j <= start + lr) : (j < hist);
                    pv = ok ? pv : 0.0f;
                }
                x[e8] = pv;
            }
            out[kc][0] = pack_bf16(x[0], x[1]);
            out[kc][1] = pack_bf16(x[2], x[3]);
            out[kc][2] = pack_bf16(x[4], x[5]);
            out[kc][3] = pack_bf16(x[6], x[7]);
        }
    };
    // O += P V of tile kt, one commit group; a chunk's first tile starts O afresh (its partial
    // starts from zero) by the first MMA's scale-d of 0 instead of a zeroing pass.
    auto issue_pv = [&](unsigned (&p)[BN / 16][4], int kt) {
        const __nv_bfloat16* Vt = Vs + ((kt - kt0) % STAGES) * BN * D;
        const int fresh = kt == kt0 || kt % TPC == 0;
        fence_regs(p);
        fence_regs(acc);
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc)
            wgmma_pv<D>(acc, p[kc], v_desc<D, BN>(Vt, kc), kc > 0 || !fresh);
        wg_commit();
    };
    auto chunk_end = [&](int kt) {
        // (the guard always holds here; without it ptxas serializes every wgmma of the
        // DIRECT kernels, warning C7511)
        if (DIRECT && ((kt + 1) % TPC == 0 || kt + 1 == kt1) && cw * 64 < nrows)
            flush(kt < TPC);
    };
    auto wait_full = [&](int kt) {  // tile kt's stage landed (then visible to the async proxy)
        const int it = kt - kt0;
        mbar_wait(full + it % STAGES, (it / STAGES) & 1);
        fence_async_smem();
    };
    auto release = [&](int kt) {  // this warp's MMAs on tile kt's stage have completed
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + (kt - kt0) % STAGES);
    };

    // Ping-pong turns (wgmma_tiles.cuh): the first S, then one issue point per tile.
    PingPong turns(HSTU_WG_PINGPONG && consumers == 2, cw, 1 + (kt1 - kt0));
    // S of tile kt + 1 and P V of tile kt are in flight together; the SiLU of tile kt + 1 runs
    // while P V of tile kt does (FlashAttention-3's intra-warpgroup overlap).
    mbar_wait(q_full, 0);
#if HSTU_WG_QREG
    load_q();
#endif
    wait_full(kt0);
    turns.wait();
    issue_s(0);
    turns.hand_over();
    wg_wait<0>();
    silu_p(kt0, pa);
    // Two P buffers, swapped by unrolling two tiles per trip (a register copy between them
    // would let the allocator merge them, and the next SiLU would overwrite the A operand of
    // the P V still in flight), and the last tile peeled off: ptxas serializes every wgmma when
    // it cannot prove that (or when the S issue and its wait sit under a data-dependent branch).
    unsigned pb[BN / 16][4];
    auto step = [&](int kt, unsigned (&cur)[BN / 16][4], unsigned (&nxt)[BN / 16][4]) {
        wait_full(kt + 1);  // a tile kt + 1 exists
        turns.wait();
        issue_s((kt + 1 - kt0) % STAGES);
        issue_pv(cur, kt);
        turns.hand_over();
        wg_wait<1>();  // S of tile kt + 1 (P V of tile kt may still run)
        silu_p(kt + 1, nxt);
        wg_wait<0>();
        fence_regs(acc);
        fence_regs(cur);
        release(kt);
        chunk_end(kt);
    };
    auto last = [&](int kt, unsigned (&cur)[BN / 16][4]) {
        turns.wait();
        issue_pv(cur, kt);
        turns.hand_over();
        wg_wait<0>();
        fence_regs(acc);
        fence_regs(cur);
        release(kt);
        chunk_end(kt);
    };
    int kt = kt0;
    for (; kt + 2 < kt1; kt += 2) {
        step(kt, pa, pb);
        step(kt + 1, pb, pa);
    }
    if (kt + 1 < kt1) {
        step(kt, pa, pb);
        last(kt + 1, pb);
    } else {
        last(kt, pa);
    }
    if (!DIRECT) {
        flush(true);
        return;
    }
    // The warp's 16 rows (it wrote their slot rows: the last fold), loaded all at once, then
    // each row's output with the merge's arithmetic.
    __syncwarp();
    constexpr int DL = D / 32;
    float x[16][DL];
#pragma unroll
    for (int rr = 0; rr < 16; ++rr)
#pragma unroll
        for (int i = 0; i < DL; ++i)
            x[rr][i] = wrow + rr < nrows ? w[(wrow + rr) * D + lane + 32 * i] : 0.0f;
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
        if (wrow + rr >= nrows) break;
        float o[DL];
#pragma unroll
        for (int i = 0; i < DL; ++i) o[i] = __fadd_rn(0.0f, x[rr][i]);
        const int lr = row0 + wrow + rr;
        store_row<D>(out_p, o, qs + lr, h, lr >= nn, lane);
    }
#endif  // HSTU_WGMMA
}

#define HSTU_WG_INSTANCES(D)                                                        \
    template __global__ void hstu_attn_fwd_wg<D, true>(HSTU_FWD_PARAM_TYPES, __nv_bfloat16*); \
    template __global__ void hstu_attn_fwd_wg<D, false>(HSTU_FWD_PARAM_TYPES, __nv_bfloat16*);

HSTU_WG_INSTANCES(32)
HSTU_WG_INSTANCES(64)
HSTU_WG_INSTANCES(128)
