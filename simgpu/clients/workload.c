/*
 * workload.c - what the test clients do, one JSON object per line on stdout (flushed), so that
 * Python tests can follow them. Subcommands:
 *   launch-loop --kernel-ns N [--launches-per-iter K] [--seconds S | --iters I] [--device D]
 *               [--api launch|ex|coop|extra|graph] [--stream] [--threads T] [--no-sync] [--progress]
 *               [--sync stream|ctx|event|memcpy] [--current-device C] [--pause-ns P] [--cpu-ns N]
 *       K launches then a synchronisation (cuStreamSynchronize, cuCtxSynchronize, an event's, or a
 *       4-byte cuMemcpyDtoH from a 4 KiB buffer allocated for it, as PyTorch's .item() does),
 *       repeated, on the default stream (or, with --stream, on a
 *       stream of its own), in T threads at once; the last line is {"iters","launches","elapsed_s",
 *       "kernel_s","launch_s","event_s","burst_s","threads"} (sums over threads; launch_s is the time
 *       spent before the final synchronisation and event_s what events around the loop measured, the
 *       longest of any thread; burst_s the sum of each iteration's time from before its first launch
 *       to its synchronisation's return, the most that a gate's busy_ns can count, however long the
 *       host kept the loop off its CPU). --progress prints {"progress","t","iters","launches"} each second.
 *       --current-device C (with --stream): once the stream exists, device C's primary context is made
 *       current, as PyTorch leaves device 0's current while it launches on a stream of cuda:1.
 *       --pause-ns P: sleep P ns after each iteration (short bursts, as a service answering requests);
 *       the last line then also has "iter_p50_s","iter_p99_s","iter_max_s": each iteration's time from
 *       its first launch to its synchronisation's return (thread 0's iterations).
 *       --cpu-ns N: busy-spin N ns (wall clock) before each launch (before each graph launch with --api
 *       graph), as Python and the runtime spend CPU per kernel (docs/scheduler.md, "What a share
 *       means"): with kernels shorter than that the loop is launch-bound, the GPU idle between its
 *       kernels inside a burst, as in batch-1 inference.
 *       SIZE...: first cuMemAlloc_v2 each SIZE, one line each as alloc prints them (kept until exit,
 *       but for the first N, which --free-first N frees with cuMemFree_v2 before the loop: {"freed":N}).
 *   alloc --api v2|pitch|managed|async|pool|create [--device D] [--hold S] [--free [--hold-after S]] SIZE...
 *       one {"size","result","name"} line per allocation (with "managed": 0 or 1 when it succeeded, the
 *       driver's CU_POINTER_ATTRIBUTE_IS_MANAGED, and "ptr", the address), then {"holding":S,"pid"} before holding, then
 *       {"freed":n} with --free, then holds S more seconds with --hold-after.
 *   meminfo [--device D]                              {"free","total"}
 *   alloc-threads --threads T --size S --count C [--hold S]  {"successes","failures","oom"}, then holds
 *   fork-alloc [--hold S] SIZE                        a line from the parent and one from the child
 *   empty-launch-loop --launches N                    {"launches","elapsed_s","ns_per_launch"}
 *   launch-per-line [--kernel-ns N] [--device D]      {"ready","pid"} once set up; then for each line read
 *       on stdin one launch on the default stream, {"returned_ns"} (CLOCK_MONOTONIC when the launch
 *       returned: a held one, when the gate let it go), then a synchronisation; exits at end of input
 *   ddp-loop --rank R --world W --comm ID [--device D] --kernel-ns N [--launches-per-iter K]
 *            --collective-ns C [--seconds S | --iters I] [--progress] [--pause-ns P]
 *       one rank of a data-parallel training job, one process per rank as torchrun starts them: a
 *       collective of C ns first (DDP's constructor broadcasts the model), then each step launches K
 *       kernels of N ns, one collective of C ns (the driver's "simgpu_collective" kernel:
 *       simgpu/README.md) in communicator ID as rank R of W, and synchronises the stream.
 *       --pause-ns P: every rank sleeps P ns after each step, as a service spread over GPUs waits for
 *       its next request; the last line then also gives each step's time (launches to synchronisation)
 *       as "p50_ms", "p99_ms" and "max_ms".
 *       --seconds S: until S s of the device's clock have passed since the first step's collective
 *       ended on some rank (each step's collective also takes the largest of the ranks' "past S"
 *       flags), so that all ranks run the same number of steps; --iters I: I steps.
 *       {"ready","pid","rank","t_ns"} once set up (t_ns: CLOCK_MONOTONIC), {"first_step","t_ns"} when
 *       the first step's synchronisation returned, {"progress","t","steps"} each second with
 *       --progress, and last {"steps","elapsed_s","event_s","gpu_s","rank"}: event_s is what events
 *       around the broadcast and the loop measured on the device's clock, gpu_s their own kernel time
 *       (steps * (K*N + C) + C); their difference is the time the collectives spun waiting for peers.
 *       A collective that fails (a peer gone: SIMGPU_COLLECTIVE_TIMEOUT) prints {"error":"collective",
 *       "step" (-1: the broadcast),"result","name"} and exits 1.
 *   devices                                           {"count","devices":[{"ordinal","uuid","name","total"}]}
 *   error-codes        results of calls made too early: before cuInit, without a context
 *   free-checks        results of freeing an unknown pointer, twice the same one, and 0
 * A failing driver call prints {"error":<call>,"result":<CUresult>,"name":...} and exits 1.
 * Sizes read as SIMGPU_MEMORY does ("1GiB", "512M", bytes).
 */
