// Copy plans on the GPU: the strided blocks of a dejavulib copy plan (gather into a staging
// buffer, scatter out of one), executed by one of six kernels: by items (each run cut into its
// block's unit of up to 16 aligned bytes, one item per thread: short runs) or by runs (one thread
// block per run: long runs), with the table passed by value as a kernel parameter (small tables:
// no upload at all), uploaded and copied into shared memory (up to 256 blocks), or read from
// device memory (larger ones). Compiled at run time by NVRTC.
//
// A block is 19 unsigned 64-bit words:
//   [0] source address of its first run      [1] destination address of its first run
//   [2] bytes per run                         [3] number of axes (0 to 4)
//   [4..8]  iterations of each axis, outermost first
//   [8..12] source stride of each axis        [12..16] destination stride of each axis
//   [16] index of the block's first run among all runs of the table (a prefix sum)
//   [17] index of the block's first item among all items of the table (a prefix sum)
//   [18] its unit: bytes per item (16, 8, 4, 2 or 1; its addresses, runs and strides are multiples)
// Run `r` of a block is found by writing `r` in the mixed radix of the axes' iterations, the
// innermost axis varying fastest, as the CPU engine's loops do (`CopyBlock::for_each_run`).
// Address arithmetic wraps (a stride may step backwards). The CPU reference twin of these kernels
// is `dejavulib::cuda::table::copy_reference`.

#define WORDS 19
#define INLINE_BLOCKS 24

// A by-value table parameter read with run-time indices would be copied into every thread's
// local memory (kilobytes per thread); `__grid_constant__` (compute capability 7.0 and later)
// lets the threads read it where the launch put it.
#if __CUDA_ARCH__ >= 700
#define TABLE_PARAMETER(N) const __grid_constant__ InlineTable<N>
#else
#define TABLE_PARAMETER(N) const InlineTable<N>
#endif

// A table in device memory.
struct DeviceTable {
    const unsigned long long* words;
    unsigned int blocks;
    __device__ unsigned long long word(unsigned int i) const { return words[i]; }
};

// A table passed by value (it must match `InlineTable` on the host side): up to `N` blocks.
template <int N>
struct InlineTable {
    unsigned long long words[N * WORDS];
    unsigned int blocks;
    unsigned int unused;
};

template <int N>
struct InlineView {
    const InlineTable<N>& table;
    __device__ unsigned long long word(unsigned int i) const { return table.words[i]; }
};

struct Run {
    const unsigned char* src;
    unsigned char* dst;
    unsigned long long len;
};

// The block holding global run (`first` = 16) or item (`first` = 17) `index`: the last whose first
// one is at most `index` (binary search). Returns its first word's index.
template <class T>
__device__ static unsigned int block_of(const T& table, unsigned int blocks, unsigned int first,
                                        unsigned long long index) {
    unsigned int low = 0, high = blocks - 1;
    while (low < high) {
        unsigned int middle = (low + high + 1) / 2;
        if (table.word(middle * WORDS + first) <= index) {
            low = middle;
        } else {
            high = middle - 1;
        }
    }
    return low * WORDS;
}

// `n / d`, in 32 bits where both fit (a 64-bit division is a long subroutine on the GPU, and the
// item kernel divides a few times per 16-byte item).
__device__ static unsigned long long divide(unsigned long long n, unsigned long long d) {
    if (d == 1) {
        return n;
    }
    if (((n | d) >> 32) == 0) {
        return (unsigned int)n / (unsigned int)d;
    }
    return n / d;
}

// Where run `local` of the block at word `b` starts on both sides (mixed radix, innermost axis
// fastest).
template <class T>
__device__ static Run run_start(const T& table, unsigned int b, unsigned long long local) {
    unsigned long long src = table.word(b), dst = table.word(b + 1);
    unsigned int depth = (unsigned int)table.word(b + 3);
    for (int axis = (int)depth - 1; axis >= 0; axis--) {
        unsigned long long count = table.word(b + 4 + axis);
        unsigned long long quotient = divide(local, count);
        unsigned long long i = local - quotient * count;
        local = quotient;
        src += i * table.word(b + 8 + axis);
        dst += i * table.word(b + 12 + axis);
    }
    Run run;
    run.src = (const unsigned char*)src;
    run.dst = (unsigned char*)dst;
    run.len = table.word(b + 2);
    return run;
}

