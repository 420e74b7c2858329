/*
 * launch.c - kernel launches and synchronisation: the gate's fast path.
 *
 * Within quota a launch costs: one load of `attached`, one load of the group's held word, one load of
 * the burst flag, a compare of its stream with the burst's, and a relaxed atomic add to our slot's launch counter (atomic: the process's threads
 * launch at once; docs/gate.md has the figures); no mutex, no system call, no clock.
 * Held: the launching thread first drains what the process has queued on that GPU (so the next group's
 * slice is not eaten by our backlog; Gemini's hook likewise records an event at quota expiry and waits
 * for it: docs/scheduler.md), then sleeps on the held word (a shared futex; the agent or an earlier
 * waiter wakes it, and it wakes the next ones: the wake tree), re-checking the agent's heartbeat so
 * it never hangs without one.
 * Released with a short queue (a hold is coming): a launch that would leave more than about
 * GT_QUEUE_BOUND_NS of work queued (GT_OUTRANKED_QUEUE_BOUND_NS while outranked: a group of a higher
 * priority waits on the drain) first waits for part of it (keep_queue_short), so that the hold's
 * drain is short whatever the process queues; the launches before the next look cost two compares.
 * Released with a long queue (the holder alone, no hold in sight): the same with GT_LONG_QUEUE_BOUND_NS,
 * so that a group that comes later waits for at most that much of our backlog.
 * Released beside a production group (an opportunistic group, GT_RELEASED_BESIDE): while a production
 * process named in the control word's list has work queued, the bound is GT_BESIDE_KERNELS launches,
 * not time (each production kernel then waits for that few of ours at most); otherwise
 * GT_OUTRANKED_QUEUE_BOUND_NS of work. A few loads a launch: the list and the slots it names.
 * A thread that starts waiting on a held word rings its GPU's doorbell (the doorbells page): the
 * scheduler reacts at once where that wait matters. So does a sync that leaves the group with nothing
 * queued on the GPU while it is held (a drain's end) or released with control.ring_quiet (the holder
 * going quiet while another group waits): the sync path's one load more; never a launch.
 *
 * A burst is the time from the first launch after the process was idle to the sync that drains it;
 * its length is added to the slot's busy_ns (on a time-sliced GPU it includes other contexts' kernels
 * that ran in between: docs/gate.md). Its opening time goes to the slot's burst_start_ns, and a sync
 * that covered every launch of it stores drained_ns: the scheduler reads "nothing queued" as
 * drained_ns >= burst_start_ns, with no clock read per launch (the one clock read is the opening's).
 * Which syncs cover every launch: a context synchronisation, and a stream's where every launch of the
 * burst named that stream (a launch that names another stream than the burst's first costs one more
 * compare). An event's, or a stream's while others have work, ends the burst for busy_ns but stores
 * no drained_ns: the process may still have work queued (docs/scheduler.md).
 */
#define _GNU_SOURCE
#include "gate.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* The wake tree (gemtrace_region.h, "Launch gating"): a release wakes GT_WAKE_FANOUT waiters, and
 * each woken one GT_WAKE_FANOUT more, so that no one thread pays for waking them all. */
static void wake_next(const uint32_t *held)
{
    gt_futex_wake(held, GT_WAKE_FANOUT);
}

static bool is_named_stream(CUstream stream)
{
    return stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD;
}

