/*
 * driver.c - the simulated libcuda.so.1: the CUDA driver API over the shared state of simgpu.h.
 *
 * What it simulates (issue 2, "The simulated GPU"):
 *   - a kernel runs for the nanoseconds its first parameter holds (a uint64_t argument, so
 *     kernelParams[0] points at it; or the first 8 bytes of a CU_LAUNCH_PARAM_BUFFER_POINTER
 *     buffer); kernels of all processes on one device run one at a time, in order of arrival;
 *   - device memory is a capacity shared by all processes; pointers are unique addresses of a
 *     PROT_NONE reservation of this process, never backed and never dereferenced; managed memory
 *     takes from the host's memory instead (SIMGPU_HOST_MEMORY), as the driver pages it;
 *   - a kernel of a function named "simgpu_collective..." is a collective (collective.c): it waits,
 *     spinning on its device, until every rank of its communicator has started its own;
 *   - a context costs no device memory (a real one costs about 800 MB on an H100): what NVML and
 *     cuMemGetInfo report is exactly the sum of the allocations, so tests can compare figures.
 * Known simplifications: destroying a context or releasing a primary context does not free the
 * allocations made in it; cuMemFreeAsync and pool frees give memory back at once, not when the
 * stream reaches them; copies and memsets take no time (the synchronous ones wait for the stream);
 * cuMemAdvise and cuMemPrefetchAsync check their arguments and log themselves, but move nothing.
 *
 * Exported functions never call one another (an older or newer form of an entry point calls the
 * static *_impl behind both), so a uprobe or an interposer on one entry point sees exactly the calls
 * made to it, as with the real libcuda.
 *
 * The launch path takes no lock and makes no system call beyond clock_gettime (vDSO), so that the
 * gate's overhead can be measured against it. Functions use the real prototypes of cuda.h by the
 * names libcuda exports, as the gate's hook/cuda_driver_api.h declares them (checked against cuda.h).
 */
#define _DEFAULT_SOURCE
#include "cuda_driver_api.h"
#include "simgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define OBJ_MAGIC(a, b, c, d) ((uint32_t)(a) | (uint32_t)(b) << 8 | (uint32_t)(c) << 16 | (uint32_t)(d) << 24)
#define CTX_MAGIC OBJ_MAGIC('c', 't', 'x', '1')
#define STREAM_MAGIC OBJ_MAGIC('s', 't', 'r', '1')
#define EVENT_MAGIC OBJ_MAGIC('e', 'v', 't', '1')
#define MODULE_MAGIC OBJ_MAGIC('m', 'o', 'd', '1')
#define FUNC_MAGIC OBJ_MAGIC('f', 'u', 'n', '1')
#define GRAPH_MAGIC OBJ_MAGIC('g', 'r', 'f', '1')
#define NODE_MAGIC OBJ_MAGIC('n', 'o', 'd', '1')
#define EXEC_MAGIC OBJ_MAGIC('e', 'x', 'e', '1')
#define POOL_MAGIC OBJ_MAGIC('p', 'o', 'o', '1')
#define HANDLE_MAGIC OBJ_MAGIC('h', 'n', 'd', '1')
#define DEAD_MAGIC OBJ_MAGIC('d', 'e', 'a', 'd')

#define DRIVER_VERSION 13000
#define CTX_STACK_MAX 32
#define GRANULARITY (2ull << 20) /* cuMemCreate granularity, as on real GPUs */
#define ALLOC_ALIGN 512ull       /* cuMemAlloc alignment (the real one is at least 256) */

/* A kernel whose function's name starts so is a collective (collective.c): its parameters are four
 * uint64_t, kernelParams[0..3] (or a CU_LAUNCH_PARAM_BUFFER_POINTER buffer of 32 bytes): its duration
 * in ns, the communicator's id (1..2^48-1), the number of ranks (1..16) and this launch's rank. One
 * named COLLECTIVE_MAX_PREFIX... takes a fifth: the address of a uint64_t in host memory (as mapped
 * pinned memory), this rank's value when launched and the largest rank's when the launch returns, as
 * a job's ranks all-reduce a flag to agree when to stop. */
#define COLLECTIVE_PREFIX "simgpu_collective"
#define COLLECTIVE_MAX_PREFIX "simgpu_collective_max"
#define COLLECTIVE_ARGS 4
#define COLLECTIVE_MAX_ARGS 5

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- objects ------------------------------------------------------------------------------ */

struct CUstream_st {
    uint32_t magic;
    unsigned flags;
    struct CUctx_st *ctx;
    _Atomic uint64_t last_end; /* end of the last kernel queued on this stream */
    _Atomic uint64_t pos;      /* launches so far; ring[pos % depth] is the slot to reuse */
    _Atomic uint64_t *ring;    /* ends of the last `depth` kernels: the hardware queue */
};

struct CUctx_st {
    uint32_t magic;
    int ordinal; /* CUDA ordinal (after CUDA_VISIBLE_DEVICES) */
    int phys;    /* index into the shared state's devices */
    unsigned flags;
    bool primary;
    _Atomic int refs; /* primary contexts: retain count */
    _Atomic uint64_t last_end; /* end of the last kernel queued in this context, any stream */
    struct CUstream_st legacy;  /* the NULL / CU_STREAM_LEGACY stream */
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    struct CUctx_st *ctx; /* the context current at creation: only its streams may record it */
    _Atomic uint64_t t; /* when the GPU reaches the event; 0 until recorded */
};

struct CUfunc_st {
    uint32_t magic;
    uint8_t collective_args; /* 0, or a collective's parameter count: launches go through launch_collective */
    struct CUfunc_st *next;
    char name[64];
};

struct CUmod_st {
    uint32_t magic;
    struct CUfunc_st *functions;
    pthread_mutex_t lock;
};

struct CUgraphNode_st {
    uint32_t magic;
    uint64_t ns;
    struct CUgraphNode_st *next;
};

struct CUgraph_st {
    uint32_t magic;
    size_t n;
    struct CUgraphNode_st *head, *tail;
};

struct CUgraphExec_st {
    uint32_t magic;
    size_t n;
    uint64_t ns[];
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int phys;
};

struct sim_handle { /* a cuMemCreate allocation: lives while created or mapped */
    uint32_t magic;
    int phys;
    uint64_t size;
    _Atomic int refs;
};

/* ---- process state ------------------------------------------------------------------------ */

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static CUresult g_init_result = CUDA_ERROR_NOT_INITIALIZED;
static _Atomic int g_ready;
static struct sim_state *g_sim;
static int g_n_visible;
static int g_visible[SIM_MAX_DEVICES]; /* CUDA ordinal -> physical index */
static uint64_t g_queue_depth = 1024;
static struct CUctx_st g_primary[SIM_MAX_DEVICES];
static struct CUmemPoolHandle_st g_default_pool[SIM_MAX_DEVICES];

static __thread struct CUctx_st *t_stack[CTX_STACK_MAX];
static __thread int t_depth;
static __thread struct {
    struct CUctx_st *ctx;
    struct CUstream_st *stream;
} t_per_thread[4]; /* per-thread default streams of this thread, by context */

static inline struct CUctx_st *current_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

#define REQUIRE_INIT()                                   \
    do {                                                 \
        if (UNLIKELY(!atomic_load_explicit(&g_ready, memory_order_acquire))) \
            return CUDA_ERROR_NOT_INITIALIZED;           \
    } while (0)

/* CUDA_VISIBLE_DEVICES: ordinals or (prefixes of) UUIDs, comma-separated; like the real driver,
 * the list ends at the first entry that names no device or repeats one. */
