/*
 * gemtrace_cuda.bpf.c - uprobes on libcuda: device memory per process (each allocation matched to
 * its release by (tgid, pointer or handle)), the device of each process (from context creation and
 * switches), and, in the opt-in "launches" mode, kernel launch counts.
 *
 * Loaded by gemtrace/sources/ebpf/probes.py with bcc; user space attaches each program to the entry
 * points named beside it there. Never blocks or alters the traced call: a full map loses a record
 * (and the figures say less), it never fails a CUDA call. Only calls that returned CUDA_SUCCESS count,
 * and a release of a pointer never seen (made before the agent, or twice) subtracts nothing, so no
 * figure can go below zero (HAMi #1181).
 */
#include <uapi/linux/ptrace.h>
#include <linux/sched.h>
#include "gemtrace_cuda.h"

#ifndef GT_MAX_ALLOCS
#define GT_MAX_ALLOCS 262144
#endif
#ifndef GT_MAX_PROCS
#define GT_MAX_PROCS 16384
#endif

BPF_HASH(allocs, struct gt_alloc_key, struct gt_alloc, GT_MAX_ALLOCS);
BPF_HASH(usage, struct gt_proc_dev, struct gt_usage, GT_MAX_PROCS);
BPF_HASH(launches, u32, u64, GT_MAX_PROCS);
/* In-flight calls and thread state: LRU, so threads that die inside a call cannot fill them. */
BPF_TABLE("lru_hash", u64, struct gt_call, calls, 16384);
BPF_TABLE("lru_hash", u64, u32, thread_dev, 65536);           /* pid_tgid -> current device */
BPF_TABLE("lru_hash", struct gt_alloc_key, u32, ctx_dev, 65536); /* (tgid, CUcontext) -> device */
BPF_TABLE("lru_hash", u32, u32, proc_dev, GT_MAX_PROCS);      /* tgid -> device last made current */
BPF_RINGBUF_OUTPUT(events, 64);                                 /* pages */
BPF_ARRAY(alloc_event_at, u64, 1);  /* when the last allocation event was written (GT_ALLOC_EVENT_GAP_NS) */

static __always_inline u32 current_dev(u64 id)
{
    u32 *dev = thread_dev.lookup(&id);
    if (dev)
        return *dev;
    u32 tgid = id >> 32;
    dev = proc_dev.lookup(&tgid);
    return dev ? *dev : 0;
}

static __always_inline void set_dev(u64 id, u32 dev)
{
    u32 tgid = id >> 32;
    if (dev >= GT_BPF_MAX_DEVICES)
        return;
    thread_dev.update(&id, &dev);
    proc_dev.update(&tgid, &dev);
}

/* ---- contexts: which device a thread's allocations land on -------------------------------- */

static __always_inline int ctx_enter(u64 pctx, u32 dev)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call call = {.out = pctx, .dev = dev};
    calls.update(&id, &call);
    return 0;
}

int ctx_create_v2_enter(struct pt_regs *ctx) { return ctx_enter(PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM3(ctx)); }
int ctx_create_v3_enter(struct pt_regs *ctx) { return ctx_enter(PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM5(ctx)); }
int ctx_create_v4_enter(struct pt_regs *ctx) { return ctx_enter(PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM4(ctx)); }
int primary_ctx_retain_enter(struct pt_regs *ctx) { return ctx_enter(PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM2(ctx)); }

/* The call this thread's return probe ends, taken out of `calls`; false when there is none (the
 * probes attached mid-call) or the driver returned an error (nothing was made or freed). */
static __always_inline bool finished_call(struct pt_regs *ctx, u64 id, struct gt_call *out)
{
    struct gt_call *call = calls.lookup(&id);
    if (!call)
        return false;
    *out = *call;
    calls.delete(&id);
    return PT_REGS_RC(ctx) == 0;
}

/* cuCtxCreate makes the new context current in the calling thread; a retained primary context is
 * usually made current next by cuCtxSetCurrent, but the runtime allocates right after either way. */