static void open_burst(int gpu, CUstream stream)
{
    uint32_t closed = 0;
    if (__atomic_compare_exchange_n(&gt_proc.burst_open[gpu], &closed, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        uint64_t launches = __atomic_load_n(&gt_proc.slot->launches[gpu], __ATOMIC_RELAXED);
        gt_proc.burst_first_launch[gpu] = launches;
        __atomic_store_n(&gt_proc.queue_base[gpu], launches, __ATOMIC_RELAXED);
        __atomic_store_n(&gt_proc.marker_armed[gpu], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&gt_proc.queue_check_at[gpu], 0, __ATOMIC_RELAXED); /* keep_queue_short recounts */
        __atomic_store_n(&gt_proc.burst_stream[gpu], stream, __ATOMIC_RELAXED);
        /* The per-thread default stream is one handle for every thread's own stream; and work left
         * by the last burst may be on any stream. */
        __atomic_store_n(&gt_proc.burst_streams_many[gpu],
                         stream == CU_STREAM_PER_THREAD || __atomic_load_n(&gt_proc.burst_left_work[gpu], __ATOMIC_RELAXED),
                         __ATOMIC_RELAXED);
        uint64_t now = gt_now_ns();
        gt_proc.burst_start_ns[gpu] = now;
        /* Before the launch is counted (release): a scheduler that reads drained_ns, then this, never
         * takes the new burst for drained. */
        __atomic_store_n(&gt_proc.slot->burst_start_ns[gpu], now, __ATOMIC_RELEASE);
    }
}

/* Does a synchronisation of `stream` cover every launch of the open burst on `gpu`? (A context's
 * always does: the caller says so without asking.) */
static bool sync_empties(int gpu, CUstream stream)
{
    return !__atomic_load_n(&gt_proc.burst_streams_many[gpu], __ATOMIC_ACQUIRE) &&
           __atomic_load_n(&gt_proc.burst_stream[gpu], __ATOMIC_RELAXED) == stream;
}

#define GT_LAUNCH_WEIGHT_MAX (1ull << 24) /* launches: keeps mean * weight within 64 bits */

bool gt_close_burst(int gpu, bool emptied)
{
    if (gpu < 0 || !gt_attached())
        return false;
    uint64_t now = gt_now_ns();
    uint32_t open = 1;
    bool closed = __atomic_compare_exchange_n(&gt_proc.burst_open[gpu], &open, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    if (closed) {
        if (!emptied)
            __atomic_store_n(&gt_proc.burst_left_work[gpu], 1, __ATOMIC_RELAXED);
        uint64_t start = gt_proc.burst_start_ns[gpu];
        if (now > start)
            __atomic_fetch_add(&gt_proc.slot->busy_ns[gpu], now - start, __ATOMIC_RELAXED);
        uint64_t launches = __atomic_load_n(&gt_proc.slot->launches[gpu], __ATOMIC_RELAXED) - gt_proc.burst_first_launch[gpu];
        if (now > start && launches > 0 && launches < UINT32_MAX) {
            /* A mean over launches, the older ones decayed: a burst weighs at least a quarter, and
             * more where it had more launches than the figure so far. The first figure comes from the
             * 16 launches that keep_queue_short drains to measure one, slowed by the program's first
             * launches: about 5 us where a steady launch takes 60 ns in the simulated GPU's
             * empty-launch loop. A plain 3:1 decay still read 2.9 us after bursts of 200000 and
             * 2000000 launches, and the short queue waited on its marker every 1000 launches. */
            uint64_t per = (now - start) / launches, mean = __atomic_load_n(&gt_proc.launch_ns[gpu], __ATOMIC_RELAXED);
            uint64_t prior = gt_proc.launch_ns_weight[gpu];
            if (prior > 3 * launches)
                prior = 3 * launches;
            if (prior > GT_LAUNCH_WEIGHT_MAX)
                prior = GT_LAUNCH_WEIGHT_MAX;
            if (!mean)
                prior = 0;
            __atomic_store_n(&gt_proc.launch_ns[gpu], (mean * prior + per * launches) / (prior + launches), __ATOMIC_RELAXED);
            gt_proc.launch_ns_weight[gpu] = prior + launches;
        }
    }
    /* Only a sync that covered every launch: the scheduler takes drained_ns >= burst_start_ns for an
     * empty queue, and charges the process's group until then. */
    if (emptied) {
        __atomic_store_n(&gt_proc.burst_left_work[gpu], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&gt_proc.slot->drained_ns[gpu], now, __ATOMIC_RELEASE);
    }
    return closed;
}

/* Synchronise the context `stream` belongs to (the current one may be another device's). */
static CUresult sync_stream_context(CUstream stream)
{
    if (!GT_REAL(cuCtxSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    if (!is_named_stream(stream))
        return gt_real.cuCtxSynchronize();
    CUcontext current = NULL, ctx = NULL;
    if (!GT_REAL(cuStreamGetCtx) || !GT_REAL(cuCtxGetCurrent) || !GT_REAL(cuCtxSetCurrent) ||
        gt_real.cuCtxGetCurrent(&current) != CUDA_SUCCESS || gt_real.cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_FOUND;
    if (ctx != current && gt_real.cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = gt_real.cuCtxSynchronize();
    if (ctx != current)
        gt_real.cuCtxSetCurrent(current);
    return r;
}

/* Wait until our queued work on `gpu` has run. The launch's own stream where it names one: the
 * current context may be another device's (see gt_stream_gpu). */
static void drain(int gpu, CUstream stream)
{
    if (!__atomic_load_n(&gt_proc.burst_open[gpu], __ATOMIC_ACQUIRE))
        return;
    /* The stream alone where the burst used no other; else all of its context: the drain empties the
     * queue, so that the next group's slice is its own. */
    bool one_stream = is_named_stream(stream) && sync_empties(gpu, stream);
    CUresult r = one_stream ? (GT_REAL(cuStreamSynchronize) ? gt_real.cuStreamSynchronize(stream) : CUDA_ERROR_NOT_FOUND)
                            : sync_stream_context(stream);
    if (r == CUDA_SUCCESS)
        gt_close_burst(gpu, true);
}

/* Does another process of our group still have work queued on `gpu` (a burst open, no thread of it
 * waiting)? While our group is held, that is work from before the hold: its drain is not over, and
 * that process rings as it finishes. Reads our own state's stores first (a fence): of two processes
 * finishing at once, at least one sees the other done and rings. */
static bool group_mates_busy(int gpu)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    struct gt_slot *slots = gt_proc.slots;
    uint32_t group = gt_group();
    for (uint32_t i = 0; i < GT_MAX_SLOTS; i++) {
        struct gt_slot *s = &slots[i];
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_ACQUIRE);
        if (pid == 0 || s == gt_proc.slot || gt_group_of(i, pid) != group)
            continue;
        if (__atomic_load_n(&s->waiting[gpu], __ATOMIC_ACQUIRE) == 0 &&
            __atomic_load_n(&s->drained_ns[gpu], __ATOMIC_ACQUIRE) < __atomic_load_n(&s->burst_start_ns[gpu], __ATOMIC_ACQUIRE))
            return true;
    }
    return false;
}

/* Our queue on `gpu` emptied where the scheduler waits for our group's end (a held group's drain, or
 * a released one going quiet while another group waits: control.ring_quiet): ring its scheduler,
 * unless a process of our group still has work there (it rings as it finishes). The scheduler looks
 * at the group's end only: each ring wakes its thread, and with two processes a group the first
 * ring's wake-up found the drain unfinished and slept on (a quarter of its wake-ups at 4 groups x 2,
 * issue 13). A forged busy slot of our group leaves the look to the scheduler's net, a delay of our
 * own group's switch. */
static void ring_drain_end(int gpu)
{
    gt_refresh_slots();
    if (!group_mates_busy(gpu))
        gt_ring(gpu);
}

/* `group` is the group whose word `held` is: the wait also ends when the agent moves the process to
 * another group (its group was dropped, and the entry may already serve a new name whose word stays
 * held while nobody of it has work: waiting on there would be waiting for ever). The next launch
 * then reads its new group's word. */
static __attribute__((noinline)) void hold(int gpu, const uint32_t *held, CUstream stream, uint32_t group)
{
    if (!gt_agent_alive())
        return; /* no agent, or a stale one: never hang (the last limits written still apply to memory) */
    drain(gpu, stream);
    struct gt_slot *slot = gt_proc.slot;
    __atomic_fetch_add(&slot->waiting[gpu], 1, __ATOMIC_ACQ_REL);
    /* Ring the GPU's scheduler (after `waiting`, which its look reads): where this wait matters at
     * once (a group of a higher priority asks for the GPU; a held group has drained) it sleeps on the
     * doorbell, not until its next look. One system call, on a path that is about to sleep anyway. */
    ring_drain_end(gpu);
    while (__atomic_load_n(held, __ATOMIC_ACQUIRE) == GT_HELD && gt_agent_alive() && gt_group() == group)
        gt_futex_wait(held, GT_HELD, GT_HOLD_RECHECK_NS);
    __atomic_fetch_sub(&slot->waiting[gpu], 1, __ATOMIC_ACQ_REL);
    if (__atomic_load_n(held, __ATOMIC_ACQUIRE) == GT_HELD)
        return; /* a silent agent, or a move to another group: no release to pass on */
    /* Released (while we slept, or before the first wait, while we drained or rang): pass the wake on
     * before anything of ours (moved or not: we may hold one of the release's wakes). */
    wake_next(held);
    /* Let go by the scheduler (not by a move to another group): bring back the managed memory that
     * the groups which ran meanwhile evicted, ahead of this launch's kernel. */
    if (gt_group() == group)
        gt_prefetch_managed(gpu, stream, group);
}

/* Released by the scheduler: keep what the process has queued on the GPU under about `bound` of work
 * (GT_QUEUE_BOUND_NS with a hold coming, GT_OUTRANKED_QUEUE_BOUND_NS where a group of a higher priority
 * waits on the drain, GT_LONG_QUEUE_BOUND_NS with no hold in sight: queue_bound), so that a hold's drain
 * is short. A CPU that runs ahead queues the
 * driver's whole queue (1024 launches, seconds of kernels) in microseconds, so the age of the burst
 * says nothing; its launches times what a launch took in the bursts drained so far does. Before the
 * first drain there is no such figure: a burst of a few launches is drained to measure one.
 * With a figure, the GPU is never let run dry: an event is recorded when half the bound is queued,
 * and a launch that would queue more than the bound waits for that event only (half stays queued).
 * Returns true when the launch waited (the held word may have changed meanwhile). */
#define GT_FIRST_MEASURE_LAUNCHES 16
static pthread_mutex_t marker_lock = PTHREAD_MUTEX_INITIALIZER;

/* After fork: a thread of the parent may have held the lock; the child has no such thread. The
 * markers themselves are in gt_proc, which attach.c's handler clears. */
static void after_fork_in_child(void) { pthread_mutex_init(&marker_lock, NULL); }

/* Beside busy production: this process's kernels queued at most (GEMTRACE_BESIDE_KERNELS). */
static uint32_t beside_kernels = GT_BESIDE_KERNELS;

static void read_beside_kernels(void)
{
    const char *text = getenv(GT_ENV_BESIDE_KERNELS);
    if (!text || !*text)
        return;
    const char *end;
    uint64_t v;
    if (!gt_parse_decimal(text, &end, &v) || *end || v > GT_BESIDE_KERNELS_MAX) {
        fprintf(stderr, "gemtrace gate: %s=%s is not a whole number from 0 to %u; keeping %u kernels queued beside "
                "busy production.\n", GT_ENV_BESIDE_KERNELS, text, GT_BESIDE_KERNELS_MAX, GT_BESIDE_KERNELS);
        return;
    }
    beside_kernels = (uint32_t)v;
}

GT_CONSTRUCTOR_LAUNCH static void launch_init(void)
{
    int saved = errno;
    pthread_atfork(NULL, NULL, after_fork_in_child);
    read_beside_kernels();
    errno = saved;
}

/* An event in the stream's context (the current one may be another device's), recorded on it. */
static bool record_marker(int gpu, CUstream stream, uint64_t launches)
{
    if (!GT_REAL(cuEventRecord) || !GT_REAL(cuEventCreate) || !GT_REAL(cuCtxSetCurrent) || !GT_REAL(cuCtxGetCurrent))
        return false;
    CUevent *event = &gt_proc.marker_event[gpu];
    if (!*event) {
        CUcontext current = NULL, ctx = NULL;
        if (gt_real.cuCtxGetCurrent(&current) != CUDA_SUCCESS)
            return false;
        ctx = current;
        if (is_named_stream(stream) && (!GT_REAL(cuStreamGetCtx) || gt_real.cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS))
            return false;
        if (!ctx || (ctx != current && gt_real.cuCtxSetCurrent(ctx) != CUDA_SUCCESS))
            return false;
        CUresult created = gt_real.cuEventCreate(event, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
        if (ctx != current)
            gt_real.cuCtxSetCurrent(current);
        if (created != CUDA_SUCCESS) {
            *event = NULL;
            return false;
        }
    }
    if (gt_real.cuEventRecord(*event, stream) != CUDA_SUCCESS)
        return false; /* another context than the event's (a stream of another context on this GPU) */
    gt_proc.marker_launch[gpu] = launches;
    __atomic_store_n(&gt_proc.marker_armed[gpu], 1, __ATOMIC_RELEASE);
    return true;
}

/* The launch count at which the short queue next needs a look: where half the bound is queued and
 * no event is recorded yet, or where the bound is crossed and one is. The launches between cost one
 * compare (queue_check_due); the clock, the heartbeat and the lock are read only here. */
static uint64_t next_queue_check(int gpu, uint64_t per_launch, uint64_t bound_ns)
{
    /* queued <= the bound, and at least one launch more than the marker's: a bound shorter than a
     * kernel (the outranked queue's 0.5 ms beside 2 ms kernels) would leave the GPU idle while the
     * waiting thread wakes and launches the next one. */
    uint64_t bound = bound_ns / per_launch;
    if (!bound)
        bound = 1;
    uint64_t half = (bound_ns / 2 + per_launch - 1) / per_launch;         /* queued >= half of it */
    uint64_t base = __atomic_load_n(&gt_proc.queue_base[gpu], __ATOMIC_RELAXED);
    return __atomic_load_n(&gt_proc.marker_armed[gpu], __ATOMIC_ACQUIRE) ? base + bound + 1 : base + half;
}

/* The gate's own name for GT_RELEASED_BESIDE while production has work queued: its bound counts
 * launches (queue_state tells the two apart, so that a change of either is looked at once). */
#define GT_BESIDE_BUSY 0x100u

static uint64_t queue_bound(uint32_t state)
{
    return state == GT_RELEASED_OUTRANKED || state == GT_RELEASED_BESIDE ? GT_OUTRANKED_QUEUE_BOUND_NS
           : state == GT_RELEASED_LONG_QUEUE                           ? GT_LONG_QUEUE_BOUND_NS
           : state == GT_BESIDE_BUSY                                   ? beside_kernels
                                                                       : GT_QUEUE_BOUND_NS;
}

static inline bool queue_bounded(uint32_t state)
{
    return state == GT_RELEASED_SHORT_QUEUE || state == GT_RELEASED_OUTRANKED || state == GT_RELEASED_LONG_QUEUE ||
           state == GT_RELEASED_BESIDE || state == GT_BESIDE_BUSY;
}

/* Released beside production: does a production process of this GPU have work queued (a burst open:
 * drained_ns < burst_start_ns)? The agent's list names their slots; a slot of a chunk not mapped yet
 * reads as free (attach.c, reserve_table) until gt_refresh_slots maps it. */
static bool production_busy(int gpu, const struct gt_control *control)
{
    uint32_t n = __atomic_load_n(&control->beside_n, __ATOMIC_ACQUIRE);
    if (n == GT_BESIDE_MANY)
        return true;
    if (n > GT_BESIDE_SLOTS)
        n = GT_BESIDE_SLOTS;
    gt_refresh_slots();
    for (uint32_t i = 0; i < n; i++) {
        uint32_t index = __atomic_load_n(&control->beside_slots[i], __ATOMIC_RELAXED);
        if (index >= GT_MAX_SLOTS)
            continue;
        const struct gt_slot *s = &gt_proc.slots[index];
        if (__atomic_load_n(&s->pid, __ATOMIC_RELAXED) != 0 &&
            __atomic_load_n(&s->drained_ns[gpu], __ATOMIC_ACQUIRE) < __atomic_load_n(&s->burst_start_ns[gpu], __ATOMIC_ACQUIRE))
            return true;
    }
    return false;
}

static __attribute__((noinline)) bool keep_queue_short(int gpu, CUstream stream, uint64_t launches, uint64_t bound,
                                                       bool counted)
{
    if (!__atomic_load_n(&gt_proc.burst_open[gpu], __ATOMIC_ACQUIRE))
        return false; /* nothing queued; open_burst starts the count again */
    /* A bound in launches (beside busy production) counts each launch as one unit of "work". */
    uint64_t per_launch = counted ? 1 : __atomic_load_n(&gt_proc.launch_ns[gpu], __ATOMIC_RELAXED);
    if (!per_launch) { /* until the first drain: the next launch looks again */
        if (launches - gt_proc.burst_first_launch[gpu] < GT_FIRST_MEASURE_LAUNCHES &&
            gt_now_ns() - gt_proc.burst_start_ns[gpu] <= bound)
            return false;
        drain(gpu, stream);
        return true;
    }
    uint64_t due = next_queue_check(gpu, per_launch, bound);
    if (launches < due) {
        __atomic_store_n(&gt_proc.queue_check_at[gpu], due, __ATOMIC_RELAXED);
        return false;
    }
    if (!gt_agent_alive()) { /* the word is stale: look again half a bound later, not on every launch */
        __atomic_store_n(&gt_proc.queue_check_at[gpu], launches + bound / 2 / per_launch + 1, __ATOMIC_RELAXED);
        return false;
    }
    if (gt_mutex_trylock(&marker_lock) != 0)
        return false; /* another thread is at it; this launch passes */
    uint64_t queued = (launches - __atomic_load_n(&gt_proc.queue_base[gpu], __ATOMIC_RELAXED)) * per_launch;
    bool waited = false;
    if (__atomic_load_n(&gt_proc.marker_armed[gpu], __ATOMIC_ACQUIRE) && queued > bound) {
        /* Not through our cuEventSynchronize wrapper: this is no end of a burst. */
        if (gt_real.cuEventSynchronize(gt_proc.marker_event[gpu]) == CUDA_SUCCESS)
            __atomic_store_n(&gt_proc.queue_base[gpu], gt_proc.marker_launch[gpu], __ATOMIC_RELAXED);
        __atomic_store_n(&gt_proc.marker_armed[gpu], 0, __ATOMIC_RELAXED);
        waited = true;
        queued = (launches - __atomic_load_n(&gt_proc.queue_base[gpu], __ATOMIC_RELAXED)) * per_launch;
    }
    bool fallback = false;
    if (!__atomic_load_n(&gt_proc.marker_armed[gpu], __ATOMIC_ACQUIRE) && queued >= bound / 2)
        fallback = !record_marker(gpu, stream, launches) && queued > bound;
    /* With no event recorded (the driver refused one) the next launch looks again, as before. */
    __atomic_store_n(&gt_proc.queue_check_at[gpu], fallback ? 0 : next_queue_check(gpu, per_launch, bound), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&marker_lock);
    if (fallback) { /* no event to wait on: drain all of it */
        drain(gpu, stream);
        waited = true;
    }
    return waited;
}

/* Beside busy production with GEMTRACE_BESIDE_KERNELS=0: sleep until no production process has work
 * queued (a poll: production's gates ring nobody when their bursts end), the word changes, the agent
 * goes or the process moves to another group. Returns the word as it then is. */
static __attribute__((noinline)) uint32_t wait_production_quiet(int gpu, const uint32_t *held, uint32_t group)
{
    const struct gt_control *control = &gt_proc.region->control[gpu][group];
    struct timespec pause = {0, GT_BESIDE_POLL_NS};
    uint32_t state;
    while ((state = __atomic_load_n(held, __ATOMIC_ACQUIRE)) == GT_RELEASED_BESIDE && production_busy(gpu, control) &&
           gt_agent_alive() && gt_group() == group)
        nanosleep(&pause, NULL);
    return state;
}

/* Released with a bounded queue: most launches only compare their count with the next check's, and
 * the word with the one the check was counted for (a tighter bound needs a look now). */
static inline bool queue_check_due(int gpu, uint32_t state, uint64_t *launches)
{
    *launches = __atomic_load_n(&gt_proc.slot->launches[gpu], __ATOMIC_RELAXED);
    if (GT_UNLIKELY(state != __atomic_load_n(&gt_proc.queue_state[gpu], __ATOMIC_RELAXED))) {
        __atomic_store_n(&gt_proc.queue_state[gpu], state, __ATOMIC_RELAXED);
        return true;
    }
    return *launches >= __atomic_load_n(&gt_proc.queue_check_at[gpu], __ATOMIC_RELAXED);
}

static GT_TLS uint32_t ungated_launches;

static void gate_launch(CUstream stream)
{
    if (GT_UNLIKELY(!gt_attached())) {
        /* Not attached (no agent yet, or no slot free when we asked): look again every 64 launches,
         * and gt_attach_slow asks the agent at most once a second. Looking seldom (every few thousand
         * launches) would leave a loop of long kernels ungated for minutes, and where many programs
         * start at once, many ask while no slot is free yet (bench/results/agent_cpu.md). */
        if (gt_attach_held_back()) {
            /* A live agent had no slot for us and the operator's choice holds the program back until
             * one is free (or, under ungated and refuse, for a few seconds): its launches wait too, not
             * only its allocations, so nothing of it runs ungated meanwhile. */
            if (!gt_attach_slow(true))
                return;
        } else if ((ungated_launches++ & 0x3f) != 0 || !gt_attach_slow(false))
            return;
    }
    int gpu = gt_proc.single_gpu;
    if (GT_UNLIKELY(gpu < 0) && (gpu = gt_stream_gpu(stream)) < 0)
        return;
    uint32_t group = gt_group();
    const uint32_t *held = &gt_proc.region->control[gpu][group].held;
    uint32_t state = __atomic_load_n(held, __ATOMIC_ACQUIRE);
    if (GT_UNLIKELY(state != GT_RELEASED)) {
        /* After a wait the group may have been held meanwhile: look again, or this launch would
         * queue work behind the drain the scheduler has just seen end. */
        uint64_t launches;
        uint32_t bounded = state;
        if (state == GT_RELEASED_BESIDE && production_busy(gpu, &gt_proc.region->control[gpu][group])) {
            if (beside_kernels)
                bounded = GT_BESIDE_BUSY;
            else /* then bounded as the word says: production quiet, held, or another group's */
                state = bounded = wait_production_quiet(gpu, held, group);
        }
        if (queue_bounded(bounded) && queue_check_due(gpu, bounded, &launches) &&
            keep_queue_short(gpu, stream, launches, queue_bound(bounded), bounded == GT_BESIDE_BUSY))
            state = __atomic_load_n(held, __ATOMIC_ACQUIRE);
        if (state == GT_HELD)
            hold(gpu, held, stream, group);
    }
    if (GT_UNLIKELY(!__atomic_load_n(&gt_proc.burst_open[gpu], __ATOMIC_RELAXED)))
        open_burst(gpu, stream);
    else if (GT_UNLIKELY(stream != __atomic_load_n(&gt_proc.burst_stream[gpu], __ATOMIC_RELAXED)))
        __atomic_store_n(&gt_proc.burst_streams_many[gpu], 1, __ATOMIC_RELEASE);
    __atomic_fetch_add(&gt_proc.slot->launches[gpu], 1, __ATOMIC_RELAXED);
}

GT_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,
                                  void **params, void **extra)
{
    if (!GT_REAL(cuLaunchKernel))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream);
    return gt_real.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

GT_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                       CUstream stream, void **params, void **extra)
{
    if (!GT_REAL(cuLaunchKernel_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream ? stream : CU_STREAM_PER_THREAD);
    return gt_real.cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

GT_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    if (!GT_REAL(cuLaunchKernelEx))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(config ? config->hStream : NULL);
    return gt_real.cuLaunchKernelEx(config, f, params, extra);
}

GT_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    if (!GT_REAL(cuLaunchKernelEx_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(config && config->hStream ? config->hStream : CU_STREAM_PER_THREAD);
    return gt_real.cuLaunchKernelEx_ptsz(config, f, params, extra);
}

GT_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                             CUstream stream, void **params)
{
    if (!GT_REAL(cuLaunchCooperativeKernel))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream);
    return gt_real.cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params);
}

GT_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                  unsigned int bx, unsigned int by, unsigned int bz,
                                                  unsigned int shared, CUstream stream, void **params)
{
    if (!GT_REAL(cuLaunchCooperativeKernel_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream ? stream : CU_STREAM_PER_THREAD);
    return gt_real.cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params);
}

GT_EXPORT CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream)
{
    if (!GT_REAL(cuGraphLaunch))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream);
    return gt_real.cuGraphLaunch(graph, stream);
}