#define _DEFAULT_SOURCE
#include "workload.h"
#include "simgpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const struct drv *D;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *err_name(CUresult r)
{
    const char *name = NULL;
    if (D->f_cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
        return "?";
    return name;
}

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

#define CHECK(call)                                                                          \
    do {                                                                                     \
        CUresult r_ = (call);                                                                \
        if (r_ != CUDA_SUCCESS) {                                                            \
            emit("{\"error\":\"%s\",\"result\":%d,\"name\":\"%s\"}", #call, (int)r_, err_name(r_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

struct opts {
    uint64_t kernel_ns, pause_ns, cpu_ns, collective_ns, comm;
    long rank, world;
    long per_iter, iters, threads, count, launches, free_first;
    double seconds, hold, hold_after;
    int device, current_device; /* current_device: -1 unless --current-device */
    const char *api, *sync;
    bool no_sync, progress, free_after, stream;
    uint64_t size;
    int n_sizes;
    uint64_t sizes[256];
};

static uint64_t size_arg(const char *text)
{
    uint64_t v = sim_parse_size(text);
    if (!v) {
        emit("{\"error\":\"usage\",\"message\":\"not a size: %s\"}", text);
        exit(2);
    }
    return v;
}

static void parse(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.per_iter = 1, .threads = 1, .count = 1, .current_device = -1, .rank = -1};
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (strcmp(a, name) == 0 && v && (i++, 1))
        if (strcmp(a, "--ptsz") == 0) /* taken by rt.c when it resolves the entry points */
            continue;
        else if (strcmp(a, "--no-sync") == 0)
            o->no_sync = true;
        else if (strcmp(a, "--progress") == 0)
            o->progress = true;
        else if (strcmp(a, "--free") == 0)
            o->free_after = true;
        else if (strcmp(a, "--stream") == 0)
            o->stream = true;
        else if (OPT("--kernel-ns"))
            o->kernel_ns = strtoull(v, NULL, 10);
        else if (OPT("--collective-ns"))
            o->collective_ns = strtoull(v, NULL, 10);
        else if (OPT("--comm"))
            o->comm = strtoull(v, NULL, 10);
        else if (OPT("--rank"))
            o->rank = strtol(v, NULL, 10);
        else if (OPT("--world"))
            o->world = strtol(v, NULL, 10);
        else if (OPT("--pause-ns"))
            o->pause_ns = strtoull(v, NULL, 10);
        else if (OPT("--cpu-ns"))
            o->cpu_ns = strtoull(v, NULL, 10);
        else if (OPT("--launches-per-iter"))
            o->per_iter = strtol(v, NULL, 10);
        else if (OPT("--iters"))
            o->iters = strtol(v, NULL, 10);
        else if (OPT("--seconds"))
            o->seconds = strtod(v, NULL);
        else if (OPT("--hold"))
            o->hold = strtod(v, NULL);
        else if (OPT("--hold-after"))
            o->hold_after = strtod(v, NULL);
        else if (OPT("--device"))
            o->device = (int)strtol(v, NULL, 10);
        else if (OPT("--current-device"))
            o->current_device = (int)strtol(v, NULL, 10);
        else if (OPT("--api"))
            o->api = v;
        else if (OPT("--sync"))
            o->sync = v;
        else if (OPT("--threads"))
            o->threads = strtol(v, NULL, 10);
        else if (OPT("--count"))
            o->count = strtol(v, NULL, 10);
        else if (OPT("--free-first"))
            o->free_first = strtol(v, NULL, 10);
        else if (OPT("--launches"))
            o->launches = strtol(v, NULL, 10);
        else if (OPT("--size"))
            o->size = size_arg(v);
        else if (a[0] != '-' && o->n_sizes < 256)
            o->sizes[o->n_sizes++] = size_arg(a);
        else {
            emit("{\"error\":\"usage\",\"message\":\"unknown argument %s\"}", a);
            exit(2);
        }
#undef OPT
    }
}

static CUfunction setup(int device)
{
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CHECK(D->f_cuInit(0));
    CHECK(D->f_cuDeviceGet(&dev, device));
    CHECK(D->f_cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(D->f_cuCtxSetCurrent(ctx));
    static const char image[] = "simgpu: any image loads";
    CHECK(D->f_cuModuleLoadData(&mod, image));
    CHECK(D->f_cuModuleGetFunction(&f, mod, "spin"));
    return f;
}

/* ---- launches ----------------------------------------------------------------------------- */

/* One launch of a kernel of *ns nanoseconds on stream h through `api`. */
static CUresult launch_one(const char *api, CUfunction f, CUstream h, uint64_t *ns)
{
    void *params[] = {ns};
    if (strcmp(api, "ex") == 0) {
        CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32, .blockDimY = 1,
                              .blockDimZ = 1, .hStream = h};
        return D->f_cuLaunchKernelEx(&cfg, f, params, NULL);
    }
    if (strcmp(api, "coop") == 0)
        return D->f_cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, h, params);
    if (strcmp(api, "extra") == 0) { /* arguments packed in one buffer, as some code generators do */
        size_t size = sizeof *ns;
        void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, ns, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
        return D->f_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, h, NULL, extra);
    }
    return D->f_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, h, params, NULL);
}

