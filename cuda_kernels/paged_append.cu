// Paged append of one layer: the new history tokens' K and V rows, read in place from the
// layer's (strided) projections, written into their page slots in one launch.
//   entry i: row[i] of k/v -> store[page[i], 0 (K) / 1 (V), offset[i], :, :]
// Entries with page < 0 are padding (a captured plan's fixed size) and write nothing. Slots are
// computed on the host at plan time. One warp per entry and tensor: 16-byte copies of the
// H * D bf16 elements (H * D a multiple of 8, rows 16-byte aligned; the wrapper checks).
// No torch headers: compiled by NVRTC through CuPy's RawModule.

__global__ void __launch_bounds__(256) paged_append(
    uint4* __restrict__ store, const uint4* __restrict__ k, const uint4* __restrict__ v,
    const long long* __restrict__ rows, const long long* __restrict__ pages,
    const long long* __restrict__ offsets, int n, long long layer_pages, int layer,
    int page_tokens, int row_vecs, long long k_stride_vecs, long long v_stride_vecs) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const int i = warp >> 1, kv = warp & 1;
    if (i >= n) return;
    const long long pg = pages[i];
    if (pg < 0) return;
    const long long src_row = rows[i];
    const uint4* src = kv ? v + src_row * v_stride_vecs : k + src_row * k_stride_vecs;
    // slot row ((layer * pages + page) * 2 + kv) * page_tokens + offset, row_vecs uint4 each
    uint4* dst = store + ((((long long)layer * layer_pages + pg) * 2 + kv) * page_tokens
                          + offsets[i]) * row_vecs;
    for (int e = lane; e < row_vecs; e += 32) dst[e] = src[e];
}
