/*
 * gemtrace_cuda.h - the structs that bpf/gemtrace_cuda.bpf.c shares with user space
 * (gemtrace/sources/ebpf/probes.py reads the maps and the ring buffer through bcc, which derives its
 * ctypes mirrors from these very declarations, so this file is the one home of the layout). Its
 * constants reach the agent through gemtrace/contract.py, generated from it (hook/gemtrace_contract.h).
 */
#ifndef GEMTRACE_CUDA_H
#define GEMTRACE_CUDA_H

#define GT_BPF_MAX_DEVICES 8   /* as GT_MAX_GPUS in hook/gemtrace_region.h (tests/test_region_layout.py checks) */
/* An allocation's event (GT_EVENT_ALLOC) is written at most once per this many ns, host-wide: a user's
 * allocate-and-free loop would otherwise wake the agent's watcher hundreds of thousands of times a
 * second. An allocation left without an event is still counted in `usage`; the watcher looks again
 * this long after each event it reads (gemtrace/sources/ebpf/source.py), so it is seen as soon. */
#define GT_ALLOC_EVENT_GAP_NS 1000000

enum gt_alloc_kind {
    GT_KIND_POINTER = 0,       /* a device pointer: cuMemAlloc..., freed by cuMemFree_v2 or cuMemFreeAsync */
    GT_KIND_HANDLE = 1,        /* a cuMemCreate handle, released by cuMemRelease */
};

enum gt_event_type {
    GT_EVENT_ALLOC = 1,        /* an allocation returned success: the enforcer checks the group */
    GT_EVENT_EXIT = 2,         /* a process that held memory or a device exited: user space reaps */
};

struct gt_alloc_key {          /* one live allocation */
    u32 tgid;
    u32 kind;                  /* enum gt_alloc_kind */
    u64 addr;                  /* device pointer or handle */
};

struct gt_alloc {
    u64 size;
    u32 dev;                   /* device ordinal as the process sees it (CUDA_VISIBLE_DEVICES applies) */
    u32 managed;               /* 1: cuMemAllocManaged (counted in gt_usage.managed, not bytes) */
};

struct gt_proc_dev {           /* key of per-process, per-device figures */
    u32 tgid;
    u32 dev;
};

struct gt_usage {              /* value of per-process, per-device figures */
    u64 bytes;                 /* device memory held (managed memory left out: the driver pages it) */
    u64 allocs;                /* successful allocations */
    u64 last_alloc_ns;         /* bpf_ktime_get_ns() of the last successful allocation */
    u64 managed;               /* managed memory held (cuMemAllocManaged, an Oversubscribe group's gate) */
};

struct gt_call {               /* an allocation or release in flight, keyed by the full pid_tgid */
    u64 out;                   /* user address where the call writes its result (pointer or handle) */
    u64 out2;                  /* cuMemAllocPitch: where it writes the pitch */
    u64 size;                  /* bytes (cuMemAllocPitch: the height, multiplied by the pitch at return) */
    u64 addr;                  /* releases: the pointer or handle being released */
    u32 kind;                  /* enum gt_alloc_kind */
    u32 dev;
    u32 pitch;                 /* 1 for cuMemAllocPitch */
    u32 managed;               /* 1 for cuMemAllocManaged */
};

struct gt_event {
    u32 type;                  /* enum gt_event_type */
    u32 tgid;
    u32 dev;
    u32 pad;
    u64 size;                  /* the allocation's bytes */
    u64 bytes;                 /* the process's bytes on dev after it */
    u64 ts_ns;                 /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
};

#endif /* GEMTRACE_CUDA_H */
