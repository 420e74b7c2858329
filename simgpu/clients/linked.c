/*
 * linked.c - simgpu-linked: the same workloads as simgpu-rt, calling the driver by the exported
 * names a program linked with -lcuda uses (cuMemAlloc_v2, cuLaunchKernel, ...).
 */
#include "workload.h"

int main(int argc, char **argv)
{
    struct drv d = {
#define LINK(name, linked) .f_##name = linked,
        DRV_FUNCS(LINK)
#undef LINK
    };
    return workload_main(argc, argv, &d, "linked");
}
