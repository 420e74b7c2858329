/*
 * memory.c - device memory against the group's MemoryLimit, and managed memory past it (Oversubscribe).
 *
 * A group's usage on a GPU is the sum of its processes' slots: our own user's figures as they stand,
 * another user's as they stand until the agent catches that user lying, then as the agent verified
 * them (believed() below, issue 25). An allocation reserves first, in our own slot, then sums the
 * group (hook/gemtrace_region.h: the optimistic protocol): over the limit it takes the reservation
 * back and returns CUDA_ERROR_OUT_OF_MEMORY without calling the driver, so nothing is allocated and
 * no interleaving of processes or threads overshoots (of a user caught lying, believed() says what
 * bound remains). Every byte added is remembered here with its pointer or handle; a release
 * subtracts only what we added, so frees of
 * pointers we never saw, double frees or frees after a crash cannot drive a counter below zero
 * (HAMi's counter underflowed and showed 17 TB in use, with false OOMs: HAMi #1181,
 * https://github.com/Project-HAMi/HAMi/issues/1181). The device comes from the call's own arguments
 * where they name one (cuMemCreate's location: NCCL calls it from threads without a current context,
 * HAMi-core #169, https://github.com/Project-HAMi/HAMi-core/issues/169; a pool's device; a stream's
 * device for the stream-ordered allocators), else from the current context.
 *
 * Oversubscription (Gemini_UM's idea, https://github.com/NTHU-LSALAB/Gemini_UM): in a group whose
 * resource file says Oversubscribe, a cuMemAlloc_v2 that MemoryLimit (or the GPU itself) refuses is
 * served by cuMemAllocManaged instead, which the driver pages between host and GPU, so jobs whose
 * peaks do not coincide share a GPU. That memory is counted apart (slots[i].managed), bounded by the
 * group's total and by what the host can back (hook/gemtrace_region.h), and freed by cuMemFree_v2 as
 * the program expects. Only cuMemAlloc_v2 falls back: it is what the CUDA runtime's cudaMalloc, hence
 * PyTorch's caching allocator, calls; the stream-ordered and virtual-memory allocators hand out memory
 * that managed memory cannot stand in for (a pool's, a handle to map), so they stay within MemoryLimit.
 * Memory served so gets hints (hints below): the GPU as its preferred location and as a processor that
 * accesses it, and, when the scheduler lets the group go after a hold, a prefetch back to the GPU.
 */
#define _GNU_SOURCE
#include "gate.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* --- what we allocated: address or handle -> (bytes, gpu) ----------------------------------------
 * One entry for every allocation the gate counted, taken out by its release whichever call frees it.
 * The managed memory that got hints (hints below) is marked in its entry and chained oldest first,
 * so that the prefetch after a hold walks the same entries, under the same lock, that frees take out:
 * a range leaves the chain before the driver may hand it out again. */

#define GT_BUCKETS 4096
#define GT_UNHINTED (-1) /* hinted_device of an entry without hints */

struct tracked {
    uint64_t key;
    uint64_t bytes;
    int gpu;
    bool managed;           /* counted in slot->managed, not slot->memory */
    CUdevice hinted_device; /* the CUDA device the hints named, GT_UNHINTED */
    struct tracked *next;   /* in its bucket */
    struct tracked *older, *newer; /* in the table's chain of hinted entries */
};

struct table {
    pthread_mutex_t lock;
    struct tracked *bucket[GT_BUCKETS];
    struct tracked *oldest_hinted; /* atomic: read without the lock to skip a prefetch with nothing to do */
    struct tracked *newest_hinted;
};

static struct table pointers = {.lock = PTHREAD_MUTEX_INITIALIZER};
static struct table handles = {.lock = PTHREAD_MUTEX_INITIALIZER};

static unsigned bucket_of(uint64_t key) { return (unsigned)((key >> 9) * 0x9E3779B97F4A7C15ull >> 52) % GT_BUCKETS; }

/* A new entry, or one whose release the driver refused; a hinted one goes to the newest end. */
static void insert(struct table *t, struct tracked *e)
{
    pthread_mutex_lock(&t->lock);
    unsigned b = bucket_of(e->key);
    e->next = t->bucket[b];
    t->bucket[b] = e;
    if (e->hinted_device != GT_UNHINTED) {
        e->older = t->newest_hinted;
        e->newer = NULL;
        if (e->older)
            e->older->newer = e;
        else
            __atomic_store_n(&t->oldest_hinted, e, __ATOMIC_RELEASE);
        t->newest_hinted = e;
    }
    pthread_mutex_unlock(&t->lock);
}

