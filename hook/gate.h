/*
 * gate.h - what the gate's files share: the process's view of the region, the real entry points.
 *
 * Nothing here may block on another process: the region is mapped read-only and read with atomics;
 * the gate writes only its own slot, in its user's chunk of the slot table (hook/gemtrace_region.h says who owns what).
 */
#ifndef GEMTRACE_GATE_H
#define GEMTRACE_GATE_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_driver_api.h" /* the versioned names (cuMemAlloc_v2, *_ptsz) as libcuda exports them */
#include "gated_symbols.h"
#include "gemtrace_contract.h"
#include "gemtrace_region.h"
#include "libc_compat.h"

#define GT_EXPORT __attribute__((visibility("default")))
#define GT_LIKELY(x) __builtin_expect(!!(x), 1)
#define GT_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GT_TLS __thread __attribute__((tls_model("initial-exec")))
#define GT_MAX_DEVICES 64 /* CUDA device ordinals we map to region GPUs */

/* Fork: the child of a fork is a process of its own, with one thread. Each part of the gate resets
 * its own state there, in a pthread_atfork child handler that its constructor registers (as HAMi-core
 * does): no part reaches into another's. The child runs the handlers in the order they were
 * registered, which the constructors' priorities fix: the attachment first, then the parts that use it. */
#define GT_CONSTRUCTOR_ATTACH __attribute__((constructor(101)))    /* attach.c */
#define GT_CONSTRUCTOR_INTERCEPT __attribute__((constructor(102))) /* intercept.c */
#define GT_CONSTRUCTOR_LAUNCH __attribute__((constructor(103)))    /* launch.c */
#define GT_CONSTRUCTOR_MEMORY __attribute__((constructor(104)))    /* memory.c */

/* The real entry points, one typed member per symbol of both lists. */
struct gt_real {
#define GT_REAL_MEMBER(name) __typeof__(&name) name;
    GT_GATED_SYMBOLS(GT_REAL_MEMBER)
    GT_HELPER_SYMBOLS(GT_REAL_MEMBER)
#undef GT_REAL_MEMBER
};
extern struct gt_real gt_real;

/* Fill gt_real (idempotent, retried until libcuda is there, then never again). */
void gt_resolve_real(void);
#define GT_REAL(name) (GT_LIKELY(gt_real.name != NULL) ? gt_real.name : (gt_resolve_real(), gt_real.name))

/* The process's attachment to the region. `attached` is the one flag the fast path reads first. */
struct gt_process {
    int attached;                 /* 1 once region, group and slot are ours (atomic) */
    const struct gt_region *region; /* mapped PROT_READ: the gate never writes it */
    struct gt_slot *slots;          /* the slot table: GT_MAX_SLOTS slots, our user's chunks writable */
    uint64_t view_generation;       /* region->header.chunk_generation when the table was last mapped */
    struct gt_bells *bells;         /* the doorbells, read-write (NULL until the agent sent them) */
    struct gt_slot *slot;
    uint32_t slot_index;
    uint32_t fallback_group;        /* "default": the group while the agent has not decided */
    int single_gpu;               /* region gpu index when the process sees one CUDA device, else -1 */
    int devices_known;            /* 1 once device_gpu[] is filled (atomic) */
    int device_count;
    int device_gpu[GT_MAX_DEVICES]; /* CUDA ordinal -> region gpu index, -1 when not in the region */
    uint32_t burst_open[GT_MAX_GPUS]; /* 1 while we have work queued that no sync has drained (atomic) */
    uint64_t burst_start_ns[GT_MAX_GPUS];
    /* The stream the burst's first launch named, and 1 once another launch of the burst named another
     * (or the per-thread default stream, which is each thread's own): then only a context
     * synchronisation empties the process's queue (gt_close_burst). */
    CUstream burst_stream[GT_MAX_GPUS];
    uint32_t burst_streams_many[GT_MAX_GPUS];
    /* 1 when the last burst was closed by a sync that did not cover all of it (an event's, or one
     * stream's of several): work of it may still run, so the next burst counts as on several streams. */
    uint32_t burst_left_work[GT_MAX_GPUS];
    uint64_t burst_first_launch[GT_MAX_GPUS]; /* slot->launches[gpu] when the burst opened */
    uint64_t launch_ns[GT_MAX_GPUS];      /* a launch's share of a burst's time, decayed mean (0: none yet) */
    uint64_t launch_ns_weight[GT_MAX_GPUS]; /* the launches behind launch_ns, decayed (gt_close_burst) */
    /* keep_queue_short (launch.c): launches up to queue_base[gpu] are known to have run; an event
     * recorded after launch marker_launch[gpu] while marker_armed[gpu]; the launch count at which the
     * short queue next needs a look, queue_check_at[gpu] (0: the next launch), counted for the bound
     * of the word queue_state[gpu]. */
    uint64_t queue_base[GT_MAX_GPUS];
    uint64_t queue_check_at[GT_MAX_GPUS];
    uint32_t queue_state[GT_MAX_GPUS]; /* the word (its bound) queue_check_at was counted for */
    uint64_t marker_launch[GT_MAX_GPUS];
    uint32_t marker_armed[GT_MAX_GPUS];
    CUevent marker_event[GT_MAX_GPUS];
};
extern struct gt_process gt_proc;

