/*
 * gemtrace_region.h - the one definition of the shared memory between the agent and the gates: two files.
 *
 * The agent owns two kinds of shared memory:
 *   - `region` (struct gt_region), a preallocated file in $GEMTRACE_STATE_DIR (gemtrace_contract.h has
 *     the default), owned by root, mode 0644: what the gates obey. Gates map it PROT_READ (a futex wait
 *     works on a read-only mapping), so no user can lift a hold, raise a limit, forge the heartbeat or
 *     the group table, or truncate the file under everyone.
 *   - the slot table (struct gt_slot slots[GT_MAX_SLOTS], one slot per gated process), made of chunks of
 *     GT_CHUNK_SLOTS slots. Each chunk is a memfd the agent creates for one user (uid) and seals against
 *     shrinking and growing (F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL), so nobody can truncate it and no
 *     mapping of it can fault. There is no file to open: a gate asks the agent over the unix socket
 *     GT_ATTACH_SOCKET (SOCK_SEQPACKET) and gets the chunks as descriptors (SCM_RIGHTS): its own user's
 *     chunks writable, every other chunk read-only (the agent reads the asker's uid from SO_PEERCRED).
 *     So a process writes only slots of its own user, and reads every slot (group sums need them).
 *     Both sides map chunk c at offset c * GT_CHUNK_BYTES of one reserved range (MAP_FIXED), so the
 *     table reads as one array; a chunk not mapped there reads as zeros (free slots).
 *     header.chunk_generation changes whenever a chunk is added or given to another user, and
 *     chunk_owner[c] says whose chunk c is; a gate that sees a new generation asks for the view again.
 *     The memfds are named "gemtrace-slots-<region_id in hex>-c<chunk>-u<uid>", so that a restarted
 *     agent takes back the chunks live processes still map (from /proc/PID/map_files), its region's
 *     only (other agents, of other state dirs, may run on the host), checking that root made them.
 *   - the doorbells (struct gt_bells), one page: a memfd the agent seals the same way and sends with
 *     every reply, read-write to every user. A gate rings its GPU's bell when one of its threads starts
 *     waiting on a held word (see Launch gating), and when the program's own sync empties its queue
 *     while its group is held there (a drain's end) or released with control.ring_quiet set (the
 *     holder going quiet while another group waits); the scheduler sleeps on it where that is news.
 *     A bell is a wake-up hint and nothing more: any user may ring or scribble on it, which costs the
 *     agent looks that it spaces (gemtrace/agent/scheduler.py, RING_GAP_NS), and nothing reads a decision
 *     from it. Named "gemtrace-bells-<region_id in hex>".
 * gemtrace/region/layout.py mirrors this header with ctypes; tests/test_region_layout.py compiles a program
 * printing sizeof/offsetof of every field and compares, so the two cannot drift. The constants below
 * reach Python through gemtrace/contract.py, generated from this header (gemtrace_contract.h says
 * how). Change a field of the region or a slot: bump GT_REGION_VERSION (the socket's messages carry it).
 *
 * Ownership (nothing here is protected by a lock, so a process killed at any instruction blocks nobody):
 *   - region: written by the agent only. It adopts an existing file only if it is sound, and still
 *     re-asserts what it means (the heartbeat every tick, groups[] every second, each GPU's control
 *     words on every look of its scheduler), for what root itself might have scribbled.
 *   - slots[i]: written only by the process that claimed it (CAS of `pid` from 0, in a chunk of its own
 *     user), except that the agent frees the slot of a process that has died (it zeroes the slot, then
 *     stores pid = 0) and gives a process in another PID namespace its host pid. Another process of the
 *     same user could write it too: the user's own figures, which the agent treats as a hint.
 *
 * Groups: membership is decided once, by the agent (docs/security.md). A gate claims a slot and
 * writes there the group it asks for (`requested`, from GEMTRACE_GROUP; empty when unset). The
 * agent, within a tick of seeing the slot, stores assigned[i] = {pid, group}: the group of a binding
 * Cgroup rule that names the process's cgroup (CgroupBinding: a pod's), whatever it asked for; else
 * the requested group if the process's owner is admitted to it (Users=/UnixGroups= in the resource
 * file), else the group of a matching Cgroup rule, else "default". The pid is part of the entry because a gate frees its own slot at exit and cannot
 * clear an entry it may not write: an entry counts only for the process whose pid it names, and the
 * agent clears entries whose slot changed owner every tick. Until its entry names it, a gate takes
 * itself for "default" (it waits for the agent at most GT_ASSIGN_WAIT_NS at attach). It reads its
 * group from assigned[] on every launch and allocation, never from a cached copy, so that when the
 * resource file drops a group the agent's rewrite of assigned[] to "default" moves its processes
 * within a second. An undefined group entry is freed (name emptied, then the rest zeroed) once no
 * assignment refers to it; an index is never reused while one does.
 *
 * Time: every *_ns field is CLOCK_MONOTONIC nanoseconds (Python: time.monotonic_ns()).
 *
 * Launch gating (per GPU, per group): control[gpu][group].held is a futex word (shared, not
 * FUTEX_PRIVATE), one of enum gt_held.
 *   GT_RELEASED: launches proceed after one atomic load. A group the agent does not schedule on that
 *      GPU (and every group while no agent runs).
 *   GT_RELEASED_SHORT_QUEUE: launches proceed, but a process whose queued work on that GPU comes to
 *      more than about GT_QUEUE_BOUND_NS (its launches since it last drained, times the time a launch
 *      took in its earlier bursts) first waits until about half of that is left. The agent sets it
 *      where a hold is coming (another group waits, or the group has a MaxUtil), so that the
 *      hold's drain is short: a process that never synchronises (its CPU runs seconds ahead, the
 *      driver's queue full) would otherwise make each drain seconds long.
 *   GT_RELEASED_OUTRANKED: the same with GT_OUTRANKED_QUEUE_BOUND_NS: a group of a higher priority
 *      has a process on that GPU, and its next launch revokes this group, whose drain it then waits
 *      for (a request's latency: docs/scheduler.md). Shorter than GT_QUEUE_BOUND_NS, which serves
 *      holds that come at a slice's end, where a drain of a few ms more costs no one's latency.
 *   GT_RELEASED_LONG_QUEUE: the same with GT_LONG_QUEUE_BOUND_NS. The agent sets it for a scheduled
 *      group that holds the GPU with no hold in sight (alone and uncapped): a group that comes later
 *      waits at most that long for the holder's drain, not for the seconds that a process which
 *      never synchronises queues. A CPU that pauses for less than half of it (a data loader's batch,
 *      Python's collector) still finds work queued on the GPU when it resumes.
 *   GT_RELEASED_BESIDE: an opportunistic group beside a production group (docs/scheduler.md,
 *      "Production and opportunistic work"). While a process named in control.beside_slots has work
 *      queued on that GPU (its drained_ns < burst_start_ns; beside_n = GT_BESIDE_MANY: always), a
 *      process of the group keeps at most about GT_BESIDE_KERNELS kernels queued there, counted in
 *      launches, not time: each production kernel waits for that few at most (GEMTRACE_BESIDE_KERNELS
 *      in its environment: 0 to GT_BESIDE_KERNELS_MAX; with 0 its launch sleeps GT_BESIDE_POLL_NS at a
 *      time until no production process has work queued). Otherwise it keeps
 *      GT_OUTRANKED_QUEUE_BOUND_NS of work, so that a production request arriving waits for little.
 *      The list is the agent's, rewritten when the GPU's production processes change; a gate reads
 *      it at each launch (a few loads) and the slots it names, never a lock.
 *   GT_HELD: a launching thread
 *   1. drains: if its process launched on that GPU since it last drained, it synchronises the
 *      launch's stream (the context, where the burst used other streams too) and stores
 *      slots[i].drained_ns[gpu] = now (the burst's end). The first launch after a drain stores
 *      slots[i].burst_start_ns[gpu] = now (the one clock read of the fast path), so that
 *      drained_ns >= burst_start_ns tells the agent the process has nothing queued there;
 *   2. adds 1 to slots[i].waiting[gpu], futex-waits on `held` (timeout GT_HOLD_RECHECK_NS so it can
 *      re-check the heartbeat), and leaves when held != GT_HELD, when assigned[i] names another group
 *      (the agent moved it: the old entry may already serve a new name), or when the heartbeat is
 *      older than GT_HEARTBEAT_STALE_NS (no agent: never hang); then subtracts 1 from waiting[gpu].
 *      Before its first wait it adds 1 to the doorbells' ring[gpu] and FUTEX_WAKEs it (unless another
 *      process of its group still has a burst open there: that one rings as it finishes): the scheduler,
 *      where a thread's wait matters at once (a group of a higher priority than the holder's asks for
 *      the GPU; a held group finished its drain while another waits), sleeps on that word rather than
 *      until its next look.
 * Released with ring_quiet = 1 (the agent sets it on the released group while another group waits:
 * before the release where one waits already, and clears it otherwise): a sync of the program that
 * empties its queue on that GPU while the word is not GT_RELEASED and no other process of its group
 * has a burst open there rings the doorbell, as a drain's end does, so that the scheduler learns that
 * the holder went quiet (and hands the GPU on) at its ring rather than by polling for it. One load more
 * on a sync, none on a launch; a ring only where the group as a whole goes quiet, not at every sync.
 * 0 (as in regions of gates and agents that predate it: the field was reserved) rings nothing, and the
 * holder keeps its slice (the scheduler's net is the slice's end).
 * The agent stores a released value then FUTEX_WAKEs GT_WAKE_FANOUT waiters on the word, not all of
 * them: a wake tree. A thread that leaves step 2 seeing a released value wakes GT_WAKE_FANOUT more
 * on the same word before its launch proceeds (never when it leaves with the word still held: a
 * recheck timeout, a move, a silent agent), so N waiters resume in about log2(N) rounds spread over
 * the CPUs, and the agent's wake call costs the same however many wait, where waking them all grows
 * with their number (bench/results/release_wake.md). A word held again before the tree
 * has run leaves the rest asleep, as it should. A woken thread killed before it wakes its share cuts
 * its branch, and one slow to run (stopped, CPU-throttled) delays it: those waiters resume at their
 * next recheck at the latest, within GT_HOLD_RECHECK_NS of the release. (Gates of an older region
 * version, which pass nothing on, never attach: the version is part of the protocol.)
 * On a clean stop the agent releases every word and stores heartbeat_ns = 0.
 *
 * Memory (per GPU, per group, the limit is groups[g].memory_limit): a gate reserves optimistically:
 * it adds the size to its own slots[i].memory[gpu] (seq_cst), then sums memory[gpu] over every
 * slot with pid != 0 whose group (assigned[], "default" while unassigned) is its own; above the limit it subtracts the size again and returns
 * CUDA_ERROR_OUT_OF_MEMORY without calling the driver. Two racing reservations may both fail near
 * the limit; neither can overshoot (but see Whose figures count, for a user the agent caught lying).
 * A slot's counters only ever subtract what that process added.
 * While the heartbeat is stale, that sum leaves out the slots whose process no longer exists
 * (kill(pid, 0) fails with ESRCH): their memory went with them and no agent is there to free them.
 *
 * Whose figures count (issue 25): a slot of the gate's own user (chunk_owner[] of the slot's chunk
 * equals that of the gate's own slot) counts its own live figures: they bind that user's processes
 * only, which could write them anyway. A slot of another user counts verified[i] instead (see
 * "Verified memory" below), so that a figure written there denies nobody else any memory, unless the
 * agent trusts its chunk (chunk_trusted[c] = 1: its own figures count, as above). Either way another
 * user's slot counts only once assigned[i] names its pid and only on the GPUs its gpu_mask names: the
 * agent audits only what it placed, where the slot says it works. While the heartbeat is stale no
 * agent verifies anything, and every slot's own figures count.
 *
 * Oversubscription (groups[g].oversubscribe_limit != 0, the resource file's Oversubscribe): a
 * cuMemAlloc_v2 that the limit above (or the GPU itself) refuses is served with cuMemAllocManaged,
 * which the driver pages between host and GPU. It is reserved the same way in slots[i].managed[gpu]:
 * refused when the group's memory[gpu] + managed[gpu] would pass oversubscribe_limit, or when the
 * managed[] of every live slot on every GPU would pass header.managed_host_limit (the agent's share of
 * the host's memory: managed pages evicted from a GPU need host memory, and a GPU whose managed memory
 * the host cannot back can hang). memory[] stays device memory only, so MemoryLimit keeps bounding it.
 */