/* The host's CPU work before a launch (--cpu-ns): spun, not slept, since a thread that sleeps 30 us
 * wakes late and gives its CPU away; wall clock, so that a loop preempted on a busy host does not
 * spin longer than asked once it runs again. */
static void spin_ns(uint64_t ns)
{
    if (!ns)
        return;
    double until = now_s() + (double)ns / 1e9;
    while (now_s() < until)
        ;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Times of a loop's iterations (--pause-ns: launches to synchronisation), for their quantiles. */
struct latencies {
    double *s;
    long n, cap;
};

static void latencies_add(struct latencies *l, double seconds)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 1024;
        l->s = realloc(l->s, (size_t)l->cap * sizeof *l->s);
        if (!l->s) {
            emit("{\"error\":\"realloc\"}");
            exit(1);
        }
    }
    l->s[l->n++] = seconds;
}

/* The q-quantile (0..1) of the times added, sorting them in place; 0 when there are none. */
static double latencies_at(struct latencies *l, double q)
{
    if (l->n == 0)
        return 0;
    qsort(l->s, (size_t)l->n, sizeof *l->s, cmp_double);
    long i = (long)(q * (double)l->n);
    return l->s[i < l->n ? i : l->n - 1];
}

struct loop {
    const struct opts *o;
    const char *api;
    CUcontext ctx;
    CUfunction f;
    int index;
    long iters, launches;
    double launch_s, event_s, burst_s;
    struct latencies iter_s; /* --pause-ns: each iteration's time, launches to synchronisation */
};

static _Atomic long g_launches_total;

static void *run_loop(void *arg)
{
    struct loop *l = arg;
    const struct opts *o = l->o;
    uint64_t ns = o->kernel_ns;
    bool graph = strcmp(l->api, "graph") == 0;
    CHECK(D->f_cuCtxSetCurrent(l->ctx)); /* as the runtime does on every thread */
    CUstream stream = NULL;
    if (o->stream)
        CHECK(D->f_cuStreamCreate(&stream, CU_STREAM_DEFAULT));
    CUgraph g = NULL;
    CUgraphExec exec = NULL;
    if (graph) {
        CHECK(D->f_cuGraphCreate(&g, 0));
        for (long k = 0; k < o->per_iter; k++) {
            void *params[] = {&ns};
            CUDA_KERNEL_NODE_PARAMS p = {.func = l->f, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                         .blockDimX = 32, .blockDimY = 1, .blockDimZ = 1, .kernelParams = params};
            CUgraphNode node;
            CHECK(D->f_cuGraphAddKernelNode(&node, g, NULL, 0, &p));
        }
        CHECK(D->f_cuGraphInstantiateWithFlags(&exec, g, 0));
    }
    CUevent ev_start, ev_end, ev_iter;
    CHECK(D->f_cuEventCreate(&ev_start, CU_EVENT_DEFAULT));
    CHECK(D->f_cuEventCreate(&ev_end, CU_EVENT_DEFAULT));
    CHECK(D->f_cuEventCreate(&ev_iter, CU_EVENT_DISABLE_TIMING));
    const char *sync = o->sync ? o->sync : "stream";
    CUdeviceptr buffer = 0;
    if (strcmp(sync, "memcpy") == 0)
        CHECK(D->f_cuMemAlloc(&buffer, 4096));
    CHECK(D->f_cuEventRecord(ev_start, stream));
    /* After the events: they belong to the stream's context. */
    if (o->stream && o->current_device >= 0) {
        CUdevice other;
        CUcontext other_ctx;
        CHECK(D->f_cuDeviceGet(&other, o->current_device));
        CHECK(D->f_cuDevicePrimaryCtxRetain(&other_ctx, other));
        CHECK(D->f_cuCtxSetCurrent(other_ctx));
    }
    long iters_wanted = o->iters > 0 ? o->iters : (o->seconds > 0 ? -1 : 1);
    double start = now_s(), next_progress = start + 1.0, t = start;
    while (iters_wanted < 0 ? t - start < o->seconds : l->iters < iters_wanted) {
        double iter_start = now_s();
        if (graph) {
            spin_ns(o->cpu_ns);
            CHECK(D->f_cuGraphLaunch(exec, stream));
        } else {
            for (long k = 0; k < o->per_iter; k++) {
                spin_ns(o->cpu_ns);
                CHECK(launch_one(l->api, l->f, stream, &ns));
            }
        }
        l->launches += o->per_iter;
        atomic_fetch_add(&g_launches_total, o->per_iter);
        if (o->no_sync) {
        } else if (strcmp(sync, "ctx") == 0) {
            CHECK(D->f_cuCtxSynchronize(NULL));
        } else if (strcmp(sync, "event") == 0) {
            CHECK(D->f_cuEventRecord(ev_iter, stream));
            CHECK(D->f_cuEventSynchronize(ev_iter));
        } else if (strcmp(sync, "memcpy") == 0) {
            uint32_t value;
            CHECK(D->f_cuMemcpyDtoH(&value, buffer, sizeof value));
        } else {
            CHECK(D->f_cuStreamSynchronize(stream));
        }
        l->iters++;
        t = now_s();
        l->burst_s += t - iter_start;
        if (o->pause_ns) {
            latencies_add(&l->iter_s, t - iter_start);
            struct timespec pause = {(time_t)(o->pause_ns / 1000000000u), (long)(o->pause_ns % 1000000000u)};
            nanosleep(&pause, NULL);
            t = now_s();
        }
        if (o->progress && l->index == 0 && t >= next_progress) {
            emit("{\"progress\":true,\"t\":%.6f,\"iters\":%ld,\"launches\":%ld}", t - start, l->iters,
                 atomic_load(&g_launches_total));
            next_progress += 1.0;
        }
    }
    l->launch_s = now_s() - start;
    CHECK(D->f_cuEventRecord(ev_end, stream));
    CHECK(D->f_cuEventSynchronize(ev_end));
    float event_ms = 0;
    CHECK(D->f_cuEventElapsedTime(&event_ms, ev_start, ev_end));
    l->event_s = (double)event_ms / 1e3;
    CHECK(D->f_cuEventDestroy(ev_start));
    CHECK(D->f_cuEventDestroy(ev_end));
    CHECK(D->f_cuEventDestroy(ev_iter));
    if (buffer)
        CHECK(D->f_cuMemFree(buffer));
    if (graph) {
        CHECK(D->f_cuGraphExecDestroy(exec));
        CHECK(D->f_cuGraphDestroy(g));
    }
    if (stream)
        CHECK(D->f_cuStreamDestroy(stream));
    return NULL;
}

