// Indexed block copy: dst block dst_index[i] <- src block src_index[i], i in [0, n_blocks).
// Every paged K/V movement is one of these (see streamgr/kernels/paged_kv.py):
//   append:  token rows of k or v -> their (page, offset) slot rows    (block = one token row)
//   onload scatter: onload buffer pages -> device pages               (block = one page)
//   offload gather: device pages -> contiguous host-chunk layout      (block = one page)
// T is the copy unit: uint4 (16 bytes) when every address and the block size allow, else
// unsigned short / unsigned int. Block b of a buffer starts at element b * block_elems.
// No torch headers, no host code: compiled by NVRTC through CuPy's RawModule.

template <typename T>
__global__ void block_copy(T* __restrict__ dst, const T* __restrict__ src,
                           const long long* __restrict__ dst_index,
                           const long long* __restrict__ src_index,
                           long long n_blocks, long long block_elems) {
    // One CUDA block per copied block keeps the index loads uniform; threads stride the block.
    for (long long b = blockIdx.x; b < n_blocks; b += gridDim.x) {
        const T* s = src + src_index[b] * block_elems;
        T* d = dst + dst_index[b] * block_elems;
        for (long long e = threadIdx.x; e < block_elems; e += blockDim.x) {
            d[e] = s[e];
        }
    }
}

template __global__ void block_copy<uint4>(uint4*, const uint4*, const long long*,
                                           const long long*, long long, long long);
template __global__ void block_copy<unsigned int>(unsigned int*, const unsigned int*,
                                                  const long long*, const long long*,
                                                  long long, long long);
template __global__ void block_copy<unsigned short>(unsigned short*, const unsigned short*,
                                                    const long long*, const long long*,
                                                    long long, long long);
