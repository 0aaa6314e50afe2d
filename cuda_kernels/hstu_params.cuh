// The arguments every HSTU attention forward kernel takes (hstu_attention.cu's mma.sync kernel,
// hstu_attention_wgmma.cu's wgmma one): one parameter list, and its types for the explicit
// instantiations, so the two kernels and the wrapper's launch (streamgr/kernels/
// hstu_attention_cuda.py) cannot drift apart. A kernel may add parameters after these.
#define HSTU_FWD_PARAMS                                                                         \
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                   \
        const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ store,           \
        float* __restrict__ ws, const int* __restrict__ item_user,                              \
        const int* __restrict__ item_row0, const int* __restrict__ item_kt0,                    \
        const int* __restrict__ item_kt1, const int* __restrict__ item_slot,                    \
        const int* __restrict__ q_start, const int* __restrict__ hist_len,                      \
        const int* __restrict__ n_new, const int* __restrict__ n_cand,                          \
        const int* __restrict__ paged, const int* __restrict__ kv_row,                          \
        const int* __restrict__ page_ptr, const int* __restrict__ pages, int H, int page_size,  \
        long long sq, long long sk, long long sv, float alpha, float inv_n
#define HSTU_FWD_PARAM_TYPES                                                                    \
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,     \
        float*, const int*, const int*, const int*, const int*, const int*, const int*,         \
        const int*, const int*, const int*, const int*, const int*, const int*, const int*,     \
        int, int, long long, long long, long long, float, float