int ctx_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call c;
    if (!finished_call(ctx, id, &c))
        return 0;
    u64 handle = 0;
    if (bpf_probe_read_user(&handle, sizeof(handle), (void *)c.out) == 0 && handle) {
        struct gt_alloc_key key = {.tgid = id >> 32, .kind = 0, .addr = handle};
        ctx_dev.update(&key, &c.dev);
    }
    set_dev(id, c.dev);
    return 0;
}

/* cuCtxSetCurrent(ctx) / cuCtxPushCurrent(ctx): the thread now allocates on ctx's device. */
int ctx_set_current_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_alloc_key key = {.tgid = id >> 32, .kind = 0, .addr = PT_REGS_PARM1(ctx)};
    u32 *dev = ctx_dev.lookup(&key);
    if (dev)
        set_dev(id, *dev);
    return 0;
}

/* ---- allocations -------------------------------------------------------------------------- */

static __always_inline int alloc_enter(u64 out, u64 size, u32 kind, u32 dev)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call call = {.out = out, .size = size, .kind = kind, .dev = dev};
    calls.update(&id, &call);
    return 0;
}

/* cuMemAlloc_v2(dptr*, size), cuMemAllocAsync(dptr*, size, stream), cuMemAllocFromPoolAsync(dptr*,
 * size, pool, stream) */
int alloc_pointer_enter(struct pt_regs *ctx)
{
    return alloc_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), GT_KIND_POINTER,
                       current_dev(bpf_get_current_pid_tgid()));
}

/* cuMemAllocManaged(dptr*, size, flags): counted apart, as managed memory. The driver pages it between
 * host and GPU, so it is not device memory that MemoryLimit bounds (an Oversubscribe group's gate
 * serves allocations past the limit with it: docs/gate.md); freed by cuMemFree_v2 like the others. */
int alloc_managed_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call call = {.out = PT_REGS_PARM1(ctx), .size = PT_REGS_PARM2(ctx), .kind = GT_KIND_POINTER,
                           .dev = current_dev(id), .managed = 1};
    calls.update(&id, &call);
    return 0;
}

/* cuMemAllocPitch_v2(dptr*, pitch*, width, height, element size): pitch x height bytes */
int alloc_pitch_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call call = {.out = PT_REGS_PARM1(ctx), .out2 = PT_REGS_PARM2(ctx), .size = PT_REGS_PARM4(ctx),
                           .kind = GT_KIND_POINTER, .dev = current_dev(id), .pitch = 1};
    calls.update(&id, &call);
    return 0;
}

/* cuMemCreate(handle*, size, prop*, flags): the device is in the call's own properties
 * (prop->location.id at offset 12), not the current context (HAMi-core #169). */
int alloc_create_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 dev = current_dev(id);
    int location[2] = {};
    if (bpf_probe_read_user(location, sizeof(location), (void *)(PT_REGS_PARM3(ctx) + 8)) == 0 &&
        location[0] == 1 /* CU_MEM_LOCATION_TYPE_DEVICE */ && location[1] >= 0 &&
        location[1] < GT_BPF_MAX_DEVICES)
        dev = (u32)location[1];
    return alloc_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), GT_KIND_HANDLE, dev);
}

