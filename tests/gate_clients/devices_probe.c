/*
 * devices_probe.c - allocations whose device is not the current context's, for tests/test_gate.py.
 * Linked with -lcuda (the simulated one); -I hook finds cuda_driver_api.h. The current context is
 * device 0's throughout; each allocation names device 1 another way:
 *   pool     cuMemAllocFromPoolAsync from device 1's default pool
 *   created  cuMemAllocFromPoolAsync from a pool created on device 1
 *   stream   cuMemAllocAsync on a stream of device 1's context
 *   create   cuMemCreate with location.id = 1
 * Prints {"api","size","result"} per allocation, then {"holding":pid} and sleeps until killed.
 */
#include "cuda_driver_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(call)                                                                                 \
    do {                                                                                            \
        CUresult r_ = (call);                                                                       \
        if (r_ != CUDA_SUCCESS) {                                                                   \
            printf("{\"error\":\"%s\",\"result\":%d}\n", #call, (int)r_);                           \
            return 1;                                                                               \
        }                                                                                           \
    } while (0)

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: devices_probe pool|created|stream|create SIZE\n");
        return 2;
    }
    const char *api = argv[1];
    size_t size = strtoull(argv[2], NULL, 10);
    CUdevice dev0, dev1;
    CUcontext ctx0, ctx1;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev0, 0));
    CHECK(cuDeviceGet(&dev1, 1));
    CHECK(cuDevicePrimaryCtxRetain(&ctx1, dev1));
    CHECK(cuDevicePrimaryCtxRetain(&ctx0, dev0));
    CUresult r;
    if (strcmp(api, "pool") == 0 || strcmp(api, "created") == 0) {
        CHECK(cuCtxSetCurrent(ctx0));
        CUmemoryPool pool;
        if (strcmp(api, "pool") == 0) {
            CHECK(cuDeviceGetDefaultMemPool(&pool, dev1));
        } else {
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = dev1;
            CHECK(cuMemPoolCreate(&pool, &props));
        }
        CUdeviceptr p;
        r = cuMemAllocFromPoolAsync(&p, size, pool, NULL);
    } else if (strcmp(api, "stream") == 0) {
        CUstream stream;
        CHECK(cuCtxSetCurrent(ctx1));
        CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
        CHECK(cuCtxSetCurrent(ctx0));
        CUdeviceptr p;
        r = cuMemAllocAsync(&p, size, stream);
    } else if (strcmp(api, "create") == 0) {
        CHECK(cuCtxSetCurrent(ctx0));
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev1;
        CUmemGenericAllocationHandle handle;
        r = cuMemCreate(&handle, size, &prop, 0);
    } else {
        fprintf(stderr, "unknown api %s\n", api);
        return 2;
    }
    printf("{\"api\":\"%s\",\"size\":%zu,\"result\":%d}\n", api, size, (int)r);
    printf("{\"holding\":%d}\n", (int)getpid());
    fflush(stdout);
    pause();
    return 0;
}