// Copies one item of `unit` bytes (a power of two up to 16, which both addresses are multiples of).
__device__ static void copy_item(const unsigned char* src, unsigned char* dst, unsigned long long unit) {
    switch (unit) {
        case 16: *(uint4*)dst = *(const uint4*)src; break;
        case 8: *(unsigned long long*)dst = *(const unsigned long long*)src; break;
        case 4: *(unsigned int*)dst = *(const unsigned int*)src; break;
        case 2: *(unsigned short*)dst = *(const unsigned short*)src; break;
        default: *dst = *src; break;
    }
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

// Items each thread of the item kernel copies: all their loads are issued before their stores,
// so a thread keeps several scattered reads in flight.
#define ITEMS_PER_THREAD 4

struct Item {
    const unsigned char* src;
    unsigned char* dst;
    unsigned long long unit;
};

// Global item `i`: its block, its run there, and its place in the run.
template <class T>
__device__ static Item item_of(const T& table, unsigned int blocks, unsigned long long i) {
    unsigned int b = block_of(table, blocks, 17, i);
    unsigned long long unit = table.word(b + 18);
    // The unit is a power of two: a shift, not a division.
    unsigned long long per_run = table.word(b + 2) >> (__ffsll((long long)unit) - 1);
    unsigned long long local = i - table.word(b + 17);
    unsigned long long run = divide(local, per_run);
    unsigned long long within = (local - run * per_run) * unit;
    Run start = run_start(table, b, run);
    Item item;
    item.src = start.src + within;
    item.dst = start.dst + within;
    item.unit = unit;
    return item;
}

// Short runs (a decode step's 16-byte pieces and 256-byte rows): a few items per thread, each
// batch of threads on consecutive items so that the stores coalesce.
template <class T>
__device__ static void copy_items(const T& table, unsigned int blocks, unsigned long long items) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; first < items;
         first += stride * ITEMS_PER_THREAD) {
        uint4 value[ITEMS_PER_THREAD];
        uint4* to[ITEMS_PER_THREAD];
#pragma unroll
        for (int k = 0; k < ITEMS_PER_THREAD; k++) {
            to[k] = 0;
            unsigned long long i = first + k * stride;
            if (i < items) {
                Item item = item_of(table, blocks, i);
                if (item.unit == 16) {
                    value[k] = *(const uint4*)item.src;
                    to[k] = (uint4*)item.dst;
                } else {
                    copy_item(item.src, item.dst, item.unit);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < ITEMS_PER_THREAD; k++) {
            if (to[k] != 0) {
                *to[k] = value[k];
            }
        }
    }
}

// Long runs (a prompt's): one thread block per run, its threads sharing the bytes.
template <class T>
__device__ static void copy_runs(const T& table, unsigned int blocks, unsigned long long runs) {
    for (unsigned long long r = blockIdx.x; r < runs; r += gridDim.x) {
        unsigned int b = block_of(table, blocks, 16, r);
        copy_bytes(run_start(table, b, r - table.word(b + 16)), threadIdx.x, blockDim.x);
    }
}

extern "C" __global__ void djv_copy_items(const unsigned long long* words, unsigned int blocks,
                                          unsigned long long items) {
    DeviceTable table = {words, blocks};
    copy_items(table, blocks, items);
}

extern "C" __global__ void djv_copy_runs(const unsigned long long* words, unsigned int blocks,
                                         unsigned long long runs) {
    DeviceTable table = {words, blocks};
    copy_runs(table, blocks, runs);
}

// A table in device memory, copied into each thread block's shared memory first: every item's
// binary search and address arithmetic then read shared memory instead of global memory. (A
// decode step over per-layer tensors has a block per layer and part, 80 for 40 layers: its
// searches reading global memory made the kernel four times slower than a copy.) The launch
// gives `blocks * WORDS` words of dynamic shared memory.
extern __shared__ unsigned long long shared_words[];

__device__ static DeviceTable load_shared(const unsigned long long* words, unsigned int blocks) {
    unsigned int n = blocks * WORDS;
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) {
        shared_words[i] = words[i];
    }
    __syncthreads();
    DeviceTable table = {shared_words, blocks};
    return table;
}

extern "C" __global__ void djv_copy_items_shared(const unsigned long long* words, unsigned int blocks,
                                                 unsigned long long items) {
    DeviceTable table = load_shared(words, blocks);
    copy_items(table, blocks, items);
}

extern "C" __global__ void djv_copy_runs_shared(const unsigned long long* words, unsigned int blocks,
                                                unsigned long long runs) {
    DeviceTable table = load_shared(words, blocks);
    copy_runs(table, blocks, runs);
}

extern "C" __global__ void djv_copy_items_inline(TABLE_PARAMETER(INLINE_BLOCKS) table, unsigned long long items) {
    InlineView<INLINE_BLOCKS> view = {table};
    copy_items(view, table.blocks, items);
}

extern "C" __global__ void djv_copy_runs_inline(TABLE_PARAMETER(INLINE_BLOCKS) table, unsigned long long runs) {
    InlineView<INLINE_BLOCKS> view = {table};
    copy_runs(view, table.blocks, runs);
}
