// Device helpers shared by the HSTU attention kernels (hstu_attention.cu,
// hstu_attention_wgmma.cu): cp.async copies, a block's work item and head, a paged key's row,
// bf16 packing and the one-MUFU SiLU. Included inside their anonymous namespace; the loader
// (streamgr/kernels/_cuda.py) inlines it for NVRTC, so CuPy's compile cache key covers its text.

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// A forward block's work item and head. The wrapper picks the order by the grid's shape:
// (items, H), item-major within a head, or (items x H, 1), the head fastest (block x = item * H
// + h), which carries the plan's longest-first item order across all heads, so the last blocks
// to start are the shortest. On the H200 the head fastest took the cached batch of 8 (split
// chunks) from 0.150-0.152 to 0.149 ms, but cost the direct recompute batch of 8 3% (wgmma,
// 363 -> 350 TFLOP/s): split plans run head-fastest, direct ones item-major (session 12).
__device__ __forceinline__ void block_item_head(int H, int& item, int& h) {
    if (gridDim.y > 1) {
        item = blockIdx.x;
        h = blockIdx.y;
    } else {
        item = blockIdx.x / H;
        h = blockIdx.x - item * H;
    }
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

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// SiLU(alpha s) / N from half_alpha = alpha / 2: x sigmoid(x) = (x/2)(1 + tanh(x/2)), one
// MUFU op per score (exp + reciprocal take two, and the MUFU pipe is 1/64 of the tensor rate).
__device__ __forceinline__ float silu_n(float s, float half_alpha, float inv_n) {
    const float u = __fmul_rn(s, half_alpha);
    const float w = __fmul_rn(u, inv_n);
    return __fmaf_rn(w, tanh_approx(u), w);
}