GT_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream)
{
    if (!GT_REAL(cuGraphLaunch_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    gate_launch(stream ? stream : CU_STREAM_PER_THREAD);
    return gt_real.cuGraphLaunch_ptsz(graph, stream);
}

/* --- synchronisation: after a successful sync nothing of ours is queued (the burst ends) ---------- */

/* What a successful synchronisation covered: every stream of the context, one stream (`stream`, as
 * the launches name it: NULL the legacy default stream, CU_STREAM_PER_THREAD the thread's own), or an
 * event's (its stream is not known, nor whether later launches follow it: it empties nothing). */
enum sync_scope { SYNC_CONTEXT, SYNC_STREAM, SYNC_EVENT };

static CUresult synced(CUresult r, CUstream stream, enum sync_scope scope)
{
    if (r == CUDA_SUCCESS && gt_attached()) {
        int gpu = gt_proc.single_gpu >= 0 ? gt_proc.single_gpu : gt_stream_gpu(stream);
        bool emptied = scope == SYNC_CONTEXT || (scope == SYNC_STREAM && sync_empties(gpu, stream));
        /* The program's own sync emptied its queue while its group is held: the end of a drain the
         * scheduler may be waiting for, with no launch of ours to block and ring (hold). Or while it is
         * released and another group waits (ring_quiet): the holder may have gone quiet, which the
         * scheduler waits for to hand the GPU on, instead of polling for it. */
        if (gpu >= 0 && gt_close_burst(gpu, emptied) && emptied) {
            const struct gt_control *control = &gt_proc.region->control[gpu][gt_group()];
            uint32_t held = __atomic_load_n(&control->held, __ATOMIC_ACQUIRE);
            if (held != GT_HELD && held != GT_RELEASED)
                /* After drained_ns, before the flag: of this sync and a look that sets the flag and then
                 * reads our slot, one sees the other (an agent that sets it before the release: always). */
                __atomic_thread_fence(__ATOMIC_SEQ_CST);
            if (held == GT_HELD || (held != GT_RELEASED && __atomic_load_n(&control->ring_quiet, __ATOMIC_RELAXED)))
                ring_drain_end(gpu);
        }
    }
    return r;
}

GT_EXPORT CUresult cuCtxSynchronize(void)
{
    if (!GT_REAL(cuCtxSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuCtxSynchronize(), NULL, SYNC_CONTEXT);
}

GT_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!GT_REAL(cuCtxSynchronize_v2))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuCtxSynchronize_v2(ctx), NULL, SYNC_CONTEXT);
}

/* A stream or event sync drains that stream only; a process with work on several streams may still
 * have some queued. The burst is closed all the same (docs/gate.md says what that costs to busy_ns),
 * but drained_ns is stored only where the burst used that stream alone (synced). */
GT_EXPORT CUresult cuStreamSynchronize(CUstream stream)
{
    if (!GT_REAL(cuStreamSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuStreamSynchronize(stream), stream, SYNC_STREAM);
}

GT_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream stream)
{
    if (!GT_REAL(cuStreamSynchronize_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuStreamSynchronize_ptsz(stream), stream ? stream : CU_STREAM_PER_THREAD, SYNC_STREAM);
}

GT_EXPORT CUresult cuEventSynchronize(CUevent event)
{
    if (!GT_REAL(cuEventSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuEventSynchronize(event), NULL, SYNC_EVENT);
}