#ifndef GEMTRACE_REGION_H
#define GEMTRACE_REGION_H

#include <stdint.h>

#define GT_REGION_MAGIC 0x45434152544d4547ULL /* "GEMTRACE" read as a little-endian uint64 */
#define GT_REGION_VERSION 9u
#define GT_REGION_FILE "region"
#define GT_ATTACH_SOCKET "attach.sock" /* in the state dir: where gates ask for their slots */
#define GT_SLOTS_MEMFD "gemtrace-slots" /* the chunks' memfd names begin so */
#define GT_BELLS_MEMFD "gemtrace-bells" /* the doorbells' memfd name begins so */
#define GT_BELLS_BYTES 4096 /* sizeof(struct gt_bells): one page */

#define GT_MAX_GPUS 8
#define GT_MAX_GROUPS 64
#define GT_MAX_SLOTS 2048
#define GT_SLOT_SIZE 1024  /* sizeof(struct gt_slot), padded: a chunk is a whole number of pages */
#define GT_CHUNK_SLOTS 32  /* slots per chunk: a chunk is one user's */
#define GT_MAX_CHUNKS (GT_MAX_SLOTS / GT_CHUNK_SLOTS)
#define GT_CHUNK_BYTES (GT_CHUNK_SLOTS * GT_SLOT_SIZE)
#define GT_USER_CHUNKS 32  /* the most chunks one user gets: the others always find some */
#define GT_NO_OWNER UINT32_MAX /* chunk_owner[c] of a chunk no user has */
#define GT_NAME_LEN 64 /* group names, NUL-terminated */
#define GT_UUID_LEN 48 /* "GPU-" + 36 characters + NUL, padded */
#define GT_COMM_LEN 16