static void hold(double seconds);
static void report_allocation(uint64_t size, CUdeviceptr ptr);
static void report_failure(uint64_t size, CUresult r);


static int launch_loop(const struct opts *o)
{
    CUfunction f = setup(o->device);
    const char *api = o->api ? o->api : "launch";
    if (strcmp(api, "graph") && strcmp(api, "launch") && strcmp(api, "ex") && strcmp(api, "coop") &&
        strcmp(api, "extra")) {
        emit("{\"error\":\"usage\",\"message\":\"--api is launch, ex, coop, extra or graph\"}");
        return 2;
    }
    if (o->threads < 1 || o->threads > 1024) {
        emit("{\"error\":\"usage\",\"message\":\"--threads is 1..1024\"}");
        return 2;
    }
    if (o->sync && strcmp(o->sync, "stream") && strcmp(o->sync, "ctx") && strcmp(o->sync, "event") &&
        strcmp(o->sync, "memcpy")) {
        emit("{\"error\":\"usage\",\"message\":\"--sync is stream, ctx, event or memcpy\"}");
        return 2;
    }
    CUdeviceptr ptrs[256];
    int n_ptrs = 0;
    for (int i = 0; i < o->n_sizes; i++) { /* kept until exit: what the loop's kernels would use */
        CUresult r = D->f_cuMemAlloc(&ptrs[n_ptrs], o->sizes[i]);
        if (r == CUDA_SUCCESS)
            report_allocation(o->sizes[i], ptrs[n_ptrs++]);
        else
            report_failure(o->sizes[i], r);
    }
    if (o->free_first > 0) {
        int n = o->free_first < n_ptrs ? (int)o->free_first : n_ptrs;
        for (int i = 0; i < n; i++)
            CHECK(D->f_cuMemFree(ptrs[i]));
        emit("{\"freed\":%d}", n);
    }
    CUcontext ctx;
    CHECK(D->f_cuCtxGetCurrent(&ctx));
    struct loop *loops = calloc((size_t)o->threads, sizeof *loops);
    pthread_t *tids = calloc((size_t)o->threads, sizeof *tids);
    double start = now_s();
    for (long i = 0; i < o->threads; i++) {
        loops[i] = (struct loop){.o = o, .api = api, .ctx = ctx, .f = f, .index = (int)i};
        if (o->threads == 1)
            run_loop(&loops[i]);
        else
            pthread_create(&tids[i], NULL, run_loop, &loops[i]);
    }
    long iters = 0, launches = 0;
    double launch_s = 0, event_s = 0, burst_s = 0;
    for (long i = 0; i < o->threads; i++) {
        if (o->threads > 1)
            pthread_join(tids[i], NULL);
        iters += loops[i].iters;
        launches += loops[i].launches;
        launch_s = loops[i].launch_s > launch_s ? loops[i].launch_s : launch_s;
        event_s = loops[i].event_s > event_s ? loops[i].event_s : event_s;
        burst_s += loops[i].burst_s;
    }
    CHECK(D->f_cuCtxSynchronize(NULL));
    double elapsed = now_s() - start;
    char latency[160] = "";
    struct latencies *iter_s = &loops[0].iter_s;
    if (iter_s->n > 0)
        snprintf(latency, sizeof latency, ",\"iter_p50_s\":%.6f,\"iter_p99_s\":%.6f,\"iter_max_s\":%.6f",
                 latencies_at(iter_s, 0.5), latencies_at(iter_s, 0.99), latencies_at(iter_s, 1.0));
    emit("{\"iters\":%ld,\"launches\":%ld,\"elapsed_s\":%.6f,\"kernel_s\":%.6f,\"launch_s\":%.6f,"
         "\"event_s\":%.6f,\"burst_s\":%.6f,\"threads\":%ld%s}",
         iters, launches, elapsed, (double)launches * (double)o->kernel_ns / 1e9, launch_s, event_s, burst_s, o->threads,
         latency);
    for (long i = 0; i < o->threads; i++)
        free(loops[i].iter_s.s);
    hold(o->hold); /* --hold: stay alive (and registered) after the report */
    return 0;
}