static void track(struct table *t, uint64_t key, uint64_t bytes, int gpu, bool managed, CUdevice hinted_device)
{
    struct tracked *e = malloc(sizeof *e);
    if (!e)
        return; /* the reservation stays counted: better an over-count than an underflow */
    *e = (struct tracked){.key = key, .bytes = bytes, .gpu = gpu, .managed = managed, .hinted_device = hinted_device};
    insert(t, e);
}

/* The entry of key, out of the table (the caller frees it or puts it back), or NULL. */
static struct tracked *untrack(struct table *t, uint64_t key)
{
    pthread_mutex_lock(&t->lock);
    struct tracked **p = &t->bucket[bucket_of(key)];
    while (*p && (*p)->key != key)
        p = &(*p)->next;
    struct tracked *e = *p;
    if (e) {
        *p = e->next;
        if (e->hinted_device != GT_UNHINTED) {
            if (e->older)
                e->older->newer = e->newer;
            else
                __atomic_store_n(&t->oldest_hinted, e->newer, __ATOMIC_RELEASE);
            if (e->newer)
                e->newer->older = e->older;
            else
                t->newest_hinted = e->older;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return e;
}

/* --- pools: which CUDA device a pool's memory lives on ---------------------------------------------
 * The driver cannot be asked, so pools we see created are remembered (a destroyed pool's address
 * reused by a new one is simply overwritten); the devices' default and current pools are matched by
 * asking the driver for them. */

#define GT_POOLS 256

static struct {
    CUmemoryPool pool;
    CUdevice device;
} pools[GT_POOLS];
static unsigned pools_next;
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;

static void remember_pool(CUmemoryPool pool, CUdevice device)
{
    pthread_mutex_lock(&pools_lock);
    unsigned i = 0;
    while (i < GT_POOLS && pools[i].pool != pool)
        i++;
    if (i == GT_POOLS)
        i = pools_next++ % GT_POOLS; /* more than 256 live pools: the oldest record goes */
    pools[i].pool = pool;
    pools[i].device = device;
    pthread_mutex_unlock(&pools_lock);
}

static CUdevice device_of_pool(CUmemoryPool pool)
{
    CUdevice device = -1;
    pthread_mutex_lock(&pools_lock);
    for (unsigned i = 0; i < GT_POOLS && device < 0; i++)
        if (pools[i].pool == pool)
            device = pools[i].device;
    pthread_mutex_unlock(&pools_lock);
    int count = 0;
    if (device < 0 && GT_REAL(cuDeviceGetCount) && gt_real.cuDeviceGetCount(&count) == CUDA_SUCCESS) {
        for (CUdevice d = 0; d < count && device < 0; d++) {
            CUmemoryPool p = NULL;
            if ((GT_REAL(cuDeviceGetDefaultMemPool) && gt_real.cuDeviceGetDefaultMemPool(&p, d) == CUDA_SUCCESS &&
                 p == pool) ||
                (GT_REAL(cuDeviceGetMemPool) && gt_real.cuDeviceGetMemPool(&p, d) == CUDA_SUCCESS && p == pool))
                device = d;
        }
    }
    return device;
}

GT_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    if (!GT_REAL(cuMemPoolCreate))
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = gt_real.cuMemPoolCreate(pool, props);
    if (r == CUDA_SUCCESS && pool && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        remember_pool(*pool, props->location.id);
    return r;
}

/* --- the group's usage and the reservation protocol ----------------------------------------------- */

/* Only the agent frees a dead process's slot; while it is away (a stale heartbeat) nobody does, and a
 * group would be refused allocations that fit because of memory that went with its dead processes.
 * So then, and only on the allocation path, a slot whose process no longer exists is not counted (it
 * stays for the agent to free). kill(pid, 0) is one cheap system call and reads no /proc; a reused
 * pid or a zombie still counts: an over-count, never an overshoot, since a process's device memory
 * is gone once its pid is (ESRCH). The pid is the one the gate stored (getpid()): the same pid
 * namespace that the agent's reaper assumes. errno is the caller's, so it is put back. */
static bool owner_gone(int32_t pid)
{
    int saved = errno;
    bool gone = pid != (int32_t)getpid() && kill(pid, 0) == -1 && errno == ESRCH;
    errno = saved;
    return gone;
}

/* A chunk not yet mapped reads as free slots, so a sum must see every chunk the agent has made: a
 * thread that finds another thread of its process mapping new chunks (gt_refresh_slots tries once
 * and moves on) waits for it, while the agent answers, at most GT_VIEW_WAIT_NS. Without the wait two
 * users' processes starting together each took most of a shared group's limit: 2.7 to 3.3 GiB held
 * in a 2 GiB group, in 3 of 8 runs of tests/test_trust.py's concurrent members. The allocation path
 * only; a launch never waits. */
#define GT_VIEW_WAIT_NS 1000000000ull
#define GT_VIEW_POLL_NS 100000L

static bool view_stale(void)
{
    return __atomic_load_n(&gt_proc.region->header.chunk_generation, __ATOMIC_ACQUIRE) !=
           __atomic_load_n(&gt_proc.view_generation, __ATOMIC_ACQUIRE);
}

static void current_view(void)
{
    gt_refresh_slots();
    uint64_t deadline = 0;
    while (view_stale() && gt_agent_alive()) {
        uint64_t now = gt_now_ns();
        if (!deadline)
            deadline = now + GT_VIEW_WAIT_NS;
        else if (now >= deadline)
            break; /* the agent does not answer: sum the table as it is */
        int saved = errno;
        nanosleep(&(struct timespec){.tv_nsec = GT_VIEW_POLL_NS}, NULL);
        errno = saved;
        gt_refresh_slots();
    }
}

/* Whether slot i is in a chunk of our own user: the only slots whose own figures we believe. */
static bool own_users_slot(uint32_t i)
{
    const uint32_t *owner = gt_proc.region->chunk_owner;
    return __atomic_load_n(&owner[i / GT_CHUNK_SLOTS], __ATOMIC_RELAXED) ==
           __atomic_load_n(&owner[gt_proc.slot_index / GT_CHUNK_SLOTS], __ATOMIC_RELAXED);
}

/* What slot i, claimed by pid, holds on gpu as far as this gate believes (issue 25). A slot is its
 * user's word: any of that user's processes may write any figure there. Our own user's figures are
 * believed as they stand: they bind only our user. Another user's are believed while the agent
 * trusts that user (chunk_trusted): live figures are what keeps two users allocating at once within
 * the limit, since the agent's verified ones lag each allocation. A user the agent caught claiming
 * more than its processes hold counts at what the agent verified they hold (the region's verified[],
 * which no user can write): a huge figure written there then denies nobody memory. With no agent (a
 * stale heartbeat) nothing is verified any more, and every slot's own figure counts. */
static uint64_t believed(uint32_t i, int32_t pid, int gpu, bool managed, bool agent_away, bool verified_only)
{
    const struct gt_slot *s = &gt_proc.slots[i];
    if (agent_away || own_users_slot(i))
        return __atomic_load_n(managed ? &s->managed[gpu] : &s->memory[gpu], __ATOMIC_SEQ_CST);
    /* Another user's slot counts only once the agent has placed its process (a gate waits for that
     * before it allocates), and only on a GPU its gpu_mask names (a gate sets the bit before it counts
     * anything there): a slot the agent never places, naming someone else's pid, would otherwise
     * count in "default" unaudited, and a figure on a GPU outside the mask is one the audit never
     * reads. */
    struct gt_assignment a;
    __atomic_load(&gt_proc.region->assigned[i], &a, __ATOMIC_ACQUIRE);
    if (a.pid != pid || !(__atomic_load_n(&s->gpu_mask, __ATOMIC_ACQUIRE) & (1u << gpu)))
        return 0;
    if (!verified_only && __atomic_load_n(&gt_proc.region->chunk_trusted[i / GT_CHUNK_SLOTS], __ATOMIC_RELAXED))
        return __atomic_load_n(managed ? &s->managed[gpu] : &s->memory[gpu], __ATOMIC_SEQ_CST);
    const struct gt_verified *v = &gt_proc.region->verified[i];
    if (__atomic_load_n(&v->pid, __ATOMIC_ACQUIRE) != pid)
        return 0; /* not yet verified for this process: the agent publishes within its next look */
    uint64_t bytes = __atomic_load_n(managed ? &v->managed[gpu] : &v->memory[gpu], __ATOMIC_ACQUIRE);
    return __atomic_load_n(&v->pid, __ATOMIC_ACQUIRE) == pid ? bytes : 0; /* the agent moved it meanwhile */
}

/* The sum over the group's live slots of memory[gpu] (device) or managed[gpu], as believed;
 * `verified_only`: every other user's slot at what the agent verified, trusted or not. */
static uint64_t group_sum_of(int gpu, bool managed, bool verified_only)
{
    current_view();
    struct gt_slot *slots = gt_proc.slots;
    uint32_t group = gt_group();
    bool agent_away = !gt_agent_alive();
    uint64_t sum = 0;
    for (uint32_t i = 0; i < GT_MAX_SLOTS; i++) {
        struct gt_slot *s = &slots[i];
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST);
        if (pid == 0 || gt_group_of(i, pid) != group)
            continue;
        uint64_t bytes = believed(i, pid, gpu, managed, agent_away, verified_only);
        if (bytes && agent_away && owner_gone(pid))
            continue;
        sum += bytes;
    }
    return sum;
}

static uint64_t group_sum(int gpu, bool managed) { return group_sum_of(gpu, managed, false); }

static uint64_t group_usage(int gpu) { return group_sum(gpu, false); }

/* The managed memory of every live slot on every GPU: what the host must be able to back. */
static uint64_t host_managed_usage(void)
{
    current_view();
    struct gt_slot *slots = gt_proc.slots;
    bool agent_away = !gt_agent_alive();
    uint64_t sum = 0;
    for (uint32_t i = 0; i < GT_MAX_SLOTS; i++) {
        struct gt_slot *s = &slots[i];
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST);
        if (pid == 0)
            continue;
        uint64_t bytes = 0;
        for (int g = 0; g < GT_MAX_GPUS; g++)
            bytes += believed(i, pid, g, true, agent_away, false);
        if (bytes && agent_away && owner_gone(pid))
            continue;
        sum += bytes;
    }
    return sum;
}