static void parse_visible(void)
{
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    int n = (int)g_sim->n_devices;
    if (!env) {
        for (int i = 0; i < n; i++)
            g_visible[i] = i;
        g_n_visible = n;
        return;
    }
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", env);
    g_n_visible = 0;
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        size_t len = strlen(tok);
        while (len && tok[len - 1] == ' ')
            tok[--len] = 0;
        int phys = -1;
        if (strncmp(tok, "GPU-", 4) == 0) {
            for (int i = 0; i < n; i++) {
                if (len > 4 && strncmp(g_sim->dev[i].uuid, tok, len) == 0) {
                    if (phys >= 0) { /* ambiguous prefix */
                        phys = -1;
                        break;
                    }
                    phys = i;
                }
            }
        } else {
            char *end;
            long v = strtol(tok, &end, 10);
            if (end != tok && *end == 0 && v >= 0 && v < n)
                phys = (int)v;
        }
        for (int k = 0; k < g_n_visible && phys >= 0; k++)
            if (g_visible[k] == phys)
                phys = -1;
        if (phys < 0)
            break;
        g_visible[g_n_visible++] = phys;
    }
}

static void stream_init(struct CUstream_st *s, struct CUctx_st *ctx, unsigned flags)
{
    s->magic = STREAM_MAGIC;
    s->flags = flags;
    s->ctx = ctx;
    atomic_store(&s->last_end, 0);
    atomic_store(&s->pos, 0);
    s->ring = calloc(g_queue_depth, sizeof *s->ring);
}

static void ctx_init(struct CUctx_st *c, int ordinal, unsigned flags, bool primary)
{
    c->ordinal = ordinal;
    c->phys = g_visible[ordinal];
    c->flags = flags;
    c->primary = primary;
    atomic_store(&c->refs, 0);
    atomic_store(&c->last_end, 0);
    stream_init(&c->legacy, c, 0);
    c->magic = CTX_MAGIC;
}

static void do_init(void)
{
    g_sim = sim_state();
    if (!g_sim) {
        g_init_result = CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    const char *depth = getenv("SIMGPU_QUEUE_DEPTH");
    if (depth && *depth && strtoull(depth, NULL, 10) > 0)
        g_queue_depth = strtoull(depth, NULL, 10);
    parse_visible();
    if (sim_my_slot() < 0) {
        g_init_result = CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    for (int i = 0; i < g_n_visible; i++) {
        g_default_pool[i].magic = POOL_MAGIC;
        g_default_pool[i].phys = g_visible[i];
    }
    g_init_result = g_n_visible ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    if (g_init_result == CUDA_SUCCESS)
        atomic_store_explicit(&g_ready, 1, memory_order_release);
}

SIM_API CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_init_once, do_init);
    return g_init_result;
}

SIM_API CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* ---- errors ------------------------------------------------------------------------------- */

#define SIM_ERRORS(E)                                                              \
    E(CUDA_SUCCESS, "no error")                                                    \
    E(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                \
    E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                   \
    E(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                          \
    E(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                            \
    E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                  \
    E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                         \
    E(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")                  \
    E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                        \
    E(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")               \
    E(CUDA_ERROR_NOT_MAPPED, "resource not mapped")                                \
    E(CUDA_ERROR_FILE_NOT_FOUND, "file not found")                                 \
    E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                        \
    E(CUDA_ERROR_NOT_FOUND, "named symbol not found")                              \
    E(CUDA_ERROR_NOT_READY, "device not ready")                                    \
    E(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                      \
    E(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS") \
    E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                         \
    E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                         \
    E(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped")                        \
    E(CUDA_ERROR_UNKNOWN, "unknown error")

SIM_API CUresult cuGetErrorName(CUresult error, const char **p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
#define E(code, text) \
    if (error == code) { \
        *p = #code;      \
        return CUDA_SUCCESS; \
    }
    SIM_ERRORS(E)
#undef E
    *p = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuGetErrorString(CUresult error, const char **p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
#define E(code, text) \
    if (error == code) { \
        *p = text;       \
        return CUDA_SUCCESS; \
    }
    SIM_ERRORS(E)
#undef E
    *p = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* Nothing of NVIDIA's private tables is simulated; the real runtime cannot run on simgpu. */
SIM_API CUresult cuGetExportTable(const void **table, const CUuuid *id)
{
    (void)id;
    if (table)
        *table = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---- devices ------------------------------------------------------------------------------ */

static inline bool valid_ordinal(CUdevice d) { return d >= 0 && d < g_n_visible; }
static inline struct sim_device *device_of(CUdevice d) { return &g_sim->dev[g_visible[d]]; }

SIM_API CUresult cuDeviceGetCount(int *count)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_n_visible;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", SIM_NAME);
    return CUDA_SUCCESS;
}

static CUresult cuDeviceGetUuid_v2_impl(CUuuid *uuid, CUdevice dev)
{
    REQUIRE_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, device_of(dev)->uuid_bytes, sizeof uuid->bytes);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2_impl(uuid, dev); }

SIM_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2_impl(uuid, dev); }

SIM_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REQUIRE_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = device_of(dev)->total;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attrib, CUdevice dev)
{
    REQUIRE_INIT();
    if (!value || attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    /* An H100-like device; attributes not listed read 0 ("not supported"). */
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *value = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *value = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *value = 65535; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *value = 52428800; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *value = 2048; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = 0x10 + g_visible[dev]; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *value = 3; break;
    default: *value = 0;
    }
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    REQUIRE_INIT();
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!bus_id || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(bus_id, (size_t)len, "0000:%02x:00.0", 0x10 + g_visible[dev]); /* as nvml.c */
    return CUDA_SUCCESS;
}

/* ---- contexts ----------------------------------------------------------------------------- */

static inline bool valid_ctx(struct CUctx_st *c) { return c && c->magic == CTX_MAGIC; }

SIM_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* process-local: first retain only */
    struct CUctx_st *c = &g_primary[dev];
    pthread_mutex_lock(&lock);
    if (c->magic != CTX_MAGIC)
        ctx_init(c, dev, 0, true);
    atomic_fetch_add(&c->refs, 1);
    pthread_mutex_unlock(&lock);
    sim_note_context(c->phys);
    *pctx = c;
    return CUDA_SUCCESS;
}

static CUresult cuDevicePrimaryCtxRelease_v2_impl(CUdevice dev)
{
    REQUIRE_INIT();
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUctx_st *c = &g_primary[dev];
    int refs = atomic_load(&c->refs);
    do {
        if (refs <= 0)
            return CUDA_ERROR_INVALID_CONTEXT;
    } while (!atomic_compare_exchange_weak(&c->refs, &refs, refs - 1));
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2_impl(dev); }

SIM_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2_impl(dev); }

SIM_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    REQUIRE_INIT();
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *flags = g_primary[dev].magic == CTX_MAGIC ? g_primary[dev].flags : 0;
    *active = g_primary[dev].magic == CTX_MAGIC && atomic_load(&g_primary[dev].refs) > 0;
    return CUDA_SUCCESS;
}

static CUresult cuDevicePrimaryCtxSetFlags_v2_impl(CUdevice dev, unsigned int flags)
{
    REQUIRE_INIT();
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    g_primary[dev].flags = flags;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) { return cuDevicePrimaryCtxSetFlags_v2_impl(dev, flags); }

SIM_API CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return cuDevicePrimaryCtxSetFlags_v2_impl(dev, flags);
}

static CUresult cuDevicePrimaryCtxReset_v2_impl(CUdevice dev)
{
    REQUIRE_INIT();
    return valid_ordinal(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

SIM_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return cuDevicePrimaryCtxReset_v2_impl(dev); }

SIM_API CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2_impl(dev); }

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_init(c, dev, flags, false);
    sim_note_context(c->phys);
    t_stack[t_depth++] = c; /* a new context becomes current, pushed on this thread's stack */
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }
SIM_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }

SIM_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags, CUdevice dev)
{
    (void)params;
    (void)n;
    return ctx_create(pctx, flags, dev);
}

SIM_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    (void)params;
    return ctx_create(pctx, flags, dev);
}