#define GT_NO_LIMIT UINT64_MAX                     /* memory_limit of a group without one */
#define GT_UTIL_ONE 1000000u                       /* min/max utilisation in parts per million */
#define GT_HEARTBEAT_STALE_NS 2000000000ull        /* gates ignore `held` when the agent is silent this long */
#define GT_HOLD_RECHECK_NS 100000000ull            /* a held launch re-checks the heartbeat this often */
#define GT_QUEUE_BOUND_NS 10000000ull              /* GT_RELEASED_SHORT_QUEUE: the most work left queued */
#define GT_OUTRANKED_QUEUE_BOUND_NS 500000ull      /* GT_RELEASED_OUTRANKED: the same, while outranked */
#define GT_LONG_QUEUE_BOUND_NS 100000000ull        /* GT_RELEASED_LONG_QUEUE: the same, with no hold in sight */
#define GT_BESIDE_KERNELS 2u                       /* GT_RELEASED_BESIDE, production busy: kernels queued */
#define GT_BESIDE_KERNELS_MAX 8u                   /* ... the most GEMTRACE_BESIDE_KERNELS may ask */
#define GT_BESIDE_POLL_NS 100000ull                /* ... with none: how often it looks for production's end */
#define GT_BESIDE_SLOTS 24                         /* production processes control.beside_slots names */
#define GT_BESIDE_MANY 0xFFFFu                     /* beside_n: more than that; count production busy */
#define GT_WAKE_FANOUT 2                           /* held-word waiters a release wakes, and each woken one */
/* A gate waits at most this long at attach for its assignment (usually one keeper tick, 10 ms). Long
 * enough for a process in a pod, whose host pid the agent must find first (a scan of /proc): at 50 ms a
 * pod's first allocation ran as "default", without its limit, in 2 of 3 runs on a busy node. */
