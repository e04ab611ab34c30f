// rixl's block-copy kernel: many small device-to-device copies in one launch (scattered KV blocks).
// A cuMemcpyAsync per block costs ~4-5 us of launch on an H200 (measured by examples/gpu_check),
// so 1024 blocks of 64 KiB take ~5 ms; one launch of this kernel moves them at memory speed.
//
// descs: `count` triples (dst, src, len), in device memory. Each thread block takes one copy at a
// time (grid-stride over copies); its threads stride through the bytes, 16 at a time when dst,
// src and len are all 16-byte aligned, else one at a time. Copies must not overlap each other.
//
// The PTX beside this file (copy_blocks.ptx, embedded by the nvlink crate) is generated from it:
//   nvcc -ptx -arch=compute_75 -O3 copy_blocks.cu -o copy_blocks.ptx
// then its `.version` line lowered to 7.0 (the instructions are all older than that), so drivers
// from CUDA 11.0 on can JIT it. nvcc is not needed to build rixl.
extern "C" __global__ void rixl_copy_blocks(const unsigned long long* __restrict__ descs,
                                            unsigned int count) {
    for (unsigned int i = blockIdx.x; i < count; i += gridDim.x) {
        char* dst = reinterpret_cast<char*>(descs[3 * i]);
        const char* src = reinterpret_cast<const char*>(descs[3 * i + 1]);
        unsigned long long len = descs[3 * i + 2];
        if (((descs[3 * i] | descs[3 * i + 1] | len) & 15ull) == 0) {
            uint4* d = reinterpret_cast<uint4*>(dst);
            const uint4* s = reinterpret_cast<const uint4*>(src);
            unsigned long long n = len >> 4;
            for (unsigned long long k = threadIdx.x; k < n; k += blockDim.x) {
                d[k] = s[k];
            }
        } else {
            for (unsigned long long k = threadIdx.x; k < len; k += blockDim.x) {
                dst[k] = src[k];
            }
        }
    }
}
