/*
 * workload.h - the test clients' workloads, written once against a table of driver entry points.
 * simgpu-rt fills the table as the CUDA runtime does (dlopen + cuGetProcAddress_v2), simgpu-linked
 * by linking with -lcuda; both then run workload_main. DRV_FUNCS is the one list of entry points:
 * X(base name, symbol a program linked with -lcuda calls); a member's type is that symbol's
 * prototype in cuda_driver_api.h. The symbol must be the form cuGetProcAddress gives for CUDA 13.0
 * (rt.c asks for 13000): cuCtxSynchronize is then cuCtxSynchronize_v2, which takes a context.
 */
#ifndef SIMGPU_WORKLOAD_H
#define SIMGPU_WORKLOAD_H

#include <stdbool.h>

#include "cuda_driver_api.h"

#define DRV_FUNCS(X)                                                           \
    X(cuInit, cuInit)                                                          \
    X(cuGetErrorName, cuGetErrorName)                                          \
    X(cuDeviceGet, cuDeviceGet)                                                \
    X(cuDeviceGetCount, cuDeviceGetCount)                                      \
    X(cuDeviceGetName, cuDeviceGetName)                                        \
    X(cuDeviceGetUuid, cuDeviceGetUuid_v2)                                     \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2)                                   \
    X(cuCtxGetCurrent, cuCtxGetCurrent)                                        \
    X(cuEventCreate, cuEventCreate)                                            \
    X(cuEventRecord, cuEventRecord)                                            \
    X(cuEventSynchronize, cuEventSynchronize)                                  \
    X(cuEventElapsedTime, cuEventElapsedTime_v2)                               \
    X(cuEventDestroy, cuEventDestroy_v2)                                       \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain)                      \
    X(cuCtxSetCurrent, cuCtxSetCurrent)                                        \
    X(cuModuleLoadData, cuModuleLoadData)                                      \
    X(cuModuleGetFunction, cuModuleGetFunction)                                \
    X(cuStreamCreate, cuStreamCreate)                                          \
    X(cuStreamDestroy, cuStreamDestroy_v2)                                     \
    X(cuStreamSynchronize, cuStreamSynchronize)                                \
    X(cuCtxSynchronize, cuCtxSynchronize_v2)                                   \
    X(cuLaunchKernel, cuLaunchKernel)                                          \
    X(cuLaunchKernelEx, cuLaunchKernelEx)                                      \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel)                    \
    X(cuGraphCreate, cuGraphCreate)                                            \
    X(cuGraphAddKernelNode, cuGraphAddKernelNode_v2)                           \
    X(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags)                \
    X(cuGraphLaunch, cuGraphLaunch)                                            \
    X(cuGraphExecDestroy, cuGraphExecDestroy)                                  \
    X(cuGraphDestroy, cuGraphDestroy)                                          \
    X(cuMemGetInfo, cuMemGetInfo_v2)                                           \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2)                                           \
    X(cuMemAlloc, cuMemAlloc_v2)                                               \
    X(cuMemAllocPitch, cuMemAllocPitch_v2)                                     \
    X(cuMemAllocManaged, cuMemAllocManaged)                                    \
    X(cuMemFree, cuMemFree_v2)                                                 \
    X(cuMemAllocAsync, cuMemAllocAsync)                                        \
    X(cuMemFreeAsync, cuMemFreeAsync)                                          \
    X(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool)                    \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync)                        \
    X(cuMemCreate, cuMemCreate)                                                \
    X(cuMemRelease, cuMemRelease)                                              \
    X(cuMemAddressReserve, cuMemAddressReserve)                                \
    X(cuMemAddressFree, cuMemAddressFree)                                      \
    X(cuMemMap, cuMemMap)                                                      \
    X(cuMemUnmap, cuMemUnmap)                                                  \
    X(cuMemSetAccess, cuMemSetAccess)                                          \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity)            \
    X(cuPointerGetAttribute, cuPointerGetAttribute)

struct drv {
#define DRV_FIELD(name, linked) __typeof__(&linked) f_##name;
    DRV_FUNCS(DRV_FIELD)
#undef DRV_FIELD
};

/* Runs the subcommand in argv[1..]; `how` names the way the table was filled ("rt" or "linked"). */
int workload_main(int argc, char **argv, const struct drv *d, const char *how);

#endif
