// Indexed block copy: dst block dst_index[i] <- src block src_index[i], i in [0, n_blocks).
// Every paged K/V movement is one of these (see streamgr/kernels/paged_kv.py):
//   append:  token rows of k or v -> their (page, offset) slot rows    (block = one token row)
//   onload scatter: onload buffer pages -> device pages               (block = one page)
//   offload gather: device pages -> contiguous host-chunk layout      (block = one page)
// T is the copy unit: uint4 (16 bytes) when every address and the block size allow, else
// unsigned short / unsigned int. Block b of a buffer starts at element b * block_elems.
// No torch headers, no host code: compiled by NVRTC through CuPy's RawModule.

// Elements [lo, hi) of one block, strided over the CUDA block's threads. Four loads in flight
// per thread before the stores: one at a time leaves the memory system idle between trips.
template <typename T>
__device__ __forceinline__ void copy_part(T* __restrict__ d, const T* __restrict__ s,
                                          long long lo, long long hi) {
    constexpr int U = 4;
    for (long long e = lo + threadIdx.x; e < hi; e += U * blockDim.x) {
        T v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = e + (long long)u * blockDim.x;
            if (i < hi) v[u] = s[i];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = e + (long long)u * blockDim.x;
            if (i < hi) d[i] = v[u];
        }
    }
}

template <typename T>
__global__ void block_copy(T* __restrict__ dst, const T* __restrict__ src,
                           const long long* __restrict__ dst_index,
                           const long long* __restrict__ src_index,
                           long long n_blocks, long long block_elems) {
    // CUDA block (x, y) copies part y of block x: the index loads stay uniform per CUDA block,
    // and large blocks (a 64 KiB page) are split so enough CUDA blocks are in flight.
    const long long part = (block_elems + gridDim.y - 1) / gridDim.y;
    const long long lo = blockIdx.y * part;
    const long long hi = min(block_elems, lo + part);
    for (long long b = blockIdx.x; b < n_blocks; b += gridDim.x) {
        const T* s = src + src_index[b] * block_elems;
        T* d = dst + dst_index[b] * block_elems;
        copy_part(d, s, lo, hi);
    }
}

// Onload scatter of one layer without index arrays: page b of the onload buffer
// [n_chunks][layers][k] goes to page page_ids[b] of the layer in the store [layers][pages].
template <typename T>
__global__ void page_scatter(T* __restrict__ store, const T* __restrict__ buffer,
                             const long long* __restrict__ page_ids, long long n_pages,
                             long long page_elems, int layer, int layers, int k,
                             long long store_pages) {
    const long long part = (page_elems + gridDim.y - 1) / gridDim.y;
    const long long lo = blockIdx.y * part;
    const long long hi = min(page_elems, lo + part);
    for (long long b = blockIdx.x; b < n_pages; b += gridDim.x) {
        const long long src_block = (b / k) * ((long long)layers * k) + (long long)layer * k + b % k;
        const T* s = buffer + src_block * page_elems;
        T* d = store + ((long long)layer * store_pages + page_ids[b]) * page_elems;
        copy_part(d, s, lo, hi);
    }
}

template __global__ void page_scatter<uint4>(uint4*, const uint4*, const long long*, long long,
                                             long long, int, int, int, long long);
template __global__ void block_copy<uint4>(uint4*, const uint4*, const long long*,
                                           const long long*, long long, long long);
template __global__ void block_copy<unsigned int>(unsigned int*, const unsigned int*,
                                                  const long long*, const long long*,
                                                  long long, long long);
template __global__ void block_copy<unsigned short>(unsigned short*, const unsigned short*,
                                                    const long long*, const long long*,
                                                    long long, long long);

// A flat copy of n units, CUDA block x its part. The rank path's uploads use it to read a
// page-locked host buffer in place (its pointer is valid on the device under unified
// addressing): the SMs pull it over PCIe, so it cannot queue behind a host hit's onload copies
// on the copy engine (streamgr/kernels/pinned.py).
template <typename T>
__global__ void linear_copy(T* __restrict__ dst, const T* __restrict__ src, long long n) {
    const long long part = (n + gridDim.x - 1) / gridDim.x;
    const long long lo = blockIdx.x * part;
    copy_part(dst, src, lo, min(n, lo + part));
}