static CUresult cuCtxDestroy_v2_impl(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!valid_ctx(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_sleep_until(atomic_load(&ctx->last_end)); /* destroying waits for the context's work */
    for (int i = 0; i < t_depth; i++) /* only this thread's stack can be reached from here */
        if (t_stack[i] == ctx) {
            memmove(&t_stack[i], &t_stack[i + 1], (size_t)(t_depth - i - 1) * sizeof *t_stack);
            t_depth--;
            i--;
        }
    /* The object stays allocated (marked dead) so that a stale handle reads as invalid, not freed. */
    ctx->magic = DEAD_MAGIC;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxDestroy_v2(CUcontext ctx) { return cuCtxDestroy_v2_impl(ctx); }

SIM_API CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2_impl(ctx); }

SIM_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    REQUIRE_INIT();
    if (ctx && !valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctx) {
        if (t_depth)
            t_depth--;
    } else if (t_depth) {
        t_stack[t_depth - 1] = ctx;
    } else {
        t_stack[t_depth++] = ctx;
    }
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

static CUresult cuCtxPushCurrent_v2_impl(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxPushCurrent_v2(CUcontext ctx) { return cuCtxPushCurrent_v2_impl(ctx); }

SIM_API CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2_impl(ctx); }

static CUresult cuCtxPopCurrent_v2_impl(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!t_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_stack[--t_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { return cuCtxPopCurrent_v2_impl(pctx); }

SIM_API CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2_impl(pctx); }

static CUresult cuCtxGetDevice_v2_impl(CUdevice *device, CUcontext ctx)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = ctx ? ctx : current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) { return cuCtxGetDevice_v2_impl(device, ctx); }

SIM_API CUresult cuCtxGetDevice(CUdevice *device) { return cuCtxGetDevice_v2_impl(device, NULL); }

SIM_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    REQUIRE_INIT();
    struct CUctx_st *c = ctx ? ctx : current_ctx();
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020; /* what the real driver reports for every context since CUDA 3.2 */
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetFlags(unsigned int *flags)
{
    REQUIRE_INIT();
    struct CUctx_st *c = current_ctx();
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    REQUIRE_INIT();
    if (least)
        *least = 0;
    if (greatest)
        *greatest = -5;
    return CUDA_SUCCESS;
}

/* ---- logs for tests: one JSON line per call, appended to the file an environment variable names */

struct line_log {
    const char *env;
    _Atomic int fd; /* 0 until first use; -1 when the variable is unset or the file cannot be opened */
};

static void log_line(struct line_log *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_line(struct line_log *log, const char *fmt, ...)
{
    int fd = atomic_load(&log->fd);
    if (fd == 0) { /* first use: two threads at once may both open; the loser closes its own */
        const char *path = getenv(log->env);
        int opened = path && *path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
        int expected = 0;
        if (!atomic_compare_exchange_strong(&log->fd, &expected, opened == 0 ? -1 : opened) && opened >= 0)
            close(opened);
        fd = atomic_load(&log->fd);
    }
    if (fd <= 0)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n <= 0 || (size_t)n >= sizeof line - 1)
        return;
    line[n++] = '\n';
    ssize_t written = write(fd, line, (size_t)n); /* O_APPEND: one line stays whole */
    (void)written;
}

/* Each synchronising call (a context's, a stream's, an event's) is appended to $SIMGPU_SYNC_LOG, when
 * set: how long it waits on the simulated GPU's clock, and how much of the context's work stays queued
 * behind what it waits for. Both are read off the timeline when the call is made, so they do not
 * depend on how busy the host is: tests see whether a gate waited for all of a queue or part of it. */
static struct line_log g_sync_log = {.env = "SIMGPU_SYNC_LOG"};

static void sync_log(const char *call, struct CUctx_st *c, uint64_t until)
{
    uint64_t now = sim_now(), last = atomic_load(&c->last_end);
    log_line(&g_sync_log, "{\"pid\":%d,\"call\":\"%s\",\"wait_ns\":%llu,\"queued_after_ns\":%llu}", (int)getpid(),
             call, (unsigned long long)(until > now ? until - now : 0),
             (unsigned long long)(last > until ? last - until : 0));
}

static CUresult cuCtxSynchronize_v2_impl(CUcontext ctx)
{
    REQUIRE_INIT();
    struct CUctx_st *c = ctx ? ctx : current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t until = atomic_load(&c->last_end);
    sync_log("cuCtxSynchronize", c, until);
    sim_sleep_until(until);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSynchronize_v2(CUcontext ctx) { return cuCtxSynchronize_v2_impl(ctx); }

SIM_API CUresult cuCtxSynchronize(void) { return cuCtxSynchronize_v2_impl(NULL); }

/* ---- streams ------------------------------------------------------------------------------ */

static struct CUstream_st *per_thread_stream(struct CUctx_st *ctx)
{
    for (int i = 0; i < 4; i++)
        if (t_per_thread[i].ctx == ctx)
            return t_per_thread[i].stream;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    stream_init(s, ctx, 0);
    if (!s->ring) {
        free(s);
        return NULL;
    }
    /* Four contexts per thread are remembered; a fifth evicts one (its stream stays allocated). */
    int slot = 0;
    for (int i = 0; i < 4; i++)
        if (!t_per_thread[i].ctx) {
            slot = i;
            break;
        }
    t_per_thread[slot].ctx = ctx;
    t_per_thread[slot].stream = s;
    return s;
}

/* The stream a call names: NULL is the legacy stream, or the per-thread one for _ptsz/_ptds entry
 * points. Returns NULL and sets *err when there is none. */
static inline struct CUstream_st *resolve_stream(CUstream h, bool per_thread, CUresult *err)
{
    if (h && h != CU_STREAM_LEGACY && h != CU_STREAM_PER_THREAD) {
        if (UNLIKELY(h->magic != STREAM_MAGIC)) {
            *err = CUDA_ERROR_INVALID_HANDLE;
            return NULL;
        }
        return h;
    }
    struct CUctx_st *c = current_ctx();
    if (UNLIKELY(!c || c->magic != CTX_MAGIC)) {
        *err = CUDA_ERROR_INVALID_CONTEXT;
        return NULL;
    }
    if (h == CU_STREAM_PER_THREAD || (!h && per_thread)) {
        struct CUstream_st *s = per_thread_stream(c);
        if (!s)
            *err = CUDA_ERROR_OUT_OF_MEMORY;
        return s;
    }
    return &c->legacy;
}

/* When the GPU is done with everything queued on s so far. The legacy stream synchronises with
 * every blocking stream of its context, so its end is the context's. */
static inline uint64_t stream_end(struct CUstream_st *s)
{
    return s == &s->ctx->legacy ? atomic_load(&s->ctx->last_end) : atomic_load(&s->last_end);
}

static CUresult stream_create(CUstream *ph, unsigned int flags)
{
    REQUIRE_INIT();
    if (!ph)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    stream_init(s, c, flags);
    if (!s->ring) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ph = s;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamCreate(CUstream *ph, unsigned int flags) { return stream_create(ph, flags); }

SIM_API CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int priority)
{
    (void)priority;
    return stream_create(ph, flags);
}

static CUresult cuStreamDestroy_v2_impl(CUstream h)
{
    REQUIRE_INIT();
    if (!h || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD || h->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    /* Work queued on it still runs (it is on the device's timeline); the handle goes now. */
    h->magic = DEAD_MAGIC;
    free(h->ring);
    free(h);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamDestroy_v2(CUstream h) { return cuStreamDestroy_v2_impl(h); }

SIM_API CUresult cuStreamDestroy(CUstream h) { return cuStreamDestroy_v2_impl(h); }

static CUresult stream_sync(CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    uint64_t until = stream_end(s);
    sync_log("cuStreamSynchronize", s->ctx, until);
    sim_sleep_until(until);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamSynchronize(CUstream h) { return stream_sync(h, false); }
SIM_API CUresult cuStreamSynchronize_ptsz(CUstream h) { return stream_sync(h, true); }

static CUresult stream_query(CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    return stream_end(s) <= sim_now() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* The context a stream belongs to: the gate creates its queue marker there. */
static CUresult stream_get_ctx(CUstream h, CUcontext *pctx, bool per_thread)
{
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = s->ctx;
    return CUDA_SUCCESS;
}

/* The device a stream's work runs on (CUDA 12.8): the gate asks it to charge a launch to the GPU its
 * stream names, which need not be the current context's. */
static CUresult stream_get_device(CUstream h, CUdevice *device, bool per_thread)
{
    CUcontext ctx;
    CUresult err = stream_get_ctx(h, &ctx, per_thread);
    if (err != CUDA_SUCCESS)
        return err;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = ctx->ordinal;
    return CUDA_SUCCESS;
}
SIM_API CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx) { return stream_get_ctx(h, pctx, false); }
SIM_API CUresult cuStreamGetCtx_ptsz(CUstream h, CUcontext *pctx) { return stream_get_ctx(h, pctx, true); }
SIM_API CUresult cuStreamGetDevice(CUstream h, CUdevice *device) { return stream_get_device(h, device, false); }
SIM_API CUresult cuStreamGetDevice_ptsz(CUstream h, CUdevice *device) { return stream_get_device(h, device, true); }
SIM_API CUresult cuStreamQuery(CUstream h) { return stream_query(h, false); }
SIM_API CUresult cuStreamQuery_ptsz(CUstream h) { return stream_query(h, true); }

static inline void atomic_max_u64(_Atomic uint64_t *v, uint64_t x)
{
    uint64_t cur = atomic_load_explicit(v, memory_order_relaxed);
    while (cur < x && !atomic_compare_exchange_weak(v, &cur, x))
        ;
}

static CUresult stream_wait_event(CUstream h, CUevent ev, unsigned int flags, bool per_thread)
{
    (void)flags;
    REQUIRE_INIT();
    if (!ev || ev->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    atomic_max_u64(&s->last_end, atomic_load(&ev->t)); /* later kernels start after the event */
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) { return stream_wait_event(h, ev, flags, false); }
SIM_API CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent ev, unsigned int flags) { return stream_wait_event(h, ev, flags, true); }

/* ---- the timeline ------------------------------------------------------------------------- */

/* The slot of stream s's hardware queue that its next kernel takes; when the queue is full, first
 * waits until its oldest kernel ends (and moves *now). */
static inline _Atomic uint64_t *queue_slot(struct CUstream_st *s, uint64_t *now)
{
    uint64_t pos = atomic_fetch_add_explicit(&s->pos, 1, memory_order_relaxed);
    _Atomic uint64_t *slot = &s->ring[pos % g_queue_depth];
    uint64_t oldest = atomic_load_explicit(slot, memory_order_relaxed);
    if (UNLIKELY(oldest > *now)) {
        sim_sleep_until(oldest);
        *now = sim_now();
    }
    return slot;
}

/* Queue one kernel of `ns` nanoseconds on stream s. The device runs kernels of every process one at
 * a time in order of arrival: the kernel starts when the device is free and the stream's previous
 * kernel has ended, whichever is later; one CAS on the device's busy_until places it. While a
 * collective spins on the device (collective.c) nothing else is placed there: the launch waits. */
static inline void enqueue_kernel(struct CUstream_st *s, uint64_t ns)
{
    struct CUctx_st *c = s->ctx;
    struct sim_device *d = &g_sim->dev[c->phys];
    uint64_t now = sim_now();
    _Atomic uint64_t *slot = queue_slot(s, &now);
    uint64_t start = atomic_load_explicit(&s->last_end, memory_order_relaxed);
    if (start < now)
        start = now;
    uint64_t busy = atomic_load_explicit(&d->busy_until, memory_order_relaxed), end;
    for (;;) {
        if (UNLIKELY(busy & SIM_SPINNING)) {
            sim_spin_wait(d, busy);
            now = sim_now();
            start = start > now ? start : now;
            busy = atomic_load(&d->busy_until);
            continue;
        }
        end = (busy > start ? busy : start) + ns;
        if (atomic_compare_exchange_weak(&d->busy_until, &busy, end))
            break;
    }
    if (ns)
        atomic_fetch_add_explicit(&d->busy_total, ns, memory_order_relaxed);
    atomic_store_explicit(slot, end, memory_order_relaxed);
    atomic_max_u64(&s->last_end, end);
    atomic_max_u64(&c->last_end, end);
}

/* A launch's `extra` array: its CU_LAUNCH_PARAM_BUFFER_POINTER (NULL if none) and the size its
 * CU_LAUNCH_PARAM_BUFFER_SIZE gives (`*size` unchanged if none); any other entry is invalid. */
static inline CUresult extra_buffer(void **extra, void **buffer, size_t *size)
{
    *buffer = NULL;
    for (int i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
        if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
            *buffer = extra[i + 1];
        else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1])
            *size = *(size_t *)extra[i + 1];
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* The kernel's duration: the uint64_t that its first parameter holds. */
static inline CUresult kernel_ns(void **params, void **extra, uint64_t *ns)
{
    *ns = 0;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    if (params) {
        if (params[0])
            memcpy(ns, params[0], sizeof *ns);
        return CUDA_SUCCESS;
    }
    if (extra) {
        void *buffer;
        size_t size = sizeof *ns;
        if (extra_buffer(extra, &buffer, &size) != CUDA_SUCCESS)
            return CUDA_ERROR_INVALID_VALUE;
        if (buffer && size >= sizeof *ns)
            memcpy(ns, buffer, sizeof *ns);
    }
    return CUDA_SUCCESS;
}

/* A collective's n parameters (COLLECTIVE_PREFIX): from kernelParams, or packed in the extra buffer. */
static CUresult collective_args(void **params, void **extra, int n, uint64_t a[COLLECTIVE_MAX_ARGS])
{
    if (params && !extra) {
        for (int i = 0; i < n; i++) {
            if (!params[i])
                return CUDA_ERROR_INVALID_VALUE;
            memcpy(&a[i], params[i], sizeof a[i]);
        }
        return CUDA_SUCCESS;
    }
    if (!extra || params)
        return CUDA_ERROR_INVALID_VALUE;
    void *buffer;
    size_t size = 0;
    if (extra_buffer(extra, &buffer, &size) != CUDA_SUCCESS || !buffer || size < n * sizeof a[0])
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(a, buffer, n * sizeof a[0]);
    return CUDA_SUCCESS;
}

/* This process's ranks in communicators, joined at their first collective. */
static pthread_mutex_t g_members_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_member g_members[SIM_MAX_COMMS];

static CUresult member_of(uint64_t id, uint64_t world, uint64_t rank, struct sim_member **pm)
{
    if (!id || world < 1 || world > SIM_MAX_RANKS || rank >= world) {
        fprintf(stderr, "simgpu: a collective names communicator %llu, rank %llu of %llu; the id is 1..2^48-1, "
                        "the rank count 1..%d and the rank below it\n",
                (unsigned long long)id, (unsigned long long)rank, (unsigned long long)world, SIM_MAX_RANKS);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t key = id << 16 | world;
    int32_t me = (int32_t)getpid();
    struct sim_member *free_one = NULL;
    CUresult err = CUDA_SUCCESS;
    pthread_mutex_lock(&g_members_lock);
    for (int i = 0; i < SIM_MAX_COMMS; i++) {
        struct sim_member *m = &g_members[i];
        if (m->pid == me && m->key == key && m->rank == rank) {
            *pm = m;
            goto out;
        }
        if (!free_one && m->pid != me) /* unused, or a parent's before fork */
            free_one = m;
    }
    if (!free_one) {
        err = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    switch (sim_comm_join(id, (unsigned)world, (unsigned)rank, free_one)) {
    case SIM_COMM_OK:
        *pm = free_one;
        break;
    case SIM_COMM_MISMATCH:
        fprintf(stderr, "simgpu: communicator %llu is live with another rank count than %llu; give every rank the "
                        "same count, or another id\n", (unsigned long long)id, (unsigned long long)world);
        err = CUDA_ERROR_INVALID_VALUE;
        break;
    case SIM_COMM_TAKEN:
        fprintf(stderr, "simgpu: rank %llu of communicator %llu is held by another live process; start one "
                        "process per rank\n", (unsigned long long)rank, (unsigned long long)id);
        err = CUDA_ERROR_INVALID_VALUE;
        break;
    default:
        fprintf(stderr, "simgpu: %d communicators are live; end some runs first\n", SIM_MAX_COMMS);
        err = CUDA_ERROR_OUT_OF_MEMORY;
        break;
    }
out:
    pthread_mutex_unlock(&g_members_lock);
    return err;
}

/* A collective (collective.c): holds the stream's device from its start, blocks until every rank has
 * started its collective of this round, then places spin and duration on the timeline. */
static CUresult launch_collective(struct CUstream_st *s, int n, void **params, void **extra)
{
    uint64_t a[COLLECTIVE_MAX_ARGS] = {0};
    CUresult err = collective_args(params, extra, n, a);
    if (err)
        return err;
    uint64_t none = 0, *value = n == COLLECTIVE_MAX_ARGS ? (uint64_t *)(uintptr_t)a[4] : &none;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_member *m;
    if ((err = member_of(a[1], a[2], a[3], &m)))
        return err;
    if (m->failed)
        return CUDA_ERROR_LAUNCH_FAILED;
    struct CUctx_st *c = s->ctx;
    struct sim_device *d = &g_sim->dev[c->phys];
    uint64_t now = sim_now();
    _Atomic uint64_t *slot = queue_slot(s, &now);
    uint64_t after = atomic_load(&s->last_end), start, end;
    enum sim_comm_result r = sim_collective(m, d, after > now ? after : now, a[0], value, &start, &end);
    atomic_store(slot, end);
    atomic_max_u64(&s->last_end, end);
    atomic_max_u64(&c->last_end, end);
    return r == SIM_COMM_OK ? CUDA_SUCCESS : CUDA_ERROR_LAUNCH_FAILED;
}

static inline CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, CUstream h, void **params, void **extra, bool per_thread)
{
    REQUIRE_INIT();
    if (UNLIKELY(!f || f->magic != FUNC_MAGIC))
        return CUDA_ERROR_INVALID_HANDLE;
    if (UNLIKELY(!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult err = CUDA_SUCCESS;
    if (UNLIKELY(f->collective_args)) {
        struct CUstream_st *s = resolve_stream(h, per_thread, &err);
        return s ? launch_collective(s, f->collective_args, params, extra) : err;
    }
    uint64_t ns;
    err = kernel_ns(params, extra, &ns);
    if (UNLIKELY(err))
        return err;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (UNLIKELY(!s))
        return err;
    enqueue_kernel(s, ns);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int shared, CUstream h, void **params,
                                void **extra)
{
    (void)shared;
    return launch(f, gx, gy, gz, bx, by, bz, h, params, extra, false);
}

SIM_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                     unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                     CUstream h, void **params, void **extra)
{
    (void)shared;
    return launch(f, gx, gy, gz, bx, by, bz, h, params, extra, true);
}

SIM_API CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)
{
    if (!cfg)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ,
                  cfg->hStream, params, extra, false);
}

SIM_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)
{
    if (!cfg)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ,
                  cfg->hStream, params, extra, true);
}

SIM_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                           unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                           CUstream h, void **params)
{
    (void)shared;
    return launch(f, gx, gy, gz, bx, by, bz, h, params, NULL, false);
}

SIM_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                unsigned int bx, unsigned int by, unsigned int bz,
                                                unsigned int shared, CUstream h, void **params)
{
    (void)shared;
    return launch(f, gx, gy, gz, bx, by, bz, h, params, NULL, true);
}

/* ---- events ------------------------------------------------------------------------------- */

SIM_API CUresult cuEventCreate(CUevent *pev, unsigned int flags)
{
    REQUIRE_INIT();
    if (!pev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    e->ctx = current_ctx();
    *pev = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent ev, CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    if (!ev || ev->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    if (s->ctx != ev->ctx)
        return CUDA_ERROR_INVALID_HANDLE; /* as the driver: an event and its stream share a context */
    uint64_t now = sim_now(), end = stream_end(s);
    atomic_store(&ev->t, end > now ? end : now); /* the GPU reaches it after the stream's work */
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecord(CUevent ev, CUstream h) { return event_record(ev, h, false); }
SIM_API CUresult cuEventRecord_ptsz(CUevent ev, CUstream h) { return event_record(ev, h, true); }

SIM_API CUresult cuEventSynchronize(CUevent ev)
{
    REQUIRE_INIT();
    if (!ev || ev->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t until = atomic_load(&ev->t);
    sync_log("cuEventSynchronize", ev->ctx, until);
    sim_sleep_until(until);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventQuery(CUevent ev)
{
    REQUIRE_INIT();
    if (!ev || ev->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    return atomic_load(&ev->t) <= sim_now() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

static CUresult cuEventElapsedTime_v2_impl(float *ms, CUevent start, CUevent end)
{
    REQUIRE_INIT();
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    if (!start || !end || start->magic != EVENT_MAGIC || end->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t t0 = atomic_load(&start->t), t1 = atomic_load(&end->t), now = sim_now();
    if (!t0 || !t1)
        return CUDA_ERROR_INVALID_HANDLE; /* not recorded */
    if (t0 > now || t1 > now)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)t1 - (double)t0) / 1e6);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end) { return cuEventElapsedTime_v2_impl(ms, start, end); }

SIM_API CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) { return cuEventElapsedTime_v2_impl(ms, start, end); }

static CUresult cuEventDestroy_v2_impl(CUevent ev)
{
    REQUIRE_INIT();
    if (!ev || ev->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    ev->magic = DEAD_MAGIC;
    free(ev);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventDestroy_v2(CUevent ev) { return cuEventDestroy_v2_impl(ev); }

SIM_API CUresult cuEventDestroy(CUevent ev) { return cuEventDestroy_v2_impl(ev); }

/* ---- modules and functions: any image loads, any name is a kernel ------------------------ */

static CUresult module_new(CUmodule *pmod, const void *image)
{
    REQUIRE_INIT();
    if (!pmod || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MODULE_MAGIC;
    pthread_mutex_init(&m->lock, NULL);
    *pmod = m;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleLoadData(CUmodule *pmod, const void *image) { return module_new(pmod, image); }

SIM_API CUresult cuModuleLoadDataEx(CUmodule *pmod, const void *image, unsigned int n, CUjit_option *opts, void **vals)
{
    (void)n;
    (void)opts;
    (void)vals;
    return module_new(pmod, image);
}

SIM_API CUresult cuModuleLoad(CUmodule *pmod, const char *fname)
{
    if (fname && access(fname, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return module_new(pmod, fname);
}

SIM_API CUresult cuModuleGetFunction(CUfunction *pf, CUmodule mod, const char *name)
{
    REQUIRE_INIT();
    if (!pf || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!mod || mod->magic != MODULE_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mod->lock);
    struct CUfunc_st *f;
    for (f = mod->functions; f; f = f->next)
        if (strncmp(f->name, name, sizeof f->name - 1) == 0)
            break;
    if (!f && (f = calloc(1, sizeof *f))) {
        f->magic = FUNC_MAGIC;
        f->collective_args = strncmp(name, COLLECTIVE_MAX_PREFIX, strlen(COLLECTIVE_MAX_PREFIX)) == 0 ? COLLECTIVE_MAX_ARGS
                             : strncmp(name, COLLECTIVE_PREFIX, strlen(COLLECTIVE_PREFIX)) == 0 ? COLLECTIVE_ARGS
                                                                                                : 0;
        snprintf(f->name, sizeof f->name, "%s", name);
        f->next = mod->functions;
        mod->functions = f;
    }
    pthread_mutex_unlock(&mod->lock);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pf = f;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleUnload(CUmodule mod)
{
    REQUIRE_INIT();
    if (!mod || mod->magic != MODULE_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    mod->magic = DEAD_MAGIC;
    for (struct CUfunc_st *f = mod->functions, *next; f; f = next) {
        next = f->next;
        f->magic = DEAD_MAGIC;
        free(f);
    }
    pthread_mutex_destroy(&mod->lock);
    free(mod);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attrib, CUfunction f)
{
    REQUIRE_INIT();
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    if (!f || f->magic != FUNC_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    *value = attrib == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
    return CUDA_SUCCESS;
}

/* ---- graphs: kernel nodes run in the order they were added ------------------------------- */

SIM_API CUresult cuGraphCreate(CUgraph *pg, unsigned int flags)
{
    REQUIRE_INIT();
    if (!pg || flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = GRAPH_MAGIC;
    *pg = g;
    return CUDA_SUCCESS;
}

static CUresult graph_add_kernel(CUgraphNode *pnode, CUgraph g, CUfunction f, void **params, void **extra)
{
    REQUIRE_INIT();
    if (!pnode)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g || g->magic != GRAPH_MAGIC || !f || f->magic != FUNC_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t ns;
    CUresult err = kernel_ns(params, extra, &ns); /* arguments are copied when the node is made */
    if (err)
        return err;
    struct CUgraphNode_st *n = calloc(1, sizeof *n);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    n->magic = NODE_MAGIC;
    n->ns = ns;
    if (g->tail)
        g->tail->next = n;
    else
        g->head = n;
    g->tail = n;
    g->n++;
    *pnode = n;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *pnode, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                         const CUDA_KERNEL_NODE_PARAMS *p)
{
    (void)deps;
    (void)ndeps;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    return graph_add_kernel(pnode, g, p->func, p->kernelParams, p->extra);
}

SIM_API CUresult cuGraphAddKernelNode(CUgraphNode *pnode, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                      const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    (void)deps;
    (void)ndeps;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    return graph_add_kernel(pnode, g, p->func, p->kernelParams, p->extra);
}

static CUresult cuGraphInstantiateWithFlags_impl(CUgraphExec *pexec, CUgraph g, unsigned long long flags)
{
    (void)flags;
    REQUIRE_INIT();
    if (!pexec)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g || g->magic != GRAPH_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    struct CUgraphExec_st *x = malloc(sizeof *x + g->n * sizeof(uint64_t));
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    x->magic = EXEC_MAGIC;
    x->n = 0;
    for (struct CUgraphNode_st *n = g->head; n; n = n->next)
        x->ns[x->n++] = n->ns;
    *pexec = x;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *pexec, CUgraph g, unsigned long long flags) { return cuGraphInstantiateWithFlags_impl(pexec, g, flags); }

static CUresult cuGraphInstantiate_v2_impl(CUgraphExec *pexec, CUgraph g, CUgraphNode *err_node, char *log, size_t len)
{
    if (err_node)
        *err_node = NULL;
    if (log && len)
        log[0] = 0;
    return cuGraphInstantiateWithFlags_impl(pexec, g, 0);
}

SIM_API CUresult cuGraphInstantiate_v2(CUgraphExec *pexec, CUgraph g, CUgraphNode *err_node, char *log, size_t len) { return cuGraphInstantiate_v2_impl(pexec, g, err_node, log, len); }

SIM_API CUresult cuGraphInstantiate(CUgraphExec *pexec, CUgraph g, CUgraphNode *err_node, char *log, size_t len)
{
    return cuGraphInstantiate_v2_impl(pexec, g, err_node, log, len);
}

static CUresult graph_launch(CUgraphExec x, CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    if (!x || x->magic != EXEC_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    if (!s)
        return err;
    for (size_t i = 0; i < x->n; i++)
        enqueue_kernel(s, x->ns[i]);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphLaunch(CUgraphExec x, CUstream h) { return graph_launch(x, h, false); }
SIM_API CUresult cuGraphLaunch_ptsz(CUgraphExec x, CUstream h) { return graph_launch(x, h, true); }

SIM_API CUresult cuGraphExecDestroy(CUgraphExec x)
{
    REQUIRE_INIT();
    if (!x || x->magic != EXEC_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    x->magic = DEAD_MAGIC;
    free(x);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphDestroy(CUgraph g)
{
    REQUIRE_INIT();
    if (!g || g->magic != GRAPH_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    for (struct CUgraphNode_st *n = g->head, *next; n; n = next) {
        next = n->next;
        free(n);
    }
    g->magic = DEAD_MAGIC;
    free(g);
    return CUDA_SUCCESS;
}

/* ---- device addresses and the allocation records of this process ------------------------- */

/* Device pointers are addresses inside one PROT_NONE reservation of this process: unique, and
 * never host memory. Taken from the top like a stack; a free of the topmost range gives it back, so
 * alloc/free loops do not wear the reservation out. */
#define VA_SIZE (1ull << 42) /* 4 TiB of address space, no memory */
static uintptr_t g_va_base, g_va_end;
static _Atomic uintptr_t g_va_top;
static pthread_once_t g_va_once = PTHREAD_ONCE_INIT;

static void va_reserve(void)
{
    for (uint64_t size = VA_SIZE; size >= (1ull << 36); size >>= 1) {
        void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            g_va_base = (uintptr_t)p;
            g_va_end = g_va_base + size;
            atomic_store(&g_va_top, g_va_base);
            return;
        }
    }
}

static uintptr_t va_alloc(uint64_t size, uint64_t align)
{
    pthread_once(&g_va_once, va_reserve);
    if (!g_va_base)
        return 0;
    uintptr_t top = atomic_load(&g_va_top), start;
    do {
        start = (top + align - 1) & ~(uintptr_t)(align - 1);
        if (start + size < start || start + size > g_va_end)
            return 0;
    } while (!atomic_compare_exchange_weak(&g_va_top, &top, start + size));
    return start;
}

static void va_free(uintptr_t start, uint64_t size)
{
    uintptr_t top = start + size;
    atomic_compare_exchange_strong(&g_va_top, &top, start);
}

enum rec_kind { REC_ALLOC, REC_RESERVE, REC_MAP };

struct rec {
    struct rec *next;
    uintptr_t ptr;
    uint64_t size;
    enum rec_kind kind;
    bool managed;              /* REC_ALLOC from cuMemAllocManaged: counted as managed memory */
    int phys;                  /* REC_ALLOC */
    struct sim_handle *handle; /* REC_MAP */
};

#define REC_BUCKETS 4096
static struct rec *g_recs[REC_BUCKETS];
/* Process-local: nothing another process does can hold it. Allocation is not on the launch path. */
static pthread_mutex_t g_recs_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_recs_fork_once = PTHREAD_ONCE_INIT;

static inline unsigned rec_bucket(uintptr_t p) { return (unsigned)((p >> 9) * 0x9e3779b1u) % REC_BUCKETS; }

/* A forked child is another process: the parent's allocations are not its own to free (and their
 * memory stays counted to the parent). */
static void recs_lock_before_fork(void) { pthread_mutex_lock(&g_recs_lock); }
static void recs_unlock_after_fork(void) { pthread_mutex_unlock(&g_recs_lock); }
static void recs_reset_in_child(void)
{
    memset(g_recs, 0, sizeof g_recs);
    pthread_mutex_init(&g_recs_lock, NULL);
}
static void recs_install_fork(void)
{
    pthread_atfork(recs_lock_before_fork, recs_unlock_after_fork, recs_reset_in_child);
}

static bool rec_add(uintptr_t ptr, uint64_t size, enum rec_kind kind, int phys, struct sim_handle *h, bool managed)
{
    pthread_once(&g_recs_fork_once, recs_install_fork);
    struct rec *r = malloc(sizeof *r);
    if (!r)
        return false;
    *r = (struct rec){.ptr = ptr, .size = size, .kind = kind, .managed = managed, .phys = phys, .handle = h};
    pthread_mutex_lock(&g_recs_lock);
    unsigned b = rec_bucket(ptr);
    r->next = g_recs[b];
    g_recs[b] = r;
    pthread_mutex_unlock(&g_recs_lock);
    return true;
}

/* Unlinks and returns the record of `kind` starting at ptr; NULL when there is none. */
static struct rec *rec_take(uintptr_t ptr, enum rec_kind kind)
{
    pthread_once(&g_recs_fork_once, recs_install_fork);
    pthread_mutex_lock(&g_recs_lock);
    struct rec **pp = &g_recs[rec_bucket(ptr)], *r;
    for (; (r = *pp); pp = &r->next)
        if (r->ptr == ptr && r->kind == kind) {
            *pp = r->next;
            break;
        }
    pthread_mutex_unlock(&g_recs_lock);
    return r;
}

/* The allocation or mapping that contains p (a slow scan: for the rare pointer queries only). */
static bool rec_find_containing(uintptr_t p, struct rec *out)
{
    bool found = false;
    pthread_once(&g_recs_fork_once, recs_install_fork);
    pthread_mutex_lock(&g_recs_lock);
    for (unsigned b = 0; b < REC_BUCKETS && !found; b++)
        for (struct rec *r = g_recs[b]; r; r = r->next)
            if (r->kind != REC_RESERVE && p >= r->ptr && p - r->ptr < r->size) {
                *out = *r;
                found = true;
                break;
            }
    pthread_mutex_unlock(&g_recs_lock);
    return found;
}

/* Every allocation API ends here: reserve capacity on the shared device, then an address. */
static CUresult alloc_on(int phys, CUdeviceptr *dptr, uint64_t size, uint64_t align)
{
    if (!dptr || !size)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_mem_reserve(phys, size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t p = va_alloc(size, align);
    if (!p || !rec_add(p, size, REC_ALLOC, phys, NULL, false)) {
        if (p)
            va_free(p, size);
        sim_mem_release(phys, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

/* Managed memory: from the host's capacity, remembered as managed so that its free gives it back there. */
static CUresult alloc_managed_on(int phys, CUdeviceptr *dptr, uint64_t size)
{
    if (!dptr || !size)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_managed_reserve(phys, size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t p = va_alloc(size, ALLOC_ALIGN);
    if (!p || !rec_add(p, size, REC_ALLOC, phys, NULL, true)) {
        if (p)
            va_free(p, size);
        sim_managed_release(phys, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

static CUresult free_alloc(CUdeviceptr dptr)
{
    REQUIRE_INIT();
    struct rec *r = rec_take((uintptr_t)dptr, REC_ALLOC);
    if (!r) /* never ours, or freed already: nothing to give back, so nothing can go below zero */
        return CUDA_ERROR_INVALID_VALUE;
    if (r->managed)
        sim_managed_release(r->phys, r->size);
    else
        sim_mem_release(r->phys, r->size);
    va_free(r->ptr, r->size);
    free(r);
    return CUDA_SUCCESS;
}

static inline CUresult current_phys(int *phys)
{
    struct CUctx_st *c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *phys = c->phys;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    REQUIRE_INIT();
    int phys;
    CUresult err = current_phys(&phys);
    return err ? err : alloc_on(phys, dptr, size, ALLOC_ALIGN);
}

SIM_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    REQUIRE_INIT();
    if (!pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    int phys;
    CUresult err = current_phys(&phys);
    if (err)
        return err;
    size_t p = (width + ALLOC_ALIGN - 1) & ~(size_t)(ALLOC_ALIGN - 1);
    err = alloc_on(phys, dptr, (uint64_t)p * height, ALLOC_ALIGN);
    if (!err)
        *pitch = p;
    return err;
}

/* Managed memory is counted on the current device as managed, taken from the host's memory: the real
 * driver lets it exceed the device's and pages it (NVML's used memory does not include it here). */
SIM_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags)
{
    REQUIRE_INIT();
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    int phys;
    CUresult err = current_phys(&phys);
    return err ? err : alloc_managed_on(phys, dptr, size);
}

SIM_API CUresult cuMemFree_v2(CUdeviceptr dptr) { return free_alloc(dptr); }

SIM_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    REQUIRE_INIT();
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    int phys;
    CUresult err = current_phys(&phys);
    if (err)
        return err;
    sim_reap_dead(); /* so that memory of killed processes shows as free, as on a real GPU */
    struct sim_device *d = &g_sim->dev[phys];
    uint64_t used = atomic_load(&d->used);
    *total = d->total;
    *free_bytes = used < d->total ? d->total - used : 0;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    REQUIRE_INIT();
    struct rec r;
    if (!rec_find_containing((uintptr_t)dptr, &r))
        return CUDA_ERROR_NOT_FOUND;
    if (base)
        *base = r.ptr;
    if (size)
        *size = r.size;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr)
{
    REQUIRE_INIT();
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    struct rec r;
    if (!rec_find_containing((uintptr_t)ptr, &r))
        return CUDA_ERROR_INVALID_VALUE;
    int phys = r.kind == REC_MAP ? r.handle->phys : r.phys, ordinal = -1;
    for (int i = 0; i < g_n_visible; i++)
        if (g_visible[i] == phys)
            ordinal = i;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = ordinal; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = r.ptr; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = r.size; break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(unsigned int *)data = r.managed; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(unsigned int *)data = 1; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* ---- managed memory hints: cuMemAdvise, cuMemPrefetchAsync --------------------------------- */

/* As the real driver checks them: the range lies within one managed allocation of this process, the
 * location is a visible device (or the host). Nothing moves (there are no pages to move); each call is
 * appended to $SIMGPU_HINT_LOG, when set, as one JSON line, so that tests can see what the gate
 * advised and prefetched, where to, and on which stream. */
static struct line_log g_hint_log = {.env = "SIMGPU_HINT_LOG"};
#define hint_log(...) log_line(&g_hint_log, __VA_ARGS__)

static CUresult managed_range(CUdeviceptr ptr, size_t count)
{
    struct rec r;
    if (!count || !rec_find_containing((uintptr_t)ptr, &r) || r.kind != REC_ALLOC || !r.managed ||
        count > r.size - ((uintptr_t)ptr - r.ptr))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* The physical device a location names, -1 for the host; *err when it names neither. */
static int location_phys(CUmemLocation location, CUresult *err)
{
    if (location.type == CU_MEM_LOCATION_TYPE_HOST)
        return -1;
    if (location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        *err = CUDA_ERROR_INVALID_VALUE;
    else if (!valid_ordinal(location.id))
        *err = CUDA_ERROR_INVALID_DEVICE;
    else
        return g_visible[location.id];
    return -1;
}

static const char *location_name(CUmemLocation location)
{
    return location.type == CU_MEM_LOCATION_TYPE_HOST ? "host" : "device";
}

SIM_API CUresult cuMemAdvise_v2(CUdeviceptr ptr, size_t count, CUmem_advise advice, CUmemLocation location)
{
    REQUIRE_INIT();
    CUresult err = managed_range(ptr, count);
    if (!err && (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY))
        err = CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    /* Read-mostly advice ignores the location, as the driver does. */
    if (!err && advice != CU_MEM_ADVISE_SET_READ_MOSTLY && advice != CU_MEM_ADVISE_UNSET_READ_MOSTLY)
        phys = location_phys(location, &err);
    hint_log("{\"pid\":%d,\"call\":\"cuMemAdvise\",\"ptr\":%llu,\"size\":%zu,\"advice\":%d,\"location\":\"%s\","
             "\"device\":%d,\"phys\":%d,\"result\":%d}",
             (int)getpid(), (unsigned long long)ptr, count, (int)advice, location_name(location), location.id, phys,
             (int)err);
    return err;
}

static const char *stream_name(CUstream h)
{
    return !h || h == CU_STREAM_LEGACY ? "legacy" : h == CU_STREAM_PER_THREAD ? "per-thread" : "created";
}

SIM_API CUresult cuMemPrefetchAsync_v2(CUdeviceptr ptr, size_t count, CUmemLocation location, unsigned int flags,
                                       CUstream h)
{
    REQUIRE_INIT();
    CUresult err = managed_range(ptr, count);
    if (!err && flags)
        err = CUDA_ERROR_INVALID_VALUE;
    int phys = err ? -1 : location_phys(location, &err);
    if (!err)
        resolve_stream(h, false, &err);
    hint_log("{\"pid\":%d,\"call\":\"cuMemPrefetchAsync\",\"ptr\":%llu,\"size\":%zu,\"location\":\"%s\","
             "\"device\":%d,\"phys\":%d,\"stream\":\"%s\",\"result\":%d}",
             (int)getpid(), (unsigned long long)ptr, count, location_name(location), location.id, phys,
             stream_name(h), (int)err);
    return err;
}

/* ---- stream-ordered allocation ----------------------------------------------------------- */

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(h, per_thread, &err);
    return s ? alloc_on(s->ctx->phys, dptr, size, ALLOC_ALIGN) : err;
}

SIM_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream h) { return alloc_async(dptr, size, h, false); }
SIM_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream h) { return alloc_async(dptr, size, h, true); }

static CUresult alloc_from_pool(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    if (!pool || pool->magic != POOL_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult err = CUDA_SUCCESS;
    if (!resolve_stream(h, per_thread, &err))
        return err;
    return alloc_on(pool->phys, dptr, size, ALLOC_ALIGN);
}

SIM_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h)
{
    return alloc_from_pool(dptr, size, pool, h, false);
}

SIM_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h)
{
    return alloc_from_pool(dptr, size, pool, h, true);
}

static CUresult free_async(CUdeviceptr dptr, CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    if (!resolve_stream(h, per_thread, &err))
        return err;
    return free_alloc(dptr);
}

SIM_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream h) { return free_async(dptr, h, false); }
SIM_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream h) { return free_async(dptr, h, true); }

SIM_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    REQUIRE_INIT();
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(props->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = POOL_MAGIC;
    p->phys = g_visible[props->location.id];
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REQUIRE_INIT();
    if (!pool || pool->magic != POOL_MAGIC || (pool >= g_default_pool && pool < g_default_pool + SIM_MAX_DEVICES))
        return CUDA_ERROR_INVALID_VALUE;
    pool->magic = DEAD_MAGIC;
    free(pool);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *pool = &g_default_pool[dev];
    return CUDA_SUCCESS;
}

/* ---- virtual memory management (cuMemCreate and friends) --------------------------------- */

/* The device comes from the allocation's own properties, never from the current context: NCCL and
 * PyTorch call these from threads without one (HAMi-core #169:
 * https://github.com/Project-HAMi/HAMi-core/issues/169). */
SIM_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags)
{
    REQUIRE_INIT();
    if (!handle || !prop || flags || !size || size % GRANULARITY || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    int phys = g_visible[prop->location.id];
    struct sim_handle *h = calloc(1, sizeof *h);
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (sim_mem_reserve(phys, size) != 0) {
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->magic = HANDLE_MAGIC;
    h->phys = phys;
    h->size = size;
    atomic_store(&h->refs, 1);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

/* The memory goes back when the handle is released and every mapping of it is unmapped. */
static void handle_unref(struct sim_handle *h)
{
    if (atomic_fetch_sub(&h->refs, 1) == 1) {
        sim_mem_release(h->phys, h->size);
        h->magic = DEAD_MAGIC;
        free(h);
    }
}

static struct sim_handle *handle_of(CUmemGenericAllocationHandle handle)
{
    struct sim_handle *h = (struct sim_handle *)(uintptr_t)handle;
    return h && h->magic == HANDLE_MAGIC ? h : NULL;
}

SIM_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REQUIRE_INIT();
    struct sim_handle *h = handle_of(handle);
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    handle_unref(h);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags)
{
    (void)addr; /* a hint only */
    (void)flags;
    REQUIRE_INIT();
    if (!ptr || !size || size % GRANULARITY || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t p = va_alloc(size, alignment > GRANULARITY ? alignment : GRANULARITY);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!rec_add(p, size, REC_RESERVE, -1, NULL, false)) {
        va_free(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    struct rec *r = rec_take((uintptr_t)ptr, REC_RESERVE);
    if (!r)
        return CUDA_ERROR_INVALID_VALUE;
    if (r->size != size) {
        rec_add(r->ptr, r->size, REC_RESERVE, -1, NULL, false);
        free(r);
        return CUDA_ERROR_INVALID_VALUE;
    }
    va_free(r->ptr, r->size);
    free(r);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags)
{
    REQUIRE_INIT();
    struct sim_handle *h = handle_of(handle);
    if (!h || !ptr || !size || flags || offset + size > h->size || size % GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add(&h->refs, 1);
    if (!rec_add((uintptr_t)ptr, size, REC_MAP, h->phys, h, false)) {
        handle_unref(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    struct rec *r = rec_take((uintptr_t)ptr, REC_MAP);
    if (!r)
        return CUDA_ERROR_INVALID_VALUE;
    (void)size;
    handle_unref(r->handle);
    free(r);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    REQUIRE_INIT();
    if (!ptr || !size || !desc || !count)
        return CUDA_ERROR_INVALID_VALUE;
    struct rec r;
    if (!rec_find_containing((uintptr_t)ptr, &r) || r.kind != REC_MAP)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    (void)option;
    REQUIRE_INIT();
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = GRANULARITY;
    return CUDA_SUCCESS;
}

/* ---- copies: free of cost, but the synchronous ones wait for the stream's work ----------- */

static CUresult copy_sync(bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    struct CUstream_st *s = resolve_stream(NULL, per_thread, &err);
    if (!s)
        return err;
    uint64_t until = stream_end(s);
    sync_log("cuStreamSynchronize", s->ctx, until);
    sim_sleep_until(until);
    return CUDA_SUCCESS;
}

static CUresult copy_async(CUstream h, bool per_thread)
{
    REQUIRE_INIT();
    CUresult err = CUDA_SUCCESS;
    return resolve_stream(h, per_thread, &err) ? CUDA_SUCCESS : err;
}

SIM_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(false); }
SIM_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(true); }
SIM_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(false); }
SIM_API CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(true); }
SIM_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(false); }
SIM_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return copy_sync(true); }
SIM_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) { (void)dst; (void)v; (void)n; return copy_sync(false); }
SIM_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char v, size_t n) { (void)dst; (void)v; (void)n; return copy_sync(true); }
SIM_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) { (void)dst; (void)src; (void)n; return copy_async(h, false); }
SIM_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream h) { (void)dst; (void)src; (void)n; return copy_async(h, true); }
SIM_API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) { (void)dst; (void)src; (void)n; return copy_async(h, false); }
SIM_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream h) { (void)dst; (void)src; (void)n; return copy_async(h, true); }

/* ---- cuGetProcAddress --------------------------------------------------------------------- */

struct sym {
    const char *base;
    int since;
    void *fn;
    void *per_thread;
};

#define SYM(base, since, fn, pt) {#base, since, (void *)fn, (void *)pt},
static const struct sym g_syms[] = {
#include "symbols.h"
    SIM_SYMBOLS(SYM)
};
#undef SYM

/* As the real driver: `symbol` is a base name ("cuMemAlloc"); the answer is the newest form of it
 * that `version` knows, in its per-thread-stream form when asked for. */
static CUresult get_proc(const char *symbol, void **pfn, int version, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn || (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                                                  CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        return CUDA_ERROR_INVALID_VALUE;
    const struct sym *best = NULL;
    bool known = false;
    for (size_t i = 0; i < sizeof g_syms / sizeof g_syms[0]; i++) {
        if (strcmp(g_syms[i].base, symbol) != 0)
            continue;
        known = true;
        if (g_syms[i].since <= version && (!best || g_syms[i].since > best->since))
            best = &g_syms[i];
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && version >= 7000;
    *pfn = per_thread && best->per_thread ? best->per_thread : best->fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                     CUdriverProcAddressQueryResult *status)
{
    return get_proc(symbol, pfn, version, flags, status);
}

SIM_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return get_proc(symbol, pfn, version, flags, NULL);
}