#define GT_ASSIGN_WAIT_NS 1000000000ull
#define GT_GROUP_UNASSIGNED UINT32_MAX             /* assigned[i].group before the agent decides */

enum gt_held {
    GT_RELEASED = 0,
    GT_HELD = 1,
    GT_RELEASED_SHORT_QUEUE = 2,
    GT_RELEASED_OUTRANKED = 3,
    GT_RELEASED_LONG_QUEUE = 4,
    GT_RELEASED_BESIDE = 5,
};

/* Attaching (docs/security.md, "Attaching"): what a gate does with its program's CUDA calls while it
 * cannot get a slot from a live agent (header.unattached, the agent's --unattached). It retries all
 * the while, and says so on stderr in one line; a program that never attached has no limit the gate
 * could enforce, and with eBPF on the agent would kill it for what it allocates past its group's. */
enum gt_unattached {
    GT_UNATTACHED_WAIT = 0,    /* its allocations wait until it attaches (the default) */
    GT_UNATTACHED_UNGATED = 1, /* after GT_UNATTACHED_TRY_NS of trying, it runs ungated */
    GT_UNATTACHED_REFUSE = 2,  /* after GT_UNATTACHED_TRY_NS of trying, its allocations fail (NOT_PERMITTED) */
};
#define GT_UNATTACHED_TRY_NS 5000000000ull     /* how long ungated and refuse try before they give up */
#define GT_ATTACH_BACKOFF_MAX_NS 1000000000ull /* retries start at 10 ms and double up to this */

