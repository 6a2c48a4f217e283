// Copy plans on the GPU: the strided blocks of a dejavulib copy plan (gather into a staging
// buffer, scatter out of one), executed by one of two kernels. Compiled at run time by NVRTC.
//
// A block is 17 unsigned 64-bit words:
//   [0] source address of its first run      [1] destination address of its first run
//   [2] bytes per run                         [3] number of axes (0 to 4)
//   [4..8]  iterations of each axis, outermost first
//   [8..12] source stride of each axis        [12..16] destination stride of each axis
//   [16] index of the block's first run among all runs of the table (a prefix sum)
// Run `r` of a block is found by writing `r` in the mixed radix of the axes' iterations, the
// innermost axis varying fastest, as the CPU engine's loops do (`CopyBlock::for_each_run`). The CPU
// reference twin of these kernels is `dejavulib::cuda::table::copy_reference`.

#define WORDS 17

struct Run {
    const unsigned char* src;
    unsigned char* dst;
    unsigned long long len;
};

// The block holding global run `r`: the last whose first run is at most `r` (blocks are few).
__device__ static const unsigned long long* block_of(const unsigned long long* table, unsigned int blocks,
                                                     unsigned long long r) {
    unsigned int b = 0;
    while (b + 1 < blocks && table[(b + 1) * WORDS + 16] <= r) {
        b++;
    }
    return table + b * WORDS;
}

__device__ static Run run_of(const unsigned long long* table, unsigned int blocks, unsigned long long r) {
    const unsigned long long* b = block_of(table, blocks, r);
    unsigned long long local = r - b[16];
    unsigned long long src = b[0], dst = b[1];
    unsigned int depth = (unsigned int)b[3];
    for (int axis = (int)depth - 1; axis >= 0; axis--) {
        unsigned long long count = b[4 + axis];
        unsigned long long i = local % count;
        local /= count;
        src += i * b[8 + axis];
        dst += i * b[12 + axis];
    }
    Run run;
    run.src = (const unsigned char*)src;
    run.dst = (unsigned char*)dst;
    run.len = b[2];
    return run;
}

// Copies `len` bytes with as many 16-byte vector moves as alignment allows, from `lane` in steps
// of `lanes`.
__device__ static void copy_bytes(Run run, unsigned long long lane, unsigned long long lanes) {
    unsigned long long aligned = (unsigned long long)run.src | (unsigned long long)run.dst | run.len;
    if ((aligned & 15) == 0) {
        const uint4* s = (const uint4*)run.src;
        uint4* d = (uint4*)run.dst;
        for (unsigned long long i = lane; i < run.len / 16; i += lanes) {
            d[i] = s[i];
        }
    } else {
        for (unsigned long long i = lane; i < run.len; i += lanes) {
            run.dst[i] = run.src[i];
        }
    }
}

// Short runs (a decode step's 16-byte pieces): one thread per run.
extern "C" __global__ void djv_copy_short(const unsigned long long* table, unsigned int blocks,
                                          unsigned long long runs) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long r = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; r < runs; r += stride) {
        copy_bytes(run_of(table, blocks, r), 0, 1);
    }
}

// Long runs (a prompt's): one thread block per run, its threads sharing the bytes.
extern "C" __global__ void djv_copy_long(const unsigned long long* table, unsigned int blocks,
                                         unsigned long long runs) {
    for (unsigned long long r = blockIdx.x; r < runs; r += gridDim.x) {
        copy_bytes(run_of(table, blocks, r), threadIdx.x, blockDim.x);
    }
}