int alloc_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call c;
    if (!finished_call(ctx, id, &c))
        return 0;
    u64 addr = 0;
    if (bpf_probe_read_user(&addr, sizeof(addr), (void *)c.out) != 0 || !addr)
        return 0;
    u64 size = c.size;
    if (c.pitch) {
        u64 pitch = 0;
        if (bpf_probe_read_user(&pitch, sizeof(pitch), (void *)c.out2) != 0)
            return 0;
        size = pitch * c.size;
    }
    u32 tgid = id >> 32;
    struct gt_alloc_key key = {.tgid = tgid, .kind = c.kind, .addr = addr};
    struct gt_alloc rec = {.size = size, .dev = c.dev, .managed = c.managed};
    if (allocs.lookup(&key))
        return 0; /* already known (a reused address seen without its free): count it once */
    if (allocs.insert(&key, &rec) != 0)
        return 0; /* the table is full: better to miss one than to count what can never be freed */
    proc_dev.insert(&tgid, &c.dev); /* a process seen first by its allocation is reaped at exit too */
    struct gt_proc_dev pd = {.tgid = tgid, .dev = c.dev};
    struct gt_usage zero = {};
    struct gt_usage *u = usage.lookup_or_try_init(&pd, &zero);
    if (!u)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (c.managed) { /* no event: the enforcer bounds device memory */
        __sync_fetch_and_add(&u->managed, size);
        __sync_fetch_and_add(&u->allocs, 1);
        u->last_alloc_ns = now;
        return 0;
    }
    u64 before = __sync_fetch_and_add(&u->bytes, size);
    __sync_fetch_and_add(&u->allocs, 1);
    u->last_alloc_ns = now;
    u32 first = 0;
    u64 *written = alloc_event_at.lookup(&first);
    if (!written || now - *written < GT_ALLOC_EVENT_GAP_NS)
        return 0; /* counted above; the watcher looks again GT_ALLOC_EVENT_GAP_NS after the last event */
    *written = now; /* (two CPUs may both write one: a spare event, never a lost one) */
    struct gt_event *ev = events.ringbuf_reserve(sizeof(struct gt_event));
    if (ev) {
        ev->type = GT_EVENT_ALLOC;
        ev->tgid = tgid;
        ev->dev = c.dev;
        ev->pad = 0;
        ev->size = size;
        ev->bytes = before + size;
        ev->ts_ns = now;
        events.ringbuf_submit(ev, 0);
    }
    return 0;
}

/* ---- releases ----------------------------------------------------------------------------- */

static __always_inline int release_enter(u64 addr, u32 kind)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call call = {.addr = addr, .kind = kind};
    calls.update(&id, &call);
    return 0;
}

/* cuMemFree_v2(dptr), cuMemFreeAsync(dptr, stream) */
int free_pointer_enter(struct pt_regs *ctx) { return release_enter(PT_REGS_PARM1(ctx), GT_KIND_POINTER); }
/* cuMemRelease(handle) */
int free_handle_enter(struct pt_regs *ctx) { return release_enter(PT_REGS_PARM1(ctx), GT_KIND_HANDLE); }

int free_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gt_call c;
    if (!finished_call(ctx, id, &c))
        return 0;
    struct gt_alloc_key key = {.tgid = id >> 32, .kind = c.kind, .addr = c.addr};
    struct gt_alloc *rec = allocs.lookup(&key);
    if (!rec)
        return 0; /* never seen: made before the probes, or a double free */
    struct gt_alloc r = *rec;
    if (allocs.delete(&key) != 0)
        return 0; /* a racing release of the same address took it */
    struct gt_proc_dev pd = {.tgid = key.tgid, .dev = r.dev};
    struct gt_usage *u = usage.lookup(&pd);
    if (u && r.managed)
        __sync_fetch_and_add(&u->managed, -r.size);
    else if (u)
        __sync_fetch_and_add(&u->bytes, -r.size);
    return 0;
}

/* ---- launches (opt-in: a uprobe on every launch costs about a microsecond) --------------- */

int launch_enter(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 one = 1;
    u64 *n = launches.lookup(&tgid);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        launches.update(&tgid, &one);
    return 0;
}

/* ---- process exit: its memory is released at once; user space reaps the allocation records - */

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    thread_dev.delete(&id);
    calls.delete(&id);
    if ((u32)id != tgid)
        return 0; /* a thread, not the process */
    if (!proc_dev.lookup(&tgid))
        return 0; /* never used a device: nothing to reap */
    proc_dev.delete(&tgid);
#pragma unroll
    for (u32 dev = 0; dev < GT_BPF_MAX_DEVICES; dev++) {
        struct gt_proc_dev pd = {.tgid = tgid, .dev = dev};
        struct gt_usage *u = usage.lookup(&pd);
        if (u) {
            u->bytes = 0;
            u->managed = 0;
        }
    }
    struct gt_event *ev = events.ringbuf_reserve(sizeof(struct gt_event));
    if (ev) {
        __builtin_memset(ev, 0, sizeof(*ev));
        ev->type = GT_EVENT_EXIT;
        ev->tgid = tgid;
        ev->ts_ns = bpf_ktime_get_ns();
        events.ringbuf_submit(ev, 0);
    }
    return 0;
}
