// Device helpers of hstu_attention.cu: ldmatrix loads of 8x8 bf16 tiles, the m16n8k16 bf16
// MMA with fp32 accumulation, and a paged key's row (the wgmma kernel keeps a division there:
// with the shift its D = 128 variant spills). Included inside its anonymous namespace (the loader,
// streamgr/kernels/_cuda.py, inlines it for NVRTC).
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

// Pages of a power-of-two size (the default 32) split a key index by shift and mask: a runtime
// division costs ~20 instructions per 16-byte copy, issued by the warps that do the MMAs.
// page_shift_of: log2 of the page size, or -1 when it is not a power of two.
__device__ __forceinline__ int page_shift_of(int page_size) {
    return (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
}

// Key j's row in a layer's page store [pages, 2, page_size, H, D], in units of H * D elements
// (its K row; V is page_size rows further): page upages[j / page_size], slot j % page_size.
__device__ __forceinline__ long long page_row(const int* upages, int j, int page_size,
                                              int page_shift) {
    const int pi = page_shift >= 0 ? j >> page_shift : j / page_size;
    return ((long long)upages[pi] * 2) * page_size + (j - pi * page_size);
}
