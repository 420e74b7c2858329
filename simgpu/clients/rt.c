/*
 * rt.c - simgpu-rt: reaches the driver as the CUDA runtime does. It dlopens libcuda.so.1, takes
 * cuGetProcAddress_v2 with dlsym, and fetches every other entry point through it for CUDA 13.0
 * (with --ptsz, asking for the per-thread default stream forms, as code built with
 * --default-stream per-thread does). Usage: simgpu-rt [--ptsz] <subcommand> ... (see workload.c).
 */
#define _DEFAULT_SOURCE
#include "workload.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--ptsz") == 0)
            flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("{\"error\":\"dlopen\",\"message\":\"%s\"}\n", dlerror());
        return 2;
    }
    __typeof__(&cuGetProcAddress_v2) get = (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2");
    if (!get) {
        printf("{\"error\":\"dlsym\",\"message\":\"no cuGetProcAddress_v2\"}\n");
        return 2;
    }
    struct drv d;
    CUdriverProcAddressQueryResult status;
#define RESOLVE(name, linked)                                                                   \
    if (get(#name, (void **)&d.f_##name, 13000, flags, &status) != CUDA_SUCCESS ||              \
        status != CU_GET_PROC_ADDRESS_SUCCESS) {                                                \
        printf("{\"error\":\"cuGetProcAddress\",\"symbol\":\"%s\",\"status\":%d}\n", #name, (int)status); \
        return 2;                                                                               \
    }
    DRV_FUNCS(RESOLVE)
#undef RESOLVE
    return workload_main(argc, argv, &d, "rt");
}