/* The socket's two requests (struct gt_attach_request.kind). */
enum gt_attach_kind {
    GT_ATTACH_JOIN = 1, /* a gate: my user's chunks writable (one with a free slot at least), the rest read-only */
    GT_ATTACH_VIEW = 2, /* an observer: every chunk read-only */
};

/* The reply's status. */
enum gt_attach_status {
    GT_ATTACH_OK = 0,
    GT_ATTACH_FULL = 1,    /* the user has GT_USER_CHUNKS chunks, or there is none left: all slots taken */
    GT_ATTACH_REFUSED = 2, /* a request of another version or kind */
};

enum gt_slot_flags {
    GT_SLOT_GATED = 1u << 0, /* the gate is loaded in this process (always set by gates) */
};

struct gt_header {
    uint64_t magic;              /* GT_REGION_MAGIC, stored last when the agent creates the file */
    uint32_t version;            /* GT_REGION_VERSION; a reader refuses any other */
    uint32_t size;               /* sizeof(struct gt_region) */
    int32_t agent_pid;           /* pid of the agent that owns the region, 0 when none */
    uint32_t n_gpus;             /* entries of gpus[] in use */
    uint64_t heartbeat_ns;       /* agent's last tick; 0 = agent stopped cleanly */
    uint64_t config_generation;  /* bumped whenever groups[] change */
    uint64_t managed_host_limit; /* bytes of managed memory all gated processes together may hold: what
                                    the host can back (0: none; see Oversubscription below) */
    uint64_t chunk_generation;   /* changes whenever chunk_owner[] does: a gate then maps the view again */
    uint64_t region_id;          /* random, set when the file is made: names this region's chunk memfds */
    /* Attaching (version 8): */
    uint32_t unattached;         /* enum gt_unattached: the operator's choice for a gate without a slot */
    uint32_t reserved0;
    uint64_t reserved[7];
};

struct gt_gpu {                  /* agent-owned; index = gpu index used everywhere else */
    char uuid[GT_UUID_LEN];      /* NVML UUID, "GPU-..." */
    uint64_t memory_total;       /* bytes */
    uint64_t reserved[1];
};

