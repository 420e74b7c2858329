/*
 * gated_symbols.h - the one list of driver entry points the gate wraps.
 *
 * From this list come the table of real entry points (gate.h), the answers of our dlsym and
 * cuGetProcAddress (intercept.c) and the check that every listed symbol has a wrapper (the linker:
 * the table takes each wrapper's address). Adding a symbol: list it here and write its wrapper with
 * the prototype that cuda_driver_api.h declares for it (copied from cuda.h): launches and
 * synchronisation in launch.c, memory in memory.c, cuGetProcAddress(_v2) in intercept.c.
 *
 * Launch entry points include cuLaunchKernelEx, which cuBLAS uses for its matmuls (so a PyTorch
 * program's matmuls never reach cuLaunchKernel) and which went unthrottled in HAMi-core until PR #143
 * (https://github.com/Project-HAMi/HAMi-core/pull/143),
 * and the _ptsz variants that cuGetProcAddress hands out for the per-thread default stream.
 */
#ifndef GEMTRACE_GATED_SYMBOLS_H
#define GEMTRACE_GATED_SYMBOLS_H

#define GT_GATED_SYMBOLS(X)                                                                         \
    /* how the runtime reaches everything else */                                                   \
    X(cuGetProcAddress)                                                                             \
    X(cuGetProcAddress_v2)                                                                          \
    /* kernel launches: held while the agent holds the group */                                    \
    X(cuLaunchKernel)                                                                               \
    X(cuLaunchKernel_ptsz)                                                                          \
    X(cuLaunchKernelEx)                                                                             \
    X(cuLaunchKernelEx_ptsz)                                                                        \
    X(cuLaunchCooperativeKernel)                                                                    \
    X(cuLaunchCooperativeKernel_ptsz)                                                               \
    X(cuGraphLaunch)                                                                                \
    X(cuGraphLaunch_ptsz)                                                                           \
    /* synchronisation: the end of a burst (nothing of ours left queued) */                        \
    X(cuCtxSynchronize)                                                                             \
    X(cuCtxSynchronize_v2)                                                                          \
    X(cuStreamSynchronize)                                                                          \
    X(cuStreamSynchronize_ptsz)                                                                     \
    X(cuEventSynchronize)                                                                           \
    /* device memory: counted against the group's MemoryLimit */                                    \
    X(cuMemAlloc_v2)                                                                                \
    X(cuMemAllocPitch_v2)                                                                           \
    X(cuMemAllocManaged)                                                                            \
    X(cuMemAllocAsync)                                                                              \
    X(cuMemAllocAsync_ptsz)                                                                         \
    X(cuMemAllocFromPoolAsync)                                                                      \
    X(cuMemAllocFromPoolAsync_ptsz)                                                                 \
    X(cuMemCreate)                                                                                  \
    X(cuMemRelease)                                                                                 \
    X(cuMemFree_v2)                                                                                 \
    X(cuMemFreeAsync)                                                                               \
    X(cuMemFreeAsync_ptsz)                                                                          \
    X(cuMemGetInfo_v2)                                                                              \
    /* remembered, not gated: the device a pool's memory lives on (cuMemAllocFromPoolAsync) */      \
    X(cuMemPoolCreate)

/* Entry points the wrappers call but do not gate: resolved with the rest, never handed out. */
#define GT_HELPER_SYMBOLS(X)                                                                        \
    X(cuCtxGetCurrent)                                                                              \
    X(cuCtxGetDevice)                                                                               \
    X(cuDeviceGetCount)                                                                             \
    X(cuDeviceGetDefaultMemPool)                                                                    \
    X(cuDeviceGetMemPool)                                                                           \
    X(cuDeviceGetUuid)                                                                              \
    X(cuDeviceGetUuid_v2)                                                                           \
    X(cuStreamGetDevice)                                                                            \
    /* keep_queue_short's marker: an event in the stream's context, waited on for part of a queue */ \
    X(cuStreamGetCtx)                                                                               \
    X(cuCtxSetCurrent)                                                                              \
    X(cuEventCreate)                                                                                \
    X(cuEventRecord)                                                                                \
    /* advice and prefetch for managed memory served in place of device memory (memory.c) */     \
    /* the _v2 forms (CUmemLocation), CUDA 12.2's, the only ones CUDA 13's cuda.h declares */       \
    X(cuMemAdvise_v2)                                                                               \
    X(cuMemPrefetchAsync_v2)

#endif