static int empty_launch_loop(const struct opts *o)
{
    CUfunction f = setup(o->device);
    uint64_t ns = 0;
    void *params[] = {&ns};
    long n = o->launches > 0 ? o->launches : 1000000;
    for (long i = 0; i < n / 10 + 1; i++) /* warm up: first-touch of the stream's queue */
        CHECK(D->f_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL));
    CHECK(D->f_cuStreamSynchronize(NULL));
    double start = now_s();
    for (long i = 0; i < n; i++)
        CHECK(D->f_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL));
    double elapsed = now_s() - start;
    CHECK(D->f_cuStreamSynchronize(NULL));
    emit("{\"launches\":%ld,\"elapsed_s\":%.6f,\"ns_per_launch\":%.2f}", n, elapsed, elapsed * 1e9 / (double)n);
    return 0;
}

/* ---- a data-parallel job's rank ---------------------------------------------------------- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int ddp_loop(const struct opts *o)
{
    if (o->rank < 0 || o->world < 1 || o->rank >= o->world || !o->comm) {
        emit("{\"error\":\"usage\",\"message\":\"ddp-loop needs --rank R --world W (R below W) and --comm ID (not 0)\"}");
        return 2;
    }
    CUfunction f = setup(o->device), all_reduce;
    CUmodule mod;
    static const char image[] = "simgpu: any image loads";
    CHECK(D->f_cuModuleLoadData(&mod, image));
    /* Its fifth parameter: where this rank's stop flag goes in and every rank's largest comes back. */
    CHECK(D->f_cuModuleGetFunction(&all_reduce, mod, "simgpu_collective_max_all_reduce"));
    uint64_t ns = o->kernel_ns, stop = 0;
    uint64_t args[5] = {o->collective_ns, o->comm, (uint64_t)o->world, (uint64_t)o->rank, (uintptr_t)&stop};
    void *params[] = {&ns}, *collective[] = {&args[0], &args[1], &args[2], &args[3], &args[4]};
    CUevent ev_start, ev_end, ev_first, ev_step;
    CHECK(D->f_cuEventCreate(&ev_start, CU_EVENT_DEFAULT));
    CHECK(D->f_cuEventCreate(&ev_end, CU_EVENT_DEFAULT));
    CHECK(D->f_cuEventCreate(&ev_first, CU_EVENT_DEFAULT));
    CHECK(D->f_cuEventCreate(&ev_step, CU_EVENT_DEFAULT));
    emit("{\"ready\":true,\"pid\":%d,\"rank\":%ld,\"t_ns\":%llu}", (int)getpid(), o->rank,
         (unsigned long long)now_ns());
    long steps_wanted = o->iters > 0 ? o->iters : (o->seconds > 0 ? -1 : 1), steps = 0;
    CHECK(D->f_cuEventRecord(ev_start, NULL));
    /* DDP's constructor broadcasts the model from rank 0 before the first step: a collective first. */
    CUresult r = D->f_cuLaunchKernel(all_reduce, 1, 1, 1, 32, 1, 1, 0, NULL, collective, NULL);
    if (r != CUDA_SUCCESS) {
        emit("{\"error\":\"collective\",\"step\":-1,\"result\":%d,\"name\":\"%s\"}", (int)r, err_name(r));
        exit(1);
    }
    double start = now_s(), next_progress = start + 1.0, t = start;
    float since_first_ms = 0;
    struct latencies step_s = {0};
    /* --seconds: each rank reads its own device's clock, from the first step's collective's end; its
     * k-th collective ends later on a device it gave up meanwhile (collective.c), so the ranks may read
     * different times. Each step's collective takes the largest of their flags, "past S", and all
     * ranks stop after the same step, as a training job's ranks agree on a time budget. */
    while (steps_wanted < 0 ? !stop : steps < steps_wanted) {
        stop = steps_wanted < 0 && since_first_ms >= o->seconds * 1e3;
        double step_start = now_s();
        for (long k = 0; k < o->per_iter; k++)
            CHECK(D->f_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL));
        r = D->f_cuLaunchKernel(all_reduce, 1, 1, 1, 32, 1, 1, 0, NULL, collective, NULL);
        if (r != CUDA_SUCCESS) {
            emit("{\"error\":\"collective\",\"step\":%ld,\"result\":%d,\"name\":\"%s\"}", steps, (int)r,
                 err_name(r));
            exit(1);
        }
        CHECK(D->f_cuEventRecord(steps ? ev_step : ev_first, NULL));
        CHECK(D->f_cuStreamSynchronize(NULL));
        if (++steps == 1)
            emit("{\"first_step\":true,\"t_ns\":%llu}", (unsigned long long)now_ns());
        else
            CHECK(D->f_cuEventElapsedTime(&since_first_ms, ev_first, ev_step));
        t = now_s();
        if (o->pause_ns) {
            latencies_add(&step_s, t - step_start);
            struct timespec pause = {(time_t)(o->pause_ns / 1000000000u), (long)(o->pause_ns % 1000000000u)};
            nanosleep(&pause, NULL);
        }
        if (o->progress && t >= next_progress) {
            emit("{\"progress\":true,\"t\":%.6f,\"steps\":%ld}", t - start, steps);
            next_progress += 1.0;
        }
    }
    CHECK(D->f_cuEventRecord(ev_end, NULL));
    CHECK(D->f_cuEventSynchronize(ev_end));
    float event_ms = 0;
    CHECK(D->f_cuEventElapsedTime(&event_ms, ev_start, ev_end));
    double gpu_s = ((double)steps * ((double)o->per_iter * (double)o->kernel_ns + (double)o->collective_ns) +
                    (double)o->collective_ns) / 1e9;
    if (o->pause_ns)
        emit("{\"steps\":%ld,\"elapsed_s\":%.6f,\"event_s\":%.6f,\"gpu_s\":%.6f,\"rank\":%ld,\"p50_ms\":%.3f,"
             "\"p99_ms\":%.3f,\"max_ms\":%.3f}", steps, now_s() - start, (double)event_ms / 1e3, gpu_s, o->rank,
             1e3 * latencies_at(&step_s, 0.5), 1e3 * latencies_at(&step_s, 0.99), 1e3 * latencies_at(&step_s, 1.0));
    else
        emit("{\"steps\":%ld,\"elapsed_s\":%.6f,\"event_s\":%.6f,\"gpu_s\":%.6f,\"rank\":%ld}", steps,
             now_s() - start, (double)event_ms / 1e3, gpu_s, o->rank);
    free(step_s.s);
    return 0;
}

