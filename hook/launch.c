/*
 * launch.c - kernel launches and synchronisation: the gate's fast path.
 *
 * Within quota a launch costs: one load of `attached`, one load of the group's held word, one load of
 * the burst flag and a relaxed add to our slot's launch counter; no lock, no system call, no clock.
 * Held: the launching thread first drains what the process has queued on that GPU (so the next group's
 * slice is not eaten by our backlog: Gemini's expiry sync, LESSONS.md), then sleeps on the held word
 * (a shared futex; the agent wakes it), re-checking the agent's heartbeat so it never hangs without one.
 *
 * A burst is the time from the first launch after the process was idle to the sync that drains it;
 * its length is added to the slot's busy_ns (on a time-sliced GPU it includes other contexts' kernels
 * that ran in between: docs/gate.md).
 */
#define _GNU_SOURCE
#include "gate.h"

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static void futex_wait(uint32_t *word, uint32_t expected, uint64_t timeout_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull), .tv_nsec = (long)(timeout_ns % 1000000000ull)};
    /* Not FUTEX_PRIVATE: the agent wakes us from another process through the shared mapping. */
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void open_burst(int gpu)
{
    uint32_t closed = 0;
    if (__atomic_compare_exchange_n(&gt_proc.burst_open[gpu], &closed, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        gt_proc.burst_start_ns[gpu] = gt_now_ns();
}

void gt_close_burst(int gpu)
{
    if (gpu < 0 || !gt_attached())
        return;
    uint64_t now = gt_now_ns();
    uint32_t open = 1;
    if (__atomic_compare_exchange_n(&gt_proc.burst_open[gpu], &open, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        uint64_t start = gt_proc.burst_start_ns[gpu];
        if (now > start)
            __atomic_fetch_add(&gt_proc.slot->busy_ns[gpu], now - start, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&gt_proc.slot->drained_ns[gpu], now, __ATOMIC_RELEASE);
}

/* Wait until our queued work on `gpu` has run. The launch's own stream where it names one: the
 * current context may be another device's (see gt_stream_gpu). */
static void drain(int gpu, CUstream stream)
{
    if (!__atomic_load_n(&gt_proc.burst_open[gpu], __ATOMIC_ACQUIRE))
        return;
    bool named = stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD;
    CUresult r = named ? (GT_REAL(cuStreamSynchronize) ? gt_real.cuStreamSynchronize(stream) : CUDA_ERROR_NOT_FOUND)
                       : (GT_REAL(cuCtxSynchronize) ? gt_real.cuCtxSynchronize() : CUDA_ERROR_NOT_FOUND);
    if (r == CUDA_SUCCESS)
        gt_close_burst(gpu);
}

static __attribute__((noinline)) void hold(int gpu, uint32_t *held, CUstream stream)
{
    if (!gt_agent_alive())
        return; /* no agent, or a stale one: never hang (the last limits written still apply to memory) */
    drain(gpu, stream);
    struct gt_slot *slot = gt_proc.slot;
    __atomic_fetch_add(&slot->waiting[gpu], 1, __ATOMIC_ACQ_REL);
    while (__atomic_load_n(held, __ATOMIC_ACQUIRE) && gt_agent_alive())
        futex_wait(held, 1, GT_HOLD_RECHECK_NS);
    __atomic_fetch_sub(&slot->waiting[gpu], 1, __ATOMIC_ACQ_REL);
    __atomic_store_n(&slot->last_launch_ns[gpu], gt_now_ns(), __ATOMIC_RELAXED);
}

static GT_TLS uint32_t ungated_launches;

static void gate_launch(CUstream stream)
{
    if (GT_UNLIKELY(!gt_attached())) {
        /* Not attached (no agent yet): look again now and then, not on every launch. */
        if ((ungated_launches++ & 0xfff) != 0 || !gt_attach_slow(false))
            return;
    }
    int gpu = gt_proc.single_gpu;
    if (GT_UNLIKELY(gpu < 0) && (gpu = gt_stream_gpu(stream)) < 0)
        return;
    uint32_t *held = &gt_proc.region->control[gpu][gt_proc.group].held;
    if (GT_UNLIKELY(__atomic_load_n(held, __ATOMIC_ACQUIRE)))
        hold(gpu, held, stream);
    if (GT_UNLIKELY(!__atomic_load_n(&gt_proc.burst_open[gpu], __ATOMIC_RELAXED)))
        open_burst(gpu);
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
    gate_launch(stream);
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
    gate_launch(config ? config->hStream : NULL);
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
    gate_launch(stream);
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
    gate_launch(stream);
    return gt_real.cuGraphLaunch_ptsz(graph, stream);
}

/* --- synchronisation: after a successful sync nothing of ours is queued (the burst ends) ---------- */

static CUresult synced(CUresult r, CUstream stream)
{
    if (r == CUDA_SUCCESS && gt_attached())
        gt_close_burst(gt_proc.single_gpu >= 0 ? gt_proc.single_gpu : gt_stream_gpu(stream));
    return r;
}

GT_EXPORT CUresult cuCtxSynchronize(void)
{
    if (!GT_REAL(cuCtxSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuCtxSynchronize(), NULL);
}

GT_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!GT_REAL(cuCtxSynchronize_v2))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuCtxSynchronize_v2(ctx), NULL);
}

/* A stream or event sync drains that stream only; a process with work on several streams may still
 * have some queued. The burst is closed all the same: docs/gate.md says what that costs. */
GT_EXPORT CUresult cuStreamSynchronize(CUstream stream)
{
    if (!GT_REAL(cuStreamSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuStreamSynchronize(stream), stream);
}

GT_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream stream)
{
    if (!GT_REAL(cuStreamSynchronize_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuStreamSynchronize_ptsz(stream), stream);
}

GT_EXPORT CUresult cuEventSynchronize(CUevent event)
{
    if (!GT_REAL(cuEventSynchronize))
        return CUDA_ERROR_NOT_FOUND;
    return synced(gt_real.cuEventSynchronize(event), NULL);
}
