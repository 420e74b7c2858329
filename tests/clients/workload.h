/*
 * workload.h - the test clients' workloads, written once against a table of driver entry points.
 * simgpu-rt fills the table as the CUDA runtime does (dlopen + cuGetProcAddress_v2), simgpu-linked
 * by linking with -lcuda; both then run workload_main. DRV_FUNCS is the one list of entry points:
 * X(base name, PFN type of cudaTypedefs.h, symbol a program linked with -lcuda calls). The PFN type
 * must be the form cuGetProcAddress gives for CUDA 13.0 (rt.c asks for 13000): cuCtxSynchronize
 * is then cuCtxSynchronize_v2, which takes a context.
 */
#ifndef SIMGPU_WORKLOAD_H
#define SIMGPU_WORKLOAD_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdbool.h>

#define DRV_FUNCS(X)                                                              \
    X(cuInit, PFN_cuInit_v2000, cuInit)                                           \
    X(cuGetErrorName, PFN_cuGetErrorName_v6000, cuGetErrorName)                   \
    X(cuDeviceGet, PFN_cuDeviceGet_v2000, cuDeviceGet)                            \
    X(cuDeviceGetCount, PFN_cuDeviceGetCount_v2000, cuDeviceGetCount)             \
    X(cuDeviceGetName, PFN_cuDeviceGetName_v2000, cuDeviceGetName)                \
    X(cuDeviceGetUuid, PFN_cuDeviceGetUuid_v11040, cuDeviceGetUuid_v2)            \
    X(cuDeviceTotalMem, PFN_cuDeviceTotalMem_v3020, cuDeviceTotalMem_v2)          \
    X(cuCtxGetCurrent, PFN_cuCtxGetCurrent_v4000, cuCtxGetCurrent)                \
    X(cuEventCreate, PFN_cuEventCreate_v2000, cuEventCreate)                      \
    X(cuEventRecord, PFN_cuEventRecord_v2000, cuEventRecord)                      \
    X(cuEventSynchronize, PFN_cuEventSynchronize_v2000, cuEventSynchronize)       \
    X(cuEventElapsedTime, PFN_cuEventElapsedTime_v2000, cuEventElapsedTime_v2)    \
    X(cuEventDestroy, PFN_cuEventDestroy_v4000, cuEventDestroy_v2)                \
    X(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000, cuDevicePrimaryCtxRetain) \
    X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000, cuCtxSetCurrent)                \
    X(cuModuleLoadData, PFN_cuModuleLoadData_v2000, cuModuleLoadData)             \
    X(cuModuleGetFunction, PFN_cuModuleGetFunction_v2000, cuModuleGetFunction)    \
    X(cuStreamCreate, PFN_cuStreamCreate_v2000, cuStreamCreate)                   \
    X(cuStreamDestroy, PFN_cuStreamDestroy_v4000, cuStreamDestroy_v2)             \
    X(cuStreamSynchronize, PFN_cuStreamSynchronize_v2000, cuStreamSynchronize)    \
    X(cuCtxSynchronize, PFN_cuCtxSynchronize_v13000, cuCtxSynchronize_v2)         \
    X(cuLaunchKernel, PFN_cuLaunchKernel_v4000, cuLaunchKernel)                   \
    X(cuLaunchKernelEx, PFN_cuLaunchKernelEx_v11060, cuLaunchKernelEx)            \
    X(cuLaunchCooperativeKernel, PFN_cuLaunchCooperativeKernel_v9000, cuLaunchCooperativeKernel) \
    X(cuGraphCreate, PFN_cuGraphCreate_v10000, cuGraphCreate)                     \
    X(cuGraphAddKernelNode, PFN_cuGraphAddKernelNode_v12000, cuGraphAddKernelNode_v2) \
    X(cuGraphInstantiateWithFlags, PFN_cuGraphInstantiateWithFlags_v11040, cuGraphInstantiateWithFlags) \
    X(cuGraphLaunch, PFN_cuGraphLaunch_v10000, cuGraphLaunch)                     \
    X(cuGraphExecDestroy, PFN_cuGraphExecDestroy_v10000, cuGraphExecDestroy)      \
    X(cuGraphDestroy, PFN_cuGraphDestroy_v10000, cuGraphDestroy)                  \
    X(cuMemGetInfo, PFN_cuMemGetInfo_v3020, cuMemGetInfo_v2)                      \
    X(cuMemcpyDtoH, PFN_cuMemcpyDtoH_v3020, cuMemcpyDtoH_v2)                      \
    X(cuMemAlloc, PFN_cuMemAlloc_v3020, cuMemAlloc_v2)                            \
    X(cuMemAllocPitch, PFN_cuMemAllocPitch_v3020, cuMemAllocPitch_v2)             \
    X(cuMemAllocManaged, PFN_cuMemAllocManaged_v6000, cuMemAllocManaged)          \
    X(cuMemFree, PFN_cuMemFree_v3020, cuMemFree_v2)                               \
    X(cuMemAllocAsync, PFN_cuMemAllocAsync_v11020, cuMemAllocAsync)               \
    X(cuMemFreeAsync, PFN_cuMemFreeAsync_v11020, cuMemFreeAsync)                  \
    X(cuDeviceGetDefaultMemPool, PFN_cuDeviceGetDefaultMemPool_v11020, cuDeviceGetDefaultMemPool) \
    X(cuMemAllocFromPoolAsync, PFN_cuMemAllocFromPoolAsync_v11020, cuMemAllocFromPoolAsync) \
    X(cuMemCreate, PFN_cuMemCreate_v10020, cuMemCreate)                           \
    X(cuMemRelease, PFN_cuMemRelease_v10020, cuMemRelease)                        \
    X(cuMemAddressReserve, PFN_cuMemAddressReserve_v10020, cuMemAddressReserve)   \
    X(cuMemAddressFree, PFN_cuMemAddressFree_v10020, cuMemAddressFree)            \
    X(cuMemMap, PFN_cuMemMap_v10020, cuMemMap)                                    \
    X(cuMemUnmap, PFN_cuMemUnmap_v10020, cuMemUnmap)                              \
    X(cuMemSetAccess, PFN_cuMemSetAccess_v10020, cuMemSetAccess)                  \
    X(cuMemGetAllocationGranularity, PFN_cuMemGetAllocationGranularity_v10020, cuMemGetAllocationGranularity)

struct drv {
#define DRV_FIELD(name, type, linked) type f_##name;
    DRV_FUNCS(DRV_FIELD)
#undef DRV_FIELD
};

/* Runs the subcommand in argv[1..]; `how` names the way the table was filled ("rt" or "linked"). */
int workload_main(int argc, char **argv, const struct drv *d, const char *how);

#endif
