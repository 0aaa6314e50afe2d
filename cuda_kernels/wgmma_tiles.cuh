// Hopper tile helpers shared by the wgmma attention kernels (hstu_attention_wgmma.cu,
// t5_attention_wgmma.cu): the swizzled shared-memory layout wgmma reads, its matrix
// descriptors, the copy order that fills it, mbarriers, named barriers and register
// reallocation. Included inside their anonymous namespace after hstu_common.cuh and
// wgmma_ops.cuh, for sm_90a only (the loader inlines it for NVRTC).

// Shared-memory tiles as wgmma reads them. D >= 64: rows of 128-byte swizzle atoms (64
// columns; a row's 16-byte chunk k stored at chunk k ^ (row % 8), atoms of D / 64 column blocks
// one after another), so that a quarter-warp's copy of one row's 128 contiguous bytes lands in
// eight distinct bank groups and each global row segment is one full 128-byte line (the core
// matrix layout below needs eight rows per quarter-warp: half lines, twice the L2 requests,
// the producer's limit). D = 32 (64-byte rows): core matrices, 8 rows x 16 bytes, no swizzle.
template <int D>
constexpr bool kSwizzle = D % 64 == 0;
// Element offset of (row r, column c, a multiple of 8) in a tile of R rows.
template <int D, int R>
__device__ __forceinline__ int tile_off(int r, int c) {
    if constexpr (kSwizzle<D>)
        return (c >> 6) * R * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3);
    else
        return ((r >> 3) * (D / 8) + (c >> 3)) * 64 + (r & 7) * 8;
}
// The (row, column) of copy i (16 bytes) of a tile: whole rows in order (D >= 64), or 8 rows
// by one chunk, the core matrices' order (D = 32, conflict-free without a swizzle).
template <int D>
__device__ __forceinline__ void copy_rc(int i, int& r, int& c) {
    constexpr int CH = D / 8;
    if constexpr (kSwizzle<D>) {
        r = i / CH;
        c = (i % CH) * 8;
    } else {
        r = ((i >> 3) / CH) * 8 + (i & 7);
        c = ((i >> 3) % CH) * 8;
    }
}
// Descriptor of a K-major operand (Q or K): rows rbase.. of a tile of R rows, k16 step kk.
// Swizzled: the stride byte offset is 8 rows (1,024 bytes), the leading one unused; the start
// moves 32 bytes per step inside an atom (the hardware applies the swizzle to the address).
template <int D, int R>
__device__ __forceinline__ unsigned long long kmaj_desc(const __nv_bfloat16* tile, int rbase,
                                                        int kk) {
    // (the start address is the descriptor's low field: the k16 steps' constant byte offsets
    // are added to one base descriptor, which keeps the unrolled steps out of registers)
    if constexpr (kSwizzle<D>)
        return desc_sw128(tile + rbase * 64, 16, 1024)
               + (((kk >> 2) * R * 128 + (kk & 3) * 32) >> 4);
    else
        return desc(tile + (rbase / 8) * (D / 8) * 64, 128, D * 16) + ((kk * 256) >> 4);
}
// Descriptor of V as the MN-major B operand of P V, keys 16 kc .. 16 kc + 15 of a BN-key tile:
// swizzled, the leading byte offset is the next 64 columns (an atom block), the stride the
// next 8 keys; core matrices: next 8 keys, next 8 columns.
template <int D, int BN>
__device__ __forceinline__ unsigned long long v_desc(const __nv_bfloat16* tile, int kc) {
    if constexpr (kSwizzle<D>)
        return desc_sw128(tile, BN * 128, 1024) + ((kc * 16 * 128) >> 4);
    else
        return desc(tile, D * 16, 128) + ((kc * 2 * (D / 8) * 128) >> 4);
}

// mbarriers (shared memory, 8 bytes each): the stages' full / empty signals.
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(b)) : "memory");
}
// Arrives once this thread's earlier cp.async copies have landed (counted in the barrier's
// expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* b) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n"
                 :: "r"(smem_u32(b)) : "memory");
}
// Until the phase of parity `parity` has completed (parity 1 before any phase has: at once).
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile(
        "{\n.reg .pred P;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
        "@!P bra WAIT;\n}\n" :: "r"(smem_u32(b)), "r"(parity) : "memory");
}
// Named barriers 1 and 2 (0 is __syncthreads'), 256 threads: both consumer warpgroups.
__device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory");
}
// The two consumer warpgroups take turns issuing their MMAs (FlashAttention-3's ping-pong: one's
// elementwise work on S runs while the other's MMAs do, instead of both at once with the
// tensor cores idle): before an issue, wait() for this warpgroup's turn; after it,
// hand_over(). The first warpgroup starts (the second pre-arrives once); the second skips its
// last hand-over so that every barrier phase completes. `on` false (one warpgroup with rows,
// or ping-pong off): no turns. issue_points: the issues each warpgroup makes.
struct PingPong {
    bool on;
    int cw;    // this consumer warpgroup (0 or 1)
    int left;  // the second warpgroup's issue points still to come (its last: none)
    __device__ __forceinline__ PingPong(bool on_, int cw_, int issue_points)
        : on(on_), cw(cw_), left(issue_points) {
        if (on && cw == 1) named_arrive(1);
    }
    __device__ __forceinline__ void wait() {
        if (on) named_sync(1 + cw);
    }
    __device__ __forceinline__ void hand_over() {
        if (on && (cw == 0 || --left > 0)) named_arrive(2 - cw);
    }
};
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