struct gt_group {                /* agent-owned; a name keeps its index while a slot refers to it */
    char name[GT_NAME_LEN];      /* empty = unused entry */
    uint64_t memory_limit;       /* bytes per GPU, GT_NO_LIMIT for none */
    uint32_t min_util_ppm;       /* 0..GT_UTIL_ONE */
    uint32_t max_util_ppm;       /* 0..GT_UTIL_ONE */
    uint32_t defined;            /* 1 while the resource file defines the group (gates attach only then) */
    uint32_t reserved0;
    uint64_t oversubscribe_limit; /* bytes per GPU, device and managed together; 0: no oversubscription,
                                     GT_NO_LIMIT: bounded by managed_host_limit only */
    uint64_t reserved[3];
};

struct gt_control {              /* agent-owned, one cache line per GPU and group */
    uint32_t held;               /* futex word: enum gt_held */
    uint16_t beside_n;           /* GT_RELEASED_BESIDE: entries of beside_slots in use, or GT_BESIDE_MANY */
    uint16_t ring_quiet;         /* 1: released while another group waits: a sync that leaves the group
                                    with nothing queued on that GPU rings its doorbell (Launch gating) */
    uint64_t grant_seq;          /* bumped on every release, for observers */
    uint16_t beside_slots[GT_BESIDE_SLOTS]; /* GT_RELEASED_BESIDE: the slots of the GPU's production processes */
};

struct gt_assignment {           /* agent-owned: the group the agent decided for the process in slot i */
    _Alignas(8) int32_t pid;                /* the process it was decided for; any other occupant is unassigned */
    uint32_t group;              /* index into groups[], or GT_GROUP_UNASSIGNED */
};                               /* stored as one 8-byte word, so a reader never sees half of it */

struct gt_slot {                 /* in `slots`, written only by its process (see the top of this file) */
    int32_t pid;                 /* 0 = free; claimed by CAS 0 -> getpid() */
    uint32_t flags;              /* enum gt_slot_flags */
    uint32_t gpu_mask;           /* bit g set once the process used gpus[g] */
    uint32_t reserved0;
    uint64_t start_time;         /* /proc/PID/stat field 22 (clock ticks), tells a reused pid apart */
    char comm[GT_COMM_LEN];
    char requested[GT_NAME_LEN]; /* GEMTRACE_GROUP, NUL-terminated: a wish; the agent decides */
    uint64_t memory[GT_MAX_GPUS];         /* device memory held through the gate */
    uint64_t managed[GT_MAX_GPUS];        /* managed memory held through the gate (oversubscription) */
    uint64_t launches[GT_MAX_GPUS];       /* kernel launches admitted */
    uint64_t busy_ns[GT_MAX_GPUS];        /* GPU time of this process's finished bursts */
    uint64_t burst_start_ns[GT_MAX_GPUS]; /* when the process's last burst opened: its first launch
                                             after it last had nothing queued (0: none yet) */
    uint64_t drained_ns[GT_MAX_GPUS];     /* when a sync (the gate's drain or the process's own) last
                                             covered every launch before it: drained_ns >= burst_start_ns
                                             means nothing is queued */
    uint32_t waiting[GT_MAX_GPUS];        /* threads blocked on control[gpu][group].held */
    /* Issue 25 (Verified memory below): bumped when an allocation would fit but for another user's
     * figure beyond what the agent verified; the agent then looks at the slots at once. */
    uint32_t audit_requests;
    uint32_t reserved1;
    uint64_t reserved[62];                /* to GT_SLOT_SIZE */
};
_Static_assert(sizeof(struct gt_slot) == GT_SLOT_SIZE, "a slot is GT_SLOT_SIZE bytes");
_Static_assert(GT_CHUNK_BYTES % 4096 == 0, "a chunk is a whole number of pages");

