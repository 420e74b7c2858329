// A program built by nvcc with the default static cudart, for the gate's checks on a real GPU:
//   gate_probe launch N        empty-kernel launch loop (runtime API), prints ns per launch
//   gate_probe alloc SIZE...   cudaMalloc each size in order, prints the result of each, then cudaMemGetInfo
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <cuda_runtime.h>

__global__ void empty_kernel() {}

int main(int argc, char **argv)
{
    if (argc >= 3 && strcmp(argv[1], "launch") == 0) {
        long n = atol(argv[2]);
        empty_kernel<<<1, 1>>>();
        cudaDeviceSynchronize();
        auto start = std::chrono::steady_clock::now();
        for (long i = 0; i < n; i++)
            empty_kernel<<<1, 1>>>();
        cudaDeviceSynchronize();
        double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
        printf("{\"launches\":%ld,\"ns_per_launch\":%.1f}\n", n, ns / n);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "alloc") == 0) {
        for (int i = 2; i < argc; i++) {
            void *p = nullptr;
            size_t size = strtoull(argv[i], nullptr, 10);
            cudaError_t e = cudaMalloc(&p, size);
            printf("{\"size\":%zu,\"result\":\"%s\"}\n", size, cudaGetErrorName(e));
        }
        size_t free_b = 0, total = 0;
        cudaMemGetInfo(&free_b, &total);
        printf("{\"free\":%zu,\"total\":%zu}\n", free_b, total);
        return 0;
    }
    fprintf(stderr, "usage: gate_probe launch N | alloc SIZE...\n");
    return 2;
}