/* ---- memory ------------------------------------------------------------------------------- */

enum alloc_api { API_V2, API_PITCH, API_MANAGED, API_ASYNC, API_POOL, API_CREATE, API_BAD };

static enum alloc_api api_of(const char *name)
{
    static const char *names[] = {"v2", "pitch", "managed", "async", "pool", "create"};
    for (int i = 0; i < API_BAD; i++)
        if (strcmp(name, names[i]) == 0)
            return (enum alloc_api)i;
    return API_BAD;
}

struct allocation {
    enum alloc_api api;
    uint64_t size;
    CUdeviceptr ptr;
    CUmemGenericAllocationHandle handle;
};

/* One allocation of `size` bytes through `api`; on success `a` says how to free it. */
static CUresult allocate(enum alloc_api api, int device, uint64_t size, struct allocation *a)
{
    *a = (struct allocation){.api = api, .size = size};
    switch (api) {
    case API_V2: return D->f_cuMemAlloc(&a->ptr, size);
    case API_PITCH: {
        size_t pitch;
        return D->f_cuMemAllocPitch(&a->ptr, &pitch, size / 1024 ? 1024 : size, size / 1024 ? size / 1024 : 1, 4);
    }
    case API_MANAGED: return D->f_cuMemAllocManaged(&a->ptr, size, CU_MEM_ATTACH_GLOBAL);
    case API_ASYNC: return D->f_cuMemAllocAsync(&a->ptr, size, NULL);
    case API_POOL: {
        CUmemoryPool pool;
        CUresult r = D->f_cuDeviceGetDefaultMemPool(&pool, device);
        return r ? r : D->f_cuMemAllocFromPoolAsync(&a->ptr, size, pool, NULL);
    }
    case API_CREATE: {
        /* As PyTorch's expandable segments: create, reserve, map, set access. */
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device}};
        size_t gran;
        CUresult r = D->f_cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r)
            return r;
        if (size % gran)
            return CUDA_ERROR_INVALID_VALUE;
        if ((r = D->f_cuMemCreate(&a->handle, size, &prop, 0)))
            return r;
        if ((r = D->f_cuMemAddressReserve(&a->ptr, size, 0, 0, 0)) == CUDA_SUCCESS &&
            (r = D->f_cuMemMap(a->ptr, size, 0, a->handle, 0)) == CUDA_SUCCESS) {
            CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
            r = D->f_cuMemSetAccess(a->ptr, size, &access, 1);
        }
        if (r)
            D->f_cuMemRelease(a->handle);
        return r;
    }
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static void release(const struct allocation *a)
{
    switch (a->api) {
    case API_ASYNC:
    case API_POOL: CHECK(D->f_cuMemFreeAsync(a->ptr, NULL)); break;
    case API_CREATE:
        CHECK(D->f_cuMemUnmap(a->ptr, a->size));
        CHECK(D->f_cuMemAddressFree(a->ptr, a->size));
        CHECK(D->f_cuMemRelease(a->handle));
        break;
    default: CHECK(D->f_cuMemFree(a->ptr));
    }
}

