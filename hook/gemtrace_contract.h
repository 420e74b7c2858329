/*
 * gemtrace_contract.h - what a gated process and the agent agree on besides the region's layout:
 * the environment a gate reads, where it looks for the agent's files, the group it asks for unasked.
 *
 * The agent's Python reads these values, with the region's constants (gemtrace_region.h) and the
 * BPF programs' event types (bpf/gemtrace_cuda.h), from gemtrace/contract.py, which `make`
 * (hook/Makefile) generates from the headers with contract_py.c; tests/test_region_layout.py fails
 * when that module and the headers differ. Change a value here, never in Python.
 */
#ifndef GEMTRACE_CONTRACT_H
#define GEMTRACE_CONTRACT_H

#define GT_ENV_GROUP "GEMTRACE_GROUP"         /* the group a process asks for (a wish: the agent decides) */
#define GT_ENV_STATE_DIR "GEMTRACE_STATE_DIR" /* where the agent's region and socket are */
#define GT_DEFAULT_STATE_DIR "/run/gemtrace"  /* ... when GT_ENV_STATE_DIR is unset or empty */
#define GT_DEFAULT_GROUP "default"            /* the group of a process that asks for none, or is refused */
/* Oversubscribe groups (hook/memory.c, docs/gate.md): "0" turns off the advice and prefetch hints for
 * managed memory served in place of device memory; the most bytes one prefetch after a hold moves. */
#define GT_ENV_MANAGED_HINTS "GEMTRACE_MANAGED_HINTS"
#define GT_ENV_MANAGED_PREFETCH_MAX "GEMTRACE_MANAGED_PREFETCH_MAX"
/* Opportunistic groups (hook/launch.c, docs/scheduler.md): how many of its kernels a process keeps
 * queued beside a production process that has work queued, 0 to GT_BESIDE_KERNELS_MAX (default
 * GT_BESIDE_KERNELS); 0: none, it waits until production has nothing queued. */
#define GT_ENV_BESIDE_KERNELS "GEMTRACE_BESIDE_KERNELS"

#endif /* GEMTRACE_CONTRACT_H */
