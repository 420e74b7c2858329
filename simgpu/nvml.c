/*
 * nvml.c - the simulated libnvidia-ml.so.1: enough NVML for gemtrace's agent and for the real pynvml,
 * read from the same shared state as the simulated libcuda (simgpu.h).
 *
 * Devices are in physical order: NVML ignores CUDA_VISIBLE_DEVICES, as the real one does. Per-process
 * memory is what each live process has allocated (contexts cost nothing here, see driver.c); a
 * process is listed on a device once it has made a context there or holds memory on it.
 * There is no nvml.h in the CUDA toolkit, so the few types used are declared here with the layouts
 * of NVML's header (pynvml's ctypes mirrors give the same layouts).
 */
#define _DEFAULT_SOURCE
#include "simgpu.h"

#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_MEMORY_V2 0x02000028u /* nvmlMemory_v2: sizeof(nvmlMemory_v2_t) | 2 << 24 */
#define DRIVER_VERSION_TEXT "580.159.04"
#define CUDA_DRIVER_VERSION 13000

typedef struct nvml_device {
    uint32_t magic;
    unsigned index;
} *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct { /* v2 and v3 share this layout */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

#define DEVICE_MAGIC 0x4d4c564eu /* "NVML" */
static struct nvml_device g_devices[SIM_MAX_DEVICES];
static _Atomic int g_init_count;
static struct sim_state *g_sim;

static nvmlReturn_t ready(void) { return atomic_load(&g_init_count) > 0 && g_sim ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED; }

#define REQUIRE_READY()                 \
    do {                                \
        nvmlReturn_t r_ = ready();      \
        if (r_ != NVML_SUCCESS)         \
            return r_;                  \
    } while (0)

static struct sim_device *device_of(nvmlDevice_t d)
{
    if (!d || d->magic != DEVICE_MAGIC || d->index >= g_sim->n_devices)
        return NULL;
    return &g_sim->dev[d->index];
}

SIM_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    g_sim = sim_state();
    if (!g_sim)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    for (unsigned i = 0; i < SIM_MAX_DEVICES; i++)
        g_devices[i] = (struct nvml_device){.magic = DEVICE_MAGIC, .index = i};
    atomic_fetch_add(&g_init_count, 1);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
SIM_API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

SIM_API nvmlReturn_t nvmlShutdown(void)
{
    int n = atomic_load(&g_init_count);
    do {
        if (n <= 0)
            return NVML_ERROR_UNINITIALIZED;
    } while (!atomic_compare_exchange_weak(&g_init_count, &n, n - 1));
    return NVML_SUCCESS;
}

SIM_API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_text(char *out, unsigned int len, const char *text)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int len)
{
    REQUIRE_READY();
    return copy_text(version, len, DRIVER_VERSION_TEXT);
}

SIM_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

SIM_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    REQUIRE_READY();
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_sim->n_devices;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

