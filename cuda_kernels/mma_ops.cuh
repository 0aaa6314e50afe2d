// Device helpers of the mma.sync attention kernels (hstu_attention.cu, t5_attention.cu):
// ldmatrix loads of 8x8 bf16 tiles, the m16n8k16 bf16 MMA with fp32 accumulation, the Q K^T
// tile step. Included inside their anonymous namespaces (the loader, streamgr/kernels/_cuda.py,
// inlines it for NVRTC).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// d = a (16x16 bf16, row) * b (16x8 bf16, col) + d, fp32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm(  // not volatile: no side effects, so it may be scheduled among the SiLU's ops
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// The first A of MT m-tiles of an accumulator fragment array (N n-tiles of four) set to zero.
template <int A, int MT, int N>
__device__ __forceinline__ void zero_tiles(float (&x)[MT][N][4]) {
#pragma unroll
    for (int m = 0; m < A; ++m)
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[m][n][e] = 0.0f;
}

// S = Q K^T for one key tile, the first step of both mma.sync attention kernels: the warp's
// first A of its MT 16-row m-tiles of Q (rows wrow + 16 m of Qs) against the tile's NK keys
// (rows of Kt), over D dims; Qs and Kt rows are SP bf16 apart (padded: ldmatrix rows in
// distinct banks). S is zeroed first; m-tiles from A up are left untouched.
template <int A, int MT, int NK, int D, int SP>
__device__ __forceinline__ void qk_tile(float (&S)[MT][NK / 8][4], const __nv_bfloat16* Qs,
                                        const __nv_bfloat16* Kt, int wrow, int lane) {
    zero_tiles<A>(S);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int m = 0; m < A; ++m)
            ldmatrix_x4(a[m], Qs + (wrow + m * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP
                                  + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < NK / 16; ++np) {
            unsigned bb[4];
            ldmatrix_x4(bb, Kt + (np * 16 + (lane & 7) + (lane >> 4) * 8) * SP + kk * 16
                                + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int m = 0; m < A; ++m) {
                mma_bf16(S[m][2 * np], a[m], bb[0], bb[1]);
                mma_bf16(S[m][2 * np + 1], a[m], bb[2], bb[3]);
            }
        }
    }
}

// acc += P V for one key tile, the last step of both mma.sync attention kernels: P is S (the
// step's fp32 scores after the kernel's activation, as qk_tile laid them out) packed to bf16 in
// registers (an m16n8 accumulator pair is an m16k16 A fragment), V the tile's NK rows of D dims
// (Vt, rows SP bf16 apart), read transposed. m-tiles from A up are left untouched.
template <int A, int MT, int NK, int D, int SP>
__device__ __forceinline__ void pv_tile(float (&acc)[MT][D / 8][4],
                                        const float (&S)[MT][NK / 8][4],
                                        const __nv_bfloat16* Vt, int lane) {
#pragma unroll
    for (int kc = 0; kc < NK / 16; ++kc) {
        unsigned pa[MT][4];
#pragma unroll
        for (int m = 0; m < A; ++m) {
            pa[m][0] = pack_bf16(S[m][2 * kc][0], S[m][2 * kc][1]);
            pa[m][1] = pack_bf16(S[m][2 * kc][2], S[m][2 * kc][3]);
            pa[m][2] = pack_bf16(S[m][2 * kc + 1][0], S[m][2 * kc + 1][1]);
            pa[m][3] = pack_bf16(S[m][2 * kc + 1][2], S[m][2 * kc + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            unsigned vb[4];
            ldmatrix_x4_trans(vb, Vt + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP
                                      + dp * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int m = 0; m < A; ++m) {
                mma_bf16(acc[m][2 * dp], pa[m], vb[0], vb[1]);
                mma_bf16(acc[m][2 * dp + 1], pa[m], vb[2], vb[3]);
            }
        }
    }
}