static uint64_t group_limit(void)
{
    return __atomic_load_n(&gt_proc.region->groups[gt_group()].memory_limit, __ATOMIC_ACQUIRE);
}

/* 0: the group does not oversubscribe; GT_NO_LIMIT: it does, bounded by the host only. */
static uint64_t group_oversubscribe(void)
{
    return __atomic_load_n(&gt_proc.region->groups[gt_group()].oversubscribe_limit, __ATOMIC_ACQUIRE);
}

/* Device and managed memory together past the group's Oversubscribe size. */
static bool over_total(int gpu)
{
    uint64_t bound = group_oversubscribe();
    return bound != 0 && bound != GT_NO_LIMIT && group_sum(gpu, false) + group_sum(gpu, true) > bound;
}

static void unreserve(int gpu, uint64_t bytes)
{
    __atomic_fetch_sub(&gt_proc.slot->memory[gpu], bytes, __ATOMIC_SEQ_CST);
}

/* Over the limit by the live figures (our reservation of `bytes` taken back): if the verified ones
 * would let the allocation fit, another user's figure beyond what the agent verified decides it,
 * either a reservation the agent has not seen answered yet or a false figure (issue 25). Ask the
 * agent to look now and wait, at most GT_AUDIT_WAIT_NS: true, with the reservation made again, once
 * the sum fits (the agent caught a false figure and distrusts its user); false once the verified
 * figures no longer fit either (the other user's memory was real), or when the agent goes away. A
 * false figure so delays the others' allocations, never refuses them. While we wait our slot shows
 * only what we hold, so that the agent's look does not take our own reservation for a false figure.
 * The allocation path only, and only near the limit. */