/* attach.c */
bool gt_attach_slow(bool wait);   /* try to attach (rate-limited); true when attached */
bool gt_attach_held_back(void);  /* a live agent gave no slot, and the program waits for one (not let through yet) */
bool gt_attach_refused(void);     /* the operator's --unattached=refuse was given: allocations fail */
static inline bool gt_attached(void) { return GT_LIKELY(__atomic_load_n(&gt_proc.attached, __ATOMIC_ACQUIRE)); }
bool gt_agent_alive(void);
/* Map the chunks the agent added since the table was mapped, and its doorbells again (the allocation
 * path calls it before it sums a group's slots, a hold before it rings; a no-op while the region's
 * chunk_generation is the table's). */
void gt_refresh_slots(void);
/* Ring GPU `gpu`'s doorbell: a thread starts waiting on a held word there (gemtrace_region.h). */
void gt_ring(int gpu);

/* The group of slot i's process: the agent's decision when it names that process, else "default"
 * (the agent has not decided yet, or the entry is a former occupant's). Read on every use rather than
 * cached: the agent moves a process whose group the resource file dropped to "default" by rewriting
 * assigned[i] (gemtrace_region.h). Bounds-checked: the index addresses the region. */
_Static_assert((GT_MAX_GROUPS & (GT_MAX_GROUPS - 1)) == 0, "GT_MAX_GROUPS must be a power of two");
static inline uint32_t gt_group_of(uint32_t index, int32_t pid)
{
    struct gt_assignment a;
    __atomic_load(&gt_proc.region->assigned[index], &a, __ATOMIC_ACQUIRE);
    if (GT_UNLIKELY(a.pid != pid || a.group >= GT_MAX_GROUPS))
        return gt_proc.fallback_group;
    return a.group;
}
/* Our own entry names the pid in our slot: getpid(), or, in a container's PID namespace, the host pid
 * the agent's reaper put there (docs/kubernetes.md), which is the pid the agent decided for. */
static inline uint32_t gt_group(void)
{
    return gt_group_of(gt_proc.slot_index, __atomic_load_n(&gt_proc.slot->pid, __ATOMIC_RELAXED));
}
uint64_t gt_now_ns(void);
int gt_gpu_of_device(CUdevice device); /* -1 when the device is not one the agent schedules */
int gt_current_gpu(void);              /* the current context's GPU, -1 when none or unknown */
int gt_stream_gpu(CUstream stream);    /* the GPU a stream's work runs on (multi-GPU processes) */
void gt_note_gpu(int gpu);             /* set the slot's gpu_mask bit */

/* futex.c: shared futex words (the agent and other processes map them too) */
void gt_futex_wait(const uint32_t *word, uint32_t expected, uint64_t timeout_ns); /* may wake early */
void gt_futex_wake(const uint32_t *word, int count);

/* launch.c */
/* A sync returned; emptied: it covered every launch of the burst. True when it closed an open burst. */
bool gt_close_burst(int gpu, bool emptied);

/* memory.c: after a hold of `group` on `gpu` ended in a release, prefetch the managed memory served in
 * place of device memory back to the GPU, on the stream of the launch that waited (once per release) */
void gt_prefetch_managed(int gpu, CUstream stream, uint32_t group);

#endif
