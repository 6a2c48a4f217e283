// A synthetic transformer layer for the overlap benchmark: memory-bound like a decode step's
// weight reads, it streams `rounds` times through `n` float4 "weights" and keeps a sum so the
// reads are not optimised away.
extern "C" __global__ void djv_bench_layer(const float4* weights, unsigned long long n, unsigned int rounds,
                                           float* sink) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    float sum = 0.0f;
    for (unsigned int round = 0; round < rounds; round++) {
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            float4 w = weights[i];
            sum += w.x * w.y + w.z * w.w;
        }
    }
    if (sum == 1234.5f) {
        sink[0] = sum;
    }
}