#define GT_AUDIT_WAIT_NS 1000000000ull /* a look comes within the agent's poll loop's tick and 0.2 s */
#define GT_AUDIT_POLL_NS 1000000L

static bool fits_once_verified(int gpu, uint64_t limit, uint64_t bytes)
{
    if (!gt_agent_alive() || group_sum_of(gpu, false, true) + bytes > limit)
        return false;
    __atomic_fetch_add(&gt_proc.slot->audit_requests, 1, __ATOMIC_RELEASE);
    uint64_t deadline = gt_now_ns() + GT_AUDIT_WAIT_NS;
    int saved = errno;
    bool fits = false;
    while (!fits && gt_now_ns() < deadline) {
        nanosleep(&(struct timespec){.tv_nsec = GT_AUDIT_POLL_NS}, NULL);
        if (group_usage(gpu) + bytes <= limit) {
            __atomic_fetch_add(&gt_proc.slot->memory[gpu], bytes, __ATOMIC_SEQ_CST);
            fits = group_usage(gpu) <= limit; /* the optimistic protocol again: another may have come */
            if (!fits)
                unreserve(gpu, bytes);
        } else if (!gt_agent_alive() || group_sum_of(gpu, false, true) + bytes > limit) {
            break;
        }
    }
    errno = saved;
    return fits;
}

/* Device memory: within MemoryLimit and, in an oversubscribing group, within its total, so that
 * device memory regrown after managed memory was taken cannot carry the sum past it. */