/* --- Verified memory (issue 25: no member of a shared group denies the others memory) -------------
 * Agent-owned, one entry per slot: what the agent has checked that the process in slot i holds, from
 * eBPF where it runs (every allocation and free the driver returned), else the slot's own figure
 * clamped by NVML's per-process memory (context included, so an honest slot is never above it), else
 * the slot's figure (nothing to check it with). Rewritten on each eBPF allocation event and each
 * accounting poll. `pid` names the process the figures are for: any other occupant of slot i counts 0
 * until the agent publishes for it. The agent stores pid = 0, then the figures, then the pid, so a
 * reader that reads the same pid before and after a figure read that process's figure.
 * chunk_trusted[c] = 1: other users' gates count chunk c's slots at their own figures, not these.
 * The agent trusts the chunks of every user it has not caught over-reporting (a slot above what its
 * process holds at a poll and again 0.2 s later), and never again, while it runs, those of a user
 * it caught: verified figures lag an allocation (eBPF's event, else a poll), and two users
 * allocating at once each took most of the limit in that lag (docs/gate.md, Memory;
 * docs/security.md). A new chunk is untrusted until the keeper's next tick, which decides before it
 * places the chunk's processes. An allocation that the live figures refuse but the verified ones
 * would allow waits (at most GT_AUDIT_WAIT_NS, hook/memory.c) for the agent to look, having bumped
 * its slot's audit_requests: either the agent catches a false figure and distrusts its user, and the
 * allocation fits, or it verifies the other user's memory, and the allocation is refused. So a false
 * figure delays the others' allocations rather than refusing them. */
struct gt_verified {
    _Alignas(8) int32_t pid;     /* the process these figures are for; 0: none */
    uint32_t reserved0;
    uint64_t memory[GT_MAX_GPUS];  /* device memory, as slots[i].memory */
    uint64_t managed[GT_MAX_GPUS]; /* managed memory, as slots[i].managed */
};

struct gt_region {
    struct gt_header header;
    struct gt_gpu gpus[GT_MAX_GPUS];
    struct gt_group groups[GT_MAX_GROUPS];
    struct gt_control control[GT_MAX_GPUS][GT_MAX_GROUPS];
    struct gt_assignment assigned[GT_MAX_SLOTS];
    uint32_t chunk_owner[GT_MAX_CHUNKS]; /* agent-owned: the uid whose chunk c is, or GT_NO_OWNER */
    struct gt_verified verified[GT_MAX_SLOTS]; /* agent-owned: see Verified memory above */
    uint32_t chunk_trusted[GT_MAX_CHUNKS];     /* agent-owned: 1 where others count the slots' own figures */
};

struct gt_bells {                /* the doorbells: written by anyone, a hint to the agent only */
    uint32_t ring[GT_MAX_GPUS];  /* futex words: a gate adds 1 and wakes (a hold starts, a held drain ends,
                                    a released group watched by ring_quiet goes quiet) */
    uint32_t joined[GT_MAX_GPUS]; /* a gate adds 1 after it sets its slot's gpu_mask bit g: a new user of
                                     gpus[g], which the scheduler scans the slots for only when this moved */
    uint32_t reserved[GT_BELLS_BYTES / 4 - 2 * GT_MAX_GPUS];
};
_Static_assert(sizeof(struct gt_bells) == GT_BELLS_BYTES, "the doorbells are one page");

/* The socket's messages (one each way; the reply carries one descriptor per entry, in order). */
struct gt_attach_request {
    uint32_t version;            /* GT_REGION_VERSION */
    uint32_t kind;               /* enum gt_attach_kind */
};

struct gt_attach_entry {
    uint32_t chunk;              /* map the descriptor at offset chunk * GT_CHUNK_BYTES */
    uint32_t writable;           /* 1: the asker's own user's chunk, sent read-write */
};

struct gt_attach_reply {
    uint32_t version;            /* GT_REGION_VERSION */
    uint32_t status;             /* enum gt_attach_status */
    uint64_t chunk_generation;   /* header.chunk_generation when the view was made */
    uint32_t n_entries;
    uint32_t bells;              /* 1: one more descriptor follows the entries', the doorbells */
    struct gt_attach_entry entries[GT_MAX_CHUNKS];
};

#endif /* GEMTRACE_REGION_H */