static void hold(double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts = {.tv_sec = (time_t)seconds, .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static void report_allocation(uint64_t size, CUdeviceptr ptr)
{
    unsigned int managed = 0;
    CHECK(D->f_cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr));
    emit("{\"size\":%llu,\"result\":0,\"name\":\"CUDA_SUCCESS\",\"managed\":%u,\"ptr\":%llu}",
         (unsigned long long)size, managed, (unsigned long long)ptr);
}

static void report_failure(uint64_t size, CUresult r)
{
    emit("{\"size\":%llu,\"result\":%d,\"name\":\"%s\"}", (unsigned long long)size, (int)r, err_name(r));
}

static int alloc_cmd(const struct opts *o)
{
    enum alloc_api api = api_of(o->api ? o->api : "v2");
    if (api == API_BAD) {
        emit("{\"error\":\"usage\",\"message\":\"--api is v2, pitch, managed, async, pool or create\"}");
        return 2;
    }
    setup(o->device);
    struct allocation held[256];
    int n_held = 0;
    for (int i = 0; i < o->n_sizes; i++) {
        CUresult r = allocate(api, o->device, o->sizes[i], &held[n_held]);
        if (r != CUDA_SUCCESS) {
            report_failure(o->sizes[i], r);
            continue;
        }
        report_allocation(o->sizes[i], held[n_held].ptr);
        n_held++;
    }
    emit("{\"holding\":%.3f,\"pid\":%d,\"allocations\":%d}", o->hold, (int)getpid(), n_held);
    hold(o->hold);
    if (o->free_after) {
        for (int i = 0; i < n_held; i++)
            release(&held[i]);
        emit("{\"freed\":%d}", n_held);
        hold(o->hold_after);
    }
    return 0;
}

static int meminfo_cmd(const struct opts *o)
{
    setup(o->device);
    size_t free_bytes, total;
    CHECK(D->f_cuMemGetInfo(&free_bytes, &total));
    emit("{\"free\":%zu,\"total\":%zu}", free_bytes, total);
    return 0;
}

struct thread_arg {
    const struct opts *o;
    CUcontext ctx;
    long ok, failed, oom;
};

static void *alloc_thread(void *p)
{
    struct thread_arg *t = p;
    CHECK(D->f_cuCtxSetCurrent(t->ctx)); /* as the runtime does on each thread */
    for (long i = 0; i < t->o->count; i++) {
        CUdeviceptr ptr;
        CUresult r = D->f_cuMemAlloc(&ptr, t->o->size);
        if (r == CUDA_SUCCESS)
            t->ok++;
        else {
            t->failed++;
            t->oom += r == CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return NULL;
}

static int alloc_threads_cmd(const struct opts *o)
{
    if (o->threads < 1 || o->threads > 1024 || !o->size) {
        emit("{\"error\":\"usage\",\"message\":\"--threads 1..1024 and --size are needed\"}");
        return 2;
    }
    setup(o->device);
    CUcontext ctx;
    CUdevice dev;
    CHECK(D->f_cuDeviceGet(&dev, o->device));
    CHECK(D->f_cuDevicePrimaryCtxRetain(&ctx, dev));
    struct thread_arg *args = calloc((size_t)o->threads, sizeof *args);
    pthread_t *tids = calloc((size_t)o->threads, sizeof *tids);
    for (long i = 0; i < o->threads; i++) {
        args[i] = (struct thread_arg){.o = o, .ctx = ctx};
        pthread_create(&tids[i], NULL, alloc_thread, &args[i]);
    }
    long ok = 0, failed = 0, oom = 0;
    for (long i = 0; i < o->threads; i++) {
        pthread_join(tids[i], NULL);
        ok += args[i].ok;
        failed += args[i].failed;
        oom += args[i].oom;
    }
    size_t free_bytes, total;
    CHECK(D->f_cuMemGetInfo(&free_bytes, &total));
    emit("{\"successes\":%ld,\"failures\":%ld,\"oom\":%ld,\"free\":%zu,\"total\":%zu}", ok, failed, oom, free_bytes,
         total);
    hold(o->hold); /* keeps the memory, so concurrent processes see it */
    return 0;
}

static int fork_alloc_cmd(const struct opts *o)
{
    if (o->n_sizes != 1) {
        emit("{\"error\":\"usage\",\"message\":\"fork-alloc SIZE\"}");
        return 2;
    }
    setup(o->device);
    CUdeviceptr p;
    CUresult r = D->f_cuMemAlloc(&p, o->sizes[0]);
    emit("{\"who\":\"parent\",\"pid\":%d,\"result\":%d,\"name\":\"%s\"}", (int)getpid(), (int)r, err_name(r));
    pid_t child = fork();
    if (child == 0) {
        r = D->f_cuMemAlloc(&p, o->sizes[0]);
        emit("{\"who\":\"child\",\"pid\":%d,\"result\":%d,\"name\":\"%s\"}", (int)getpid(), (int)r, err_name(r));
        hold(o->hold);
        _exit(0);
    }
    hold(o->hold);
    int status = 0;
    waitpid(child, &status, 0);
    emit("{\"who\":\"parent\",\"child_exit\":%d}", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return 0;
}

static int launch_per_line_cmd(const struct opts *o)
{
    CUfunction f = setup(o->device);
    uint64_t ns = o->kernel_ns;
    char line[64];
    emit("{\"ready\":true,\"pid\":%d}", (int)getpid());
    while (fgets(line, sizeof line, stdin)) {
        CHECK(launch_one("launch", f, NULL, &ns));
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        emit("{\"returned_ns\":%llu}", (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec);
        CHECK(D->f_cuStreamSynchronize(NULL));
    }
    return 0;
}

static int devices_cmd(void)
{
    int n;
    CHECK(D->f_cuInit(0));
    CHECK(D->f_cuDeviceGetCount(&n));
    printf("{\"count\":%d,\"devices\":[", n);
    for (int i = 0; i < n; i++) {
        CUdevice dev;
        CUuuid u;
        char name[256];
        size_t total;
        CHECK(D->f_cuDeviceGet(&dev, i));
        CHECK(D->f_cuDeviceGetUuid(&u, dev));
        CHECK(D->f_cuDeviceGetName(name, sizeof name, dev));
        CHECK(D->f_cuDeviceTotalMem(&total, dev));
        const unsigned char *b = (const unsigned char *)u.bytes;
        printf("%s{\"ordinal\":%d,\"uuid\":\"GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
               "%02x%02x%02x%02x%02x%02x\",\"name\":\"%s\",\"total\":%zu}",
               i ? "," : "", i, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
               b[13], b[14], b[15], name, total);
    }
    emit("]}");
    return 0;
}

static int error_codes_cmd(void)
{
    CUdeviceptr p;
    CUresult before_init = D->f_cuMemAlloc(&p, 1 << 20);
    CUresult init = D->f_cuInit(0);
    if (init != CUDA_SUCCESS) {
        emit("{\"before_init\":%d,\"init\":%d}", (int)before_init, (int)init);
        return 0;
    }
    CUcontext none = NULL;
    CHECK(D->f_cuCtxGetCurrent(&none));
    CUresult no_ctx_alloc = D->f_cuMemAlloc(&p, 1 << 20);
    size_t f, t;
    CUresult no_ctx_meminfo = D->f_cuMemGetInfo(&f, &t);
    CUresult no_ctx_sync = D->f_cuStreamSynchronize(NULL);
    CUdevice bad;
    CUresult bad_device = D->f_cuDeviceGet(&bad, 99);
    emit("{\"before_init\":%d,\"init\":%d,\"current_is_null\":%s,\"no_ctx_alloc\":%d,"
         "\"no_ctx_meminfo\":%d,\"no_ctx_sync\":%d,\"bad_device\":%d}",
         (int)before_init, (int)init, none ? "false" : "true", (int)no_ctx_alloc, (int)no_ctx_meminfo,
         (int)no_ctx_sync, (int)bad_device);
    return 0;
}

static int free_checks_cmd(const struct opts *o)
{
    setup(o->device);
    CUdeviceptr p;
    CUresult unknown = D->f_cuMemFree((CUdeviceptr)0x1234000);
    CHECK(D->f_cuMemAlloc(&p, 1 << 20));
    CUresult first = D->f_cuMemFree(p);
    CUresult second = D->f_cuMemFree(p);
    CUresult zero = D->f_cuMemFree(0);
    size_t free_bytes, total;
    CHECK(D->f_cuMemGetInfo(&free_bytes, &total));
    emit("{\"unknown\":%d,\"first\":%d,\"second\":%d,\"zero\":%d,\"free\":%zu,\"total\":%zu}", (int)unknown,
         (int)first, (int)second, (int)zero, free_bytes, total);
    return 0;
}

int workload_main(int argc, char **argv, const struct drv *d, const char *how)
{
    D = d;
    int first = 1;
    while (first < argc && strcmp(argv[first], "--ptsz") == 0)
        first++;
    if (first >= argc) {
        fprintf(stderr, "usage: %s [--ptsz] launch-loop|alloc|meminfo|alloc-threads|fork-alloc|"
                        "empty-launch-loop|launch-per-line|ddp-loop|devices|error-codes|free-checks ... (simgpu-%s; see simgpu/clients/workload.c)\n", argv[0], how);
        return 2;
    }
    struct opts o;
    parse(argc - first + 1, argv + first - 1, &o);
    const char *cmd = argv[first];
    if (strcmp(cmd, "launch-loop") == 0)
        return launch_loop(&o);
    if (strcmp(cmd, "empty-launch-loop") == 0)
        return empty_launch_loop(&o);
    if (strcmp(cmd, "alloc") == 0)
        return alloc_cmd(&o);
    if (strcmp(cmd, "meminfo") == 0)
        return meminfo_cmd(&o);
    if (strcmp(cmd, "alloc-threads") == 0)
        return alloc_threads_cmd(&o);
    if (strcmp(cmd, "fork-alloc") == 0)
        return fork_alloc_cmd(&o);
    if (strcmp(cmd, "launch-per-line") == 0)
        return launch_per_line_cmd(&o);
    if (strcmp(cmd, "ddp-loop") == 0)
        return ddp_loop(&o);
    if (strcmp(cmd, "devices") == 0)
        return devices_cmd();
    if (strcmp(cmd, "error-codes") == 0)
        return error_codes_cmd();
    if (strcmp(cmd, "free-checks") == 0)
        return free_checks_cmd(&o);
    emit("{\"error\":\"usage\",\"message\":\"unknown subcommand %s\"}", cmd);
    return 2;
}