static CUresult reserve(int gpu, uint64_t bytes)
{
    __atomic_fetch_add(&gt_proc.slot->memory[gpu], bytes, __ATOMIC_SEQ_CST);
    uint64_t limit = group_limit();
    if (limit != GT_NO_LIMIT && group_usage(gpu) > limit) {
        unreserve(gpu, bytes);
        if (!fits_once_verified(gpu, limit, bytes))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (over_total(gpu)) {
        unreserve(gpu, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

/* What the process was told once on stderr (atomic bits: any thread may be first). */
enum { SAID_MANAGED = 1u, SAID_HOST_BOUND = 2u, SAID_GROUP_BOUND = 4u };
static unsigned said;

static bool first_time(unsigned what) { return !(__atomic_fetch_or(&said, what, __ATOMIC_RELAXED) & what); }

static const char *group_name(void) { return gt_proc.region->groups[gt_group()].name; }

static void unreserve_managed(int gpu, uint64_t bytes)
{
    __atomic_fetch_sub(&gt_proc.slot->managed[gpu], bytes, __ATOMIC_SEQ_CST);
}

/* Managed memory: within the group's total and within what the host backs for all gated processes.
 * A host bound of 0 (an agent that never set it) allows none. */
static CUresult reserve_managed(int gpu, uint64_t bytes)
{
    __atomic_fetch_add(&gt_proc.slot->managed[gpu], bytes, __ATOMIC_SEQ_CST);
    uint64_t host = __atomic_load_n(&gt_proc.region->header.managed_host_limit, __ATOMIC_ACQUIRE);
    bool host_full = host_managed_usage() > host;
    bool group_full = !host_full && over_total(gpu);
    if (!host_full && !group_full)
        return CUDA_SUCCESS;
    unreserve_managed(gpu, bytes);
    if (host_full && first_time(SAID_HOST_BOUND))
        fprintf(stderr,
                "gemtrace gate: refused %llu bytes of managed memory: gated programs together may hold %llu bytes "
                "of it, what this host backs (gemtrace agent --managed-host-limit); the GPU could hang past it. "
                "Free memory, or run fewer oversubscribing jobs at once.\n",
                (unsigned long long)bytes, (unsigned long long)host);
    if (group_full && first_time(SAID_GROUP_BOUND))
        fprintf(stderr,
                "gemtrace gate: refused %llu bytes: group %s would hold more than its Oversubscribe size of %llu "
                "bytes on GPU %d, device and managed memory together.\n",
                (unsigned long long)bytes, group_name(), (unsigned long long)group_oversubscribe(), gpu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* --- hints for managed memory served in place of device memory ----------------------------------
 * The program asked for device memory and its kernels use it as such: so the driver is told that the
 * GPU is where the pages belong (CU_MEM_ADVISE_SET_PREFERRED_LOCATION: a GPU fault brings them there,
 * and eviction is the driver's last resort) and that the GPU uses them (SET_ACCESSED_BY: kept mapped
 * there, so an access to a page the driver left on the host reads it over the link instead of
 * faulting). While the scheduler holds the group, the group that runs evicts those pages; when it lets
 * the group go, the first launch that waited prefetches them back (cuMemPrefetchAsync on its own
 * stream, before its kernel): one bulk migration instead of a fault per page. At most
 * prefetch_max bytes a release, the oldest allocations first (a training job's weights and optimizer
 * state come first), once per release and process (control.grant_seq): a walk of the hinted entries
 * of the pointers table (above), under the lock its allocations and frees take; the launch fast path
 * never sees it. Off unless GEMTRACE_MANAGED_HINTS=1: where two jobs page each other's memory out at
 * every switch, the hints cost more than the faults they save (bench/results/oversubscribe.md). The
 * program's own cuMemAllocManaged gets no hints: its advice is its own business. */

#define GT_PREFETCH_MAX_DEFAULT (4ull << 30) /* bytes one prefetch moves, unless GEMTRACE_MANAGED_PREFETCH_MAX */

static bool hints_on = false;
static uint64_t prefetch_max = GT_PREFETCH_MAX_DEFAULT;
static uint64_t prefetched_seq[GT_MAX_GPUS]; /* the control word's grant_seq this process last prefetched at */

/* "4GiB", "512M", "1073741824": bytes (powers of 1024); false when the text is no size. */
static bool parse_bytes(const char *text, uint64_t *bytes)
{
    const char *end;
    uint64_t v;
    if (!gt_parse_decimal(text, &end, &v))
        return false;
    int shift = 0;
    switch (*end) {
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    default: break;
    }
    if (shift && (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0))
        end += strlen(end);
    if (*end || (shift && v > (UINT64_MAX >> shift)))
        return false;
    *bytes = (uint64_t)v << shift;
    return true;
}

static void read_hint_options(void)
{
    int saved = errno;
    const char *on = getenv(GT_ENV_MANAGED_HINTS);
    if (on && strcmp(on, "1") == 0)
        hints_on = true;
    else if (on && *on && strcmp(on, "0") != 0)
        fprintf(stderr, "gemtrace gate: %s=%s is neither 0 nor 1; the managed memory hints stay off.\n",
                GT_ENV_MANAGED_HINTS, on);
    const char *max = getenv(GT_ENV_MANAGED_PREFETCH_MAX);
    if (max && *max && !parse_bytes(max, &prefetch_max)) {
        prefetch_max = GT_PREFETCH_MAX_DEFAULT;
        fprintf(stderr, "gemtrace gate: %s=%s is not a size (bytes, or 512MiB, 4GiB); prefetching at most %llu "
                "bytes after a hold.\n", GT_ENV_MANAGED_PREFETCH_MAX, max, (unsigned long long)prefetch_max);
    }
    errno = saved;
}

static CUmemLocation on_device(CUdevice device)
{
    return (CUmemLocation){.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
}

/* Advice for managed memory just served in place of cuMemAlloc_v2's; the CUDA device it named, for
 * the prefetch, or GT_UNHINTED. The driver's answers are not the program's business: an allocation
 * without advice still works. */
static CUdevice give_hints(CUdeviceptr ptr, uint64_t bytes)
{
    CUdevice device;
    if (!hints_on || !GT_REAL(cuCtxGetDevice) || gt_real.cuCtxGetDevice(&device) != CUDA_SUCCESS)
        return GT_UNHINTED;
    if (GT_REAL(cuMemAdvise_v2)) {
        gt_real.cuMemAdvise_v2(ptr, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, on_device(device));
        gt_real.cuMemAdvise_v2(ptr, bytes, CU_MEM_ADVISE_SET_ACCESSED_BY, on_device(device));
    }
    return device;
}

void gt_prefetch_managed(int gpu, CUstream stream, uint32_t group)
{
    if (!prefetch_max || !__atomic_load_n(&pointers.oldest_hinted, __ATOMIC_ACQUIRE) ||
        !GT_REAL(cuMemPrefetchAsync_v2))
        return;
    /* Once per release: the first of the process's waiting threads to get here. */
    uint64_t seq = __atomic_load_n(&gt_proc.region->control[gpu][group].grant_seq, __ATOMIC_ACQUIRE);
    uint64_t last = __atomic_load_n(&prefetched_seq[gpu], __ATOMIC_RELAXED);
    if (last == seq || !__atomic_compare_exchange_n(&prefetched_seq[gpu], &last, seq, false, __ATOMIC_ACQ_REL,
                                                    __ATOMIC_RELAXED))
        return;
    uint64_t left = prefetch_max;
    /* Held across the calls, which only queue the migrations: no range is freed while it is named. */
    pthread_mutex_lock(&pointers.lock);
    for (struct tracked *e = pointers.oldest_hinted; e && left > 0; e = e->newer) {
        if (e->gpu != gpu)
            continue;
        uint64_t bytes = e->bytes < left ? e->bytes : left;
        if (gt_real.cuMemPrefetchAsync_v2(e->key, bytes, on_device(e->hinted_device), 0, stream) == CUDA_SUCCESS)
            left -= bytes;
    }
    pthread_mutex_unlock(&pointers.lock);
}

/* After fork: the parent's allocations are not the child's. The entries leak (malloc after fork in a
 * threaded parent is not safe to call here); the child starts with empty tables and free locks, and
 * prefetches at its own first release. */
static void forget_table_in_child(struct table *t)
{
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->lock, NULL);
}

static void after_fork_in_child(void)
{
    forget_table_in_child(&pointers);
    forget_table_in_child(&handles);
    pthread_mutex_init(&pools_lock, NULL);
    memset(prefetched_seq, 0, sizeof prefetched_seq);
}

GT_CONSTRUCTOR_MEMORY static void memory_init(void)
{
    read_hint_options();
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* cuMemAlloc_v2 past the group's device share, in an oversubscribing group: managed memory. */
static CUresult allocate_managed(int gpu, CUdeviceptr *dptr, size_t bytes)
{
    if (!GT_REAL(cuMemAllocManaged))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = reserve_managed(gpu, bytes);
    if (r != CUDA_SUCCESS)
        return r;
    r = gt_real.cuMemAllocManaged(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
    if (r != CUDA_SUCCESS) {
        unreserve_managed(gpu, bytes);
        return r;
    }
    track(&pointers, (uint64_t)*dptr, bytes, gpu, true, give_hints(*dptr, bytes));
    if (first_time(SAID_MANAGED))
        fprintf(stderr,
                "gemtrace gate: group %s is past its device memory on GPU %d: allocations beyond it are managed "
                "memory (Oversubscribe), which the driver pages between host and GPU.\n",
                group_name(), gpu);
    return CUDA_SUCCESS;
}

/* An allocation of a program that could not attach, where the operator chose to refuse those
 * (gemtrace agent --unattached=refuse; attach.c said so on stderr). */
#define GPU_REFUSED (-2)
#define UNATTACHED() (gt_attach_refused() ? GPU_REFUSED : -1)

/* The GPU an allocation lands on, or -1 when the gate does not count it (not attached, unknown GPU),
 * or GPU_REFUSED. */
static int gpu_for_allocation(void)
{
    if (!gt_attached() && !gt_attach_slow(true))
        return UNATTACHED();
    return gt_proc.single_gpu >= 0 ? gt_proc.single_gpu : gt_current_gpu();
}

static int gpu_for_device(CUdevice device)
{
    if (!gt_attached() && !gt_attach_slow(true))
        return UNATTACHED();
    int gpu = gt_gpu_of_device(device);
    if (gpu >= 0)
        gt_note_gpu(gpu);
    return gpu;
}

/* Stream-ordered allocations come from the stream's device (its current pool). */
static int gpu_for_stream(CUstream stream)
{
    if (!gt_attached() && !gt_attach_slow(true))
        return UNATTACHED();
    return gt_proc.single_gpu >= 0 ? gt_proc.single_gpu : gt_stream_gpu(stream);
}

static int gpu_for_pool(CUmemoryPool pool, CUstream stream)
{
    if (!gt_attached() && !gt_attach_slow(true))
        return UNATTACHED();
    if (gt_proc.single_gpu >= 0)
        return gt_proc.single_gpu;
    CUdevice device = device_of_pool(pool);
    return device >= 0 ? gpu_for_device(device) : gt_stream_gpu(stream);
}

/* Reserve, allocate through `call`, then remember the pointer; shared by every pointer allocator. */
#define GT_ALLOCATE(gpu, bytes, dptr, call)                                                         \
    do {                                                                                            \
        int gpu_ = (gpu);                                                                           \
        if (gpu_ == GPU_REFUSED)                                                                    \
            return CUDA_ERROR_NOT_PERMITTED;                                                        \
        if (gpu_ < 0)                                                                               \
            return (call);                                                                          \
        CUresult reserved_ = reserve(gpu_, (bytes));                                                \
        if (reserved_ != CUDA_SUCCESS)                                                              \
            return reserved_;                                                                       \
        CUresult r_ = (call);                                                                       \
        if (r_ == CUDA_SUCCESS)                                                                     \
            track(&pointers, (uint64_t)*(dptr), (bytes), gpu_, false, GT_UNHINTED);                 \
        else                                                                                        \
            unreserve(gpu_, (bytes));                                                               \
        return r_;                                                                                  \
    } while (0)

/* In an oversubscribing group: device memory while MemoryLimit and the GPU allow it, else managed. */
GT_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    if (!GT_REAL(cuMemAlloc_v2))
        return CUDA_ERROR_NOT_FOUND;
    int gpu = gpu_for_allocation();
    if (gpu < 0 || !dptr || bytes == 0 || group_oversubscribe() == 0)
        GT_ALLOCATE(gpu, bytes, dptr, gt_real.cuMemAlloc_v2(dptr, bytes));
    CUresult r = reserve(gpu, bytes);
    if (r == CUDA_SUCCESS) {
        r = gt_real.cuMemAlloc_v2(dptr, bytes);
        if (r == CUDA_SUCCESS) {
            track(&pointers, (uint64_t)*dptr, bytes, gpu, false, GT_UNHINTED);
            return r;
        }
        unreserve(gpu, bytes);
        if (r != CUDA_ERROR_OUT_OF_MEMORY)
            return r;
    }
    return allocate_managed(gpu, dptr, bytes);
}

/* The program's own managed memory: counted as managed in an oversubscribing group (bounded as
 * that is), else as device memory against MemoryLimit (its pages may all be resident). */
GT_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    if (!GT_REAL(cuMemAllocManaged))
        return CUDA_ERROR_NOT_FOUND;
    int gpu = gpu_for_allocation();
    if (gpu < 0 || !dptr || bytes == 0 || group_oversubscribe() == 0)
        GT_ALLOCATE(gpu, bytes, dptr, gt_real.cuMemAllocManaged(dptr, bytes, flags));
    CUresult r = reserve_managed(gpu, bytes);
    if (r != CUDA_SUCCESS)
        return r;
    r = gt_real.cuMemAllocManaged(dptr, bytes, flags);
    if (r == CUDA_SUCCESS)
        track(&pointers, (uint64_t)*dptr, bytes, gpu, true, GT_UNHINTED);
    else
        unreserve_managed(gpu, bytes);
    return r;
}

GT_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    if (!GT_REAL(cuMemAllocAsync))
        return CUDA_ERROR_NOT_FOUND;
    GT_ALLOCATE(gpu_for_stream(stream), bytes, dptr, gt_real.cuMemAllocAsync(dptr, bytes, stream));
}

GT_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    if (!GT_REAL(cuMemAllocAsync_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    GT_ALLOCATE(gpu_for_stream(stream), bytes, dptr, gt_real.cuMemAllocAsync_ptsz(dptr, bytes, stream));
}

GT_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream)
{
    if (!GT_REAL(cuMemAllocFromPoolAsync))
        return CUDA_ERROR_NOT_FOUND;
    GT_ALLOCATE(gpu_for_pool(pool, stream), bytes, dptr, gt_real.cuMemAllocFromPoolAsync(dptr, bytes, pool, stream));
}

GT_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                CUstream stream)
{
    if (!GT_REAL(cuMemAllocFromPoolAsync_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    GT_ALLOCATE(gpu_for_pool(pool, stream), bytes, dptr, gt_real.cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, stream));
}

/* The pitch is the driver's choice: reserve the unpadded size first, then the padding it added. */
GT_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                      unsigned int element_bytes)
{
    if (!GT_REAL(cuMemAllocPitch_v2))
        return CUDA_ERROR_NOT_FOUND;
    int gpu = gpu_for_allocation();
    if (gpu == GPU_REFUSED)
        return CUDA_ERROR_NOT_PERMITTED;
    if (gpu < 0)
        return gt_real.cuMemAllocPitch_v2(dptr, pitch, width, height, element_bytes);
    uint64_t estimate = (uint64_t)width * height;
    CUresult r = reserve(gpu, estimate);
    if (r != CUDA_SUCCESS)
        return r;
    r = gt_real.cuMemAllocPitch_v2(dptr, pitch, width, height, element_bytes);
    if (r != CUDA_SUCCESS) {
        unreserve(gpu, estimate);
        return r;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > estimate && reserve(gpu, actual - estimate) != CUDA_SUCCESS) {
        if (GT_REAL(cuMemFree_v2))
            gt_real.cuMemFree_v2(*dptr);
        unreserve(gpu, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(&pointers, (uint64_t)*dptr, actual > estimate ? actual : estimate, gpu, false, GT_UNHINTED);
    return CUDA_SUCCESS;
}

GT_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    if (!GT_REAL(cuMemCreate))
        return CUDA_ERROR_NOT_FOUND;
    int gpu = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? gpu_for_device(prop->location.id) : -1;
    if (gpu == GPU_REFUSED)
        return CUDA_ERROR_NOT_PERMITTED;
    if (gpu < 0)
        return gt_real.cuMemCreate(handle, bytes, prop, flags);
    CUresult r = reserve(gpu, bytes);
    if (r != CUDA_SUCCESS)
        return r;
    r = gt_real.cuMemCreate(handle, bytes, prop, flags);
    if (r == CUDA_SUCCESS)
        track(&handles, (uint64_t)*handle, bytes, gpu, false, GT_UNHINTED);
    else
        unreserve(gpu, bytes);
    return r;
}

/* Releases: forget first, so that an address the driver reuses for another thread's allocation at
 * once is not forgotten in its place, and so that no prefetch names a range the driver may hand out
 * again; put it back if the driver refuses the release. */
#define GT_RELEASE(table, key, call)                                                                \
    do {                                                                                            \
        struct tracked *e_ = gt_attached() ? untrack((table), (key)) : NULL;                        \
        CUresult r_ = (call);                                                                       \
        if (e_ && r_ != CUDA_SUCCESS) {                                                             \
            insert((table), e_);                                                                    \
        } else if (e_) {                                                                            \
            if (e_->managed)                                                                        \
                unreserve_managed(e_->gpu, e_->bytes);                                              \
            else                                                                                    \
                unreserve(e_->gpu, e_->bytes);                                                      \
            free(e_);                                                                               \
        }                                                                                           \
        return r_;                                                                                  \
    } while (0)

GT_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    if (!GT_REAL(cuMemFree_v2))
        return CUDA_ERROR_NOT_FOUND;
    GT_RELEASE(&pointers, (uint64_t)dptr, gt_real.cuMemFree_v2(dptr));
}

GT_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    if (!GT_REAL(cuMemFreeAsync))
        return CUDA_ERROR_NOT_FOUND;
    GT_RELEASE(&pointers, (uint64_t)dptr, gt_real.cuMemFreeAsync(dptr, stream));
}

GT_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    if (!GT_REAL(cuMemFreeAsync_ptsz))
        return CUDA_ERROR_NOT_FOUND;
    GT_RELEASE(&pointers, (uint64_t)dptr, gt_real.cuMemFreeAsync_ptsz(dptr, stream));
}

GT_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (!GT_REAL(cuMemRelease))
        return CUDA_ERROR_NOT_FOUND;
    GT_RELEASE(&handles, (uint64_t)handle, gt_real.cuMemRelease(handle));
}

/* The group's limit as total, what the group has left (never more than the device has) as free. */
GT_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    if (!GT_REAL(cuMemGetInfo_v2))
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = gt_real.cuMemGetInfo_v2(free_bytes, total_bytes);
    if (r != CUDA_SUCCESS || !free_bytes || !total_bytes)
        return r;
    int gpu = gpu_for_allocation();
    uint64_t limit = gpu >= 0 ? group_limit() : GT_NO_LIMIT;
    if (limit == GT_NO_LIMIT)
        return r;
    uint64_t used = group_usage(gpu);
    uint64_t left = used < limit ? limit - used : 0;
    if (limit < *total_bytes)
        *total_bytes = limit;
    if (left < *free_bytes)
        *free_bytes = left;
    return r;
}