SIM_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    REQUIRE_READY();
    if (!device || index >= g_sim->n_devices)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devices[index];
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    REQUIRE_READY();
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_sim->n_devices; i++)
        if (strcmp(g_sim->dev[i].uuid, uuid) == 0) {
            *device = &g_devices[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

static void bus_id(unsigned index, char *out, size_t len)
{
    snprintf(out, len, "00000000:%02X:00.0", 0x10 + index); /* the same bus as cuDeviceGetPCIBusId */
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pci, nvmlDevice_t *device)
{
    REQUIRE_READY();
    if (!pci || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_sim->n_devices; i++) {
        char id[32];
        bus_id(i, id, sizeof id);
        if (strcasecmp(id, pci) == 0 || strcasecmp(id + 4, pci) == 0) {
            *device = &g_devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

SIM_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    REQUIRE_READY();
    if (!device_of(device) || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return nvmlDeviceGetIndex(device, minor);
}

SIM_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int len)
{
    REQUIRE_READY();
    if (!device_of(device))
        return NVML_ERROR_INVALID_ARGUMENT;
    return copy_text(name, len, SIM_NAME);
}

SIM_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int len)
{
    REQUIRE_READY();
    struct sim_device *d = device_of(device);
    if (!d)
        return NVML_ERROR_INVALID_ARGUMENT;
    return copy_text(uuid, len, d->uuid);
}

static void memory_of(struct sim_device *d, unsigned long long *total, unsigned long long *free_bytes,
                      unsigned long long *used)
{
    sim_reap_dead(); /* memory of processes that died is free again, as on a real GPU */
    uint64_t u = atomic_load(&d->used);
    *total = d->total;
    *used = u;
    *free_bytes = u < d->total ? d->total - u : 0;
}

SIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    REQUIRE_READY();
    struct sim_device *d = device_of(device);
    if (!d || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory_of(d, &memory->total, &memory->free, &memory->used);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    REQUIRE_READY();
    struct sim_device *d = device_of(device);
    if (!d || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->reserved = 0;
    memory_of(d, &memory->total, &memory->free, &memory->used);
    return NVML_SUCCESS;
}

/* Live processes with a context or memory on the device, written as v1 (16-byte) or v2/v3 entries.
 * Looks at the liveness of this device's processes only (one lock test each, state.c's slot_alive),
 * reaping those that died: a full sim_reap_dead() per device tested every slot, 8 times the tests for
 * one poll of 8 devices, a cost the agent's bench charges to the agent and no driver has. */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count, void *infos, int v1)
{
    REQUIRE_READY();
    struct sim_device *d = device_of(device);
    if (!d || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned idx = device->index, n = 0, room = infos ? *count : 0;
    for (unsigned i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &g_sim->proc[i];
        int32_t pid = atomic_load(&p->pid);
        uint64_t used = atomic_load(&p->used[idx]);
        if (pid <= 0 || (!used && !(atomic_load(&p->ctx_devices) & (1u << idx))))
            continue;
        if (!sim_reap_if_dead(i))
            continue;
        if (n < room) {
            if (v1)
                ((nvmlProcessInfo_v1_t *)infos)[n] = (nvmlProcessInfo_v1_t){(unsigned)pid, used};
            else
                ((nvmlProcessInfo_t *)infos)[n] = (nvmlProcessInfo_t){
                    (unsigned)pid, used, NVML_VALUE_NOT_AVAILABLE_UINT, NVML_VALUE_NOT_AVAILABLE_UINT};
        }
        n++;
    }
    nvmlReturn_t r = n > room ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    *count = n;
    return r;
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes(device, count, infos, 0);
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes(device, count, infos, 0);
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, count, infos, 1);
}

#define GPU_PCI_ID 0x233010de     /* an H100's device and vendor id */
#define NVSWITCH_PCI_ID 0x1af110de /* an NVSwitch of the A100 generation */

static void fill_pci(nvmlPciInfo_t *pci, unsigned bus, unsigned device_id)
{
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", pci->busId + 4);
    pci->bus = bus;
    pci->pciDeviceId = device_id;
    pci->pciSubSystemId = 0x16c110de;
}

SIM_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    REQUIRE_READY();
    if (!device_of(device) || !pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(pci, 0x10 + device->index, GPU_PCI_ID); /* the bus of bus_id() and cuDeviceGetPCIBusId */
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }
SIM_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

/* ---- topology (SIMGPU_TOPOLOGY, see simgpu.h) ------------------------------------------------ */

enum { /* nvmlGpuTopologyLevel_t */
    NVML_TOPOLOGY_INTERNAL = 0,
    NVML_TOPOLOGY_SINGLE = 10,
    NVML_TOPOLOGY_MULTIPLE = 20,
    NVML_TOPOLOGY_HOSTBRIDGE = 30,
    NVML_TOPOLOGY_NODE = 40,
    NVML_TOPOLOGY_SYSTEM = 50,
};
enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 };               /* nvmlEnableState_t */
enum { NVML_NVLINK_DEVICE_TYPE_GPU = 0x00, NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02 }; /* nvmlIntNvLinkDeviceType_t */
enum { NVML_NVLINK_VERSION_2_0 = 2, NVML_NVLINK_VERSION_3_0 = 4 };          /* nvmlNvlinkVersion_t */

/* DGX-1 with V100s: the hybrid cube-mesh of NVIDIA's DGX-1 whitepaper, 6 links per GPU. */
static const struct { unsigned char a, b, links; } DGX1_NVLINKS[] = {
    {0, 1, 1}, {0, 2, 1}, {0, 3, 2}, {0, 4, 2}, {1, 2, 2}, {1, 3, 1}, {1, 5, 2}, {2, 3, 2},
    {2, 6, 1}, {3, 7, 1}, {4, 5, 1}, {4, 6, 1}, {4, 7, 2}, {5, 6, 2}, {5, 7, 1}, {6, 7, 2},
};
#define DGX1_LINKS_PER_GPU 6
#define DGX1_GPUS 8
/* DGX A100: each GPU's 12 links go two by two to 6 NVSwitches; NVML names the switch, not the peer. */
#define A100_LINKS_PER_GPU 12
#define A100_LINKS_PER_SWITCH 2

struct nvlink_end {
    int gpu;          /* the remote GPU's index, or -1 for an NVSwitch */
    unsigned nvswitch;
    unsigned version;
};

/* The far end of one link: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past the GPU's last link,
 * NOT_FOUND for a link whose peer is not simulated (fewer than 8 devices: the link is down). */
static nvmlReturn_t nvlink_of(unsigned dev, unsigned link, struct nvlink_end *end)
{
    switch (g_sim->topology) {
    case SIM_TOPOLOGY_DGX1:
        if (dev >= DGX1_GPUS)
            return NVML_ERROR_NOT_SUPPORTED;
        if (link >= DGX1_LINKS_PER_GPU)
            return NVML_ERROR_INVALID_ARGUMENT;
        for (unsigned i = 0, next = 0; i < sizeof DGX1_NVLINKS / sizeof *DGX1_NVLINKS; i++) {
            if (DGX1_NVLINKS[i].a != dev && DGX1_NVLINKS[i].b != dev)
                continue;
            next += DGX1_NVLINKS[i].links; /* the pair's links are numbered one after another */
            if (link < next) {
                unsigned peer = DGX1_NVLINKS[i].a == dev ? DGX1_NVLINKS[i].b : DGX1_NVLINKS[i].a;
                *end = (struct nvlink_end){.gpu = (int)peer, .version = NVML_NVLINK_VERSION_2_0};
                return peer < g_sim->n_devices ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
            }
        }
        return NVML_ERROR_INVALID_ARGUMENT;
    case SIM_TOPOLOGY_DGX_A100:
        if (link >= A100_LINKS_PER_GPU)
            return NVML_ERROR_INVALID_ARGUMENT;
        *end = (struct nvlink_end){.gpu = -1, .nvswitch = link / A100_LINKS_PER_SWITCH, .version = NVML_NVLINK_VERSION_3_0};
        return NVML_SUCCESS;
    default:
        return NVML_ERROR_NOT_SUPPORTED;
    }
}

/* Checks the arguments and finds the link's far end; NOT_FOUND (a link down) is left to the caller. */
static nvmlReturn_t nvlink_call(nvmlDevice_t device, unsigned link, const void *out, struct nvlink_end *end)
{
    REQUIRE_READY();
    if (!device_of(device) || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    return nvlink_of(device->index, link, end);
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive)
{
    struct nvlink_end end;
    nvmlReturn_t r = nvlink_call(device, link, isActive, &end);
    if (r == NVML_SUCCESS || r == NVML_ERROR_NOT_FOUND) {
        *isActive = r == NVML_SUCCESS ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
        return NVML_SUCCESS;
    }
    return r;
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)
{
    struct nvlink_end end;
    nvmlReturn_t r = nvlink_call(device, link, version, &end);
    if (r == NVML_SUCCESS)
        *version = end.version;
    return r == NVML_ERROR_NOT_FOUND ? NVML_ERROR_NOT_SUPPORTED : r;
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    struct nvlink_end end;
    nvmlReturn_t r = nvlink_call(device, link, pci, &end);
    if (r == NVML_SUCCESS) {
        if (end.gpu >= 0)
            fill_pci(pci, 0x10 + (unsigned)end.gpu, GPU_PCI_ID);
        else
            fill_pci(pci, 0xc0 + end.nvswitch, NVSWITCH_PCI_ID);
    }
    return r == NVML_ERROR_NOT_FOUND ? NVML_ERROR_NOT_SUPPORTED : r;
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, int *type)
{
    struct nvlink_end end;
    nvmlReturn_t r = nvlink_call(device, link, type, &end);
    if (r == NVML_SUCCESS)
        *type = end.gpu >= 0 ? NVML_NVLINK_DEVICE_TYPE_GPU : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    return r == NVML_ERROR_NOT_FOUND ? NVML_ERROR_NOT_SUPPORTED : r;
}

/* PCIe: the default puts every device under one host bridge; the 8-GPU layouts pair GPUs on PCIe
 * switches (0-1, 2-3, ...) and put four GPUs on each CPU. Under a CPU, the DGX-1's switches share
 * one host bridge (one Intel root complex); the others' sit on separate root ports (NODE). */
SIM_API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *level)
{
    REQUIRE_READY();
    if (!device_of(a) || !device_of(b) || !level)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned i = a->index, j = b->index;
    if (i == j)
        *level = NVML_TOPOLOGY_INTERNAL;
    else if (g_sim->topology == SIM_TOPOLOGY_HOSTBRIDGE)
        *level = NVML_TOPOLOGY_HOSTBRIDGE;
    else if (i / 2 == j / 2)
        *level = NVML_TOPOLOGY_SINGLE;
    else if (i / 4 == j / 4)
        *level = g_sim->topology == SIM_TOPOLOGY_DGX1 ? NVML_TOPOLOGY_HOSTBRIDGE : NVML_TOPOLOGY_NODE;
    else
        *level = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    REQUIRE_READY();
    struct sim_device *d = device_of(device);
    if (!d || !util)
        return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = (unsigned)(sim_utilisation(d) * 100.0 + 0.5);
    util->memory = 0; /* no memory traffic is simulated */
    return NVML_SUCCESS;
}
