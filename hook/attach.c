/*
 * attach.c - the process's attachment to the region: mapping it, claiming a slot, knowing its GPUs.
 *
 * Attaching happens lazily on the first gated call, never in a constructor, so a program that never
 * uses CUDA sees no difference. It is O(1) in the number of live processes: the slot search starts
 * at a hash of the pid and claims with one CAS (HAMi's start-up took about a minute with hundreds of
 * processes on a node: HAMi #1662, https://github.com/Project-HAMi/HAMi/issues/1662). The region is
 * mapped read-only, the slots file read-write; the gate asks for a group (GEMTRACE_GROUP, written in
 * its slot) and the agent decides (gemtrace_region.h). Without the two files, or with files of
 * another layout version, the gate says so once on stderr and passes everything through, retrying at
 * most once a second (the agent may start after the program).
 */
#define _GNU_SOURCE
#include "gate.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct gt_process gt_proc = {.single_gpu = -1};

static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t last_attempt_ns;
static unsigned said; /* bit per message kind already printed */

enum { SAID_NO_REGION = 1, SAID_VERSION = 2, SAID_GROUP = 4, SAID_FULL = 8, SAID_FOREIGN = 16, SAID_UNASSIGNED = 32,
       SAID_NO_DEFAULT = 64 };

uint64_t gt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void say_once(unsigned kind, const char *fmt, ...)
{
    if (said & kind)
        return;
    said |= kind;
    va_list ap;
    va_start(ap, fmt);
    fputs("gemtrace gate: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

bool gt_agent_alive(void)
{
    const struct gt_region *r = gt_proc.region;
    uint64_t beat = __atomic_load_n(&r->header.heartbeat_ns, __ATOMIC_ACQUIRE);
    return beat != 0 && gt_now_ns() - beat < GT_HEARTBEAT_STALE_NS;
}

/* /proc/self/stat field 22, the process's start time: tells a reused pid apart for the agent. */
static uint64_t read_start_time(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    if (!p)
        return 0;
    /* after ") " comes field 3; field 22 is 19 fields further */
    p += 2;
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

/* Open one of the agent's files and check its header before mapping it: a file of another layout,
 * or one shorter than its layout (a mapping past the end of a file is SIGBUS on first touch), is
 * refused. Returns the mapping or NULL. */
static void *map_file(const char *dir, const char *name, uint64_t magic, size_t size, bool writable)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        say_once(SAID_NO_REGION, "cannot open %s (%s): is the gemtrace agent running? Running ungated for now.",
                 path, strerror(errno));
        return NULL;
    }
    struct { uint64_t magic; uint32_t version; uint32_t size; } header; /* the head of both files' headers */
    struct stat st;
    if (fstat(fd, &st) != 0 || pread(fd, &header, sizeof header, 0) != (ssize_t)sizeof header) {
        close(fd);
        return NULL;
    }
    if (header.magic != magic) {
        say_once(SAID_FOREIGN, "%s is not a gemtrace file of its kind; running ungated.", path);
        close(fd);
        return NULL;
    }
    if (header.version != GT_REGION_VERSION || header.size != size || (size_t)st.st_size < size) {
        say_once(SAID_VERSION,
                 "%s has layout version %u, this gate speaks version %u; running ungated "
                 "(restart the program under the agent's gate of the same version).",
                 path, header.version, GT_REGION_VERSION);
        close(fd);
        return NULL;
    }
    void *map = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return map == MAP_FAILED ? NULL : map;
}

/* Only a defined group: an entry the resource file dropped is kept only while processes still in
 * it are moved to "default", and may then serve another name. */
static int find_group(const struct gt_region *r, const char *name)
{
    for (int g = 0; g < GT_MAX_GROUPS; g++)
        if (__atomic_load_n(&r->groups[g].defined, __ATOMIC_ACQUIRE) == 1 &&
            strncmp(r->groups[g].name, name, GT_NAME_LEN) == 0)
            return g;
    return -1;
}

static int claim_slot(struct gt_slot_table *table, int32_t pid)
{
    uint32_t start = ((uint32_t)pid * 2654435761u) % GT_MAX_SLOTS; /* Knuth's multiplicative hash */
    for (uint32_t k = 0; k < GT_MAX_SLOTS; k++) {
        uint32_t index = (start + k) % GT_MAX_SLOTS;
        struct gt_slot *slot = &table->slots[index];
        int32_t free_pid = 0;
        if (__atomic_load_n(&slot->pid, __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(&slot->pid, &free_pid, pid, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return (int)index;
    }
    return -1;
}

static void fill_slot(struct gt_slot *slot, const char *requested)
{
    /* Everything but pid is ours now; a freed slot is zeroed by whoever freed it, but be sure. */
    memset((char *)slot + offsetof(struct gt_slot, flags), 0, sizeof *slot - offsetof(struct gt_slot, flags));
    char comm[GT_COMM_LEN] = {0};
    prctl(PR_GET_NAME, comm, 0, 0, 0);
    memcpy(slot->comm, comm, GT_COMM_LEN);
    strncpy(slot->requested, requested, GT_NAME_LEN - 1);
    slot->start_time = read_start_time();
    /* Last, with release: the agent reads the rest once it sees the flag. */
    __atomic_store_n(&slot->flags, GT_SLOT_GATED, __ATOMIC_RELEASE);
}

/* The agent decides within a tick of seeing the slot and wakes the group word's waiters; wait for
 * that (briefly) so that the first allocation is counted in the right group. A silent agent decides
 * nothing: no wait then. */
static void await_assignment(const struct gt_region *r, uint32_t index)
{
    uint64_t deadline = gt_now_ns() + GT_ASSIGN_WAIT_NS;
    const struct gt_assignment *entry = &r->assigned[index];
    while (gt_agent_alive()) {
        struct gt_assignment a;
        __atomic_load(entry, &a, __ATOMIC_ACQUIRE);
        /* Our slot's pid: getpid(), or the host pid the reaper gave a slot claimed in a pod. */
        int32_t mine = __atomic_load_n(&gt_proc.slots->slots[index].pid, __ATOMIC_RELAXED);
        if (a.pid == mine && a.group < GT_MAX_GROUPS)
            return;
        uint64_t now = gt_now_ns();
        if (now >= deadline) {
            say_once(SAID_UNASSIGNED, "the agent has not placed this process in a group yet; it counts as "
                     "\"" GT_DEFAULT_GROUP "\" until it does.");
            return;
        }
        /* The group word changes with every decision (the pid alone could repeat a stale entry's). */
        uint64_t left = deadline - now;
        gt_futex_wait(&entry->group, a.group, left < 1000000ull ? left : 1000000ull);
    }
}

bool gt_attach_slow(bool wait)
{
    if (gt_attached())
        return true;
    /* Allocations wait for a thread that is attaching (an allocation let through uncounted could
     * overshoot the limit); launches do not wait, they run ungated this once. */
    if (wait)
        pthread_mutex_lock(&attach_lock);
    else if (pthread_mutex_trylock(&attach_lock) != 0)
        return false;
    uint64_t now = gt_now_ns();
    bool ok = gt_attached();
    if (!ok && (last_attempt_ns == 0 || now - last_attempt_ns >= 1000000000ull)) {
        last_attempt_ns = now;
        const char *dir = getenv(GT_ENV_STATE_DIR);
        const char *requested = getenv(GT_ENV_GROUP);
        if (!dir || !*dir)
            dir = GT_DEFAULT_STATE_DIR;
        if (!requested || !*requested)
            requested = GT_DEFAULT_GROUP;
        const struct gt_region *r = map_file(dir, GT_REGION_FILE, GT_REGION_MAGIC, sizeof *r, false);
        struct gt_slot_table *table = r ? map_file(dir, GT_SLOTS_FILE, GT_SLOTS_MAGIC, sizeof *table, true) : NULL;
        int fallback = table ? find_group(r, GT_DEFAULT_GROUP) : -1;
        if (table && fallback < 0)
            say_once(SAID_NO_DEFAULT, "the agent's region defines no \"" GT_DEFAULT_GROUP "\" group; running ungated.");
        if (fallback >= 0 && find_group(r, requested) < 0)
            say_once(SAID_GROUP, "group '%s' is not defined by the agent's resource file; the agent places this "
                     "process in its cgroup's group or \"" GT_DEFAULT_GROUP "\".", requested);
        int32_t pid = (int32_t)getpid();
        int index = fallback >= 0 ? claim_slot(table, pid) : -1;
        if (fallback >= 0 && index < 0)
            say_once(SAID_FULL, "all %d process slots are taken; running ungated.", GT_MAX_SLOTS);
        if (index >= 0) {
            struct gt_slot *slot = &table->slots[index];
            fill_slot(slot, requested);
            gt_proc.region = r;
            gt_proc.slots = table;
            gt_proc.slot = slot;
            gt_proc.slot_index = (uint32_t)index;
            gt_proc.fallback_group = (uint32_t)fallback;
            await_assignment(r, (uint32_t)index);
            __atomic_store_n(&gt_proc.attached, 1, __ATOMIC_RELEASE);
            ok = true;
        } else {
            if (table)
                munmap(table, sizeof *table);
            if (r)
                munmap((void *)r, sizeof *r);
        }
    }
    pthread_mutex_unlock(&attach_lock);
    return ok;
}

/* --- devices: CUDA ordinal -> region GPU, by UUID, never by ordinal: with UUIDs in CUDA_VISIBLE_DEVICES
 * HAMi took every card for card 0 (HAMi #1218, https://github.com/Project-HAMi/HAMi/issues/1218) */

static void format_uuid(const CUuuid *u, char out[GT_UUID_LEN])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, GT_UUID_LEN, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int region_gpu_of_uuid(const char *uuid)
{
    const struct gt_region *r = gt_proc.region;
    uint32_t n = __atomic_load_n(&r->header.n_gpus, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n && i < GT_MAX_GPUS; i++)
        if (strncmp(r->gpus[i].uuid, uuid, GT_UUID_LEN) == 0)
            return (int)i;
    return -1;
}

static void learn_devices(void)
{
    pthread_mutex_lock(&attach_lock);
    if (!gt_proc.devices_known) {
        int count = 0;
        if (GT_REAL(cuDeviceGetCount) && gt_real.cuDeviceGetCount(&count) == CUDA_SUCCESS) {
            if (count > GT_MAX_DEVICES)
                count = GT_MAX_DEVICES;
            for (int d = 0; d < count; d++) {
                CUuuid uuid;
                CUresult r = GT_REAL(cuDeviceGetUuid_v2) ? gt_real.cuDeviceGetUuid_v2(&uuid, d)
                             : GT_REAL(cuDeviceGetUuid)  ? gt_real.cuDeviceGetUuid(&uuid, d)
                                                          : CUDA_ERROR_NOT_FOUND;
                char text[GT_UUID_LEN];
                if (r == CUDA_SUCCESS)
                    format_uuid(&uuid, text);
                gt_proc.device_gpu[d] = r == CUDA_SUCCESS ? region_gpu_of_uuid(text) : -1;
            }
            gt_proc.device_count = count;
            gt_proc.single_gpu = count == 1 ? gt_proc.device_gpu[0] : -1;
            if (count == 1 && gt_proc.single_gpu >= 0)
                gt_note_gpu(gt_proc.single_gpu);
            __atomic_store_n(&gt_proc.devices_known, 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&attach_lock);
}

int gt_gpu_of_device(CUdevice device)
{
    if (!__atomic_load_n(&gt_proc.devices_known, __ATOMIC_ACQUIRE))
        learn_devices();
    if (device < 0 || device >= gt_proc.device_count)
        return -1;
    return gt_proc.device_gpu[device];
}

/* The last context this thread launched in, and its GPU: a multi-GPU process pays one driver call
 * (cuCtxGetCurrent) per launch, a single-GPU process none. */
static GT_TLS CUcontext cached_ctx;
static GT_TLS int cached_gpu = -1;

int gt_current_gpu(void)
{
    if (!__atomic_load_n(&gt_proc.devices_known, __ATOMIC_ACQUIRE))
        learn_devices();
    if (gt_proc.device_count == 1)
        return gt_proc.single_gpu;
    CUcontext ctx = NULL;
    if (!GT_REAL(cuCtxGetCurrent) || gt_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return -1;
    if (ctx == cached_ctx)
        return cached_gpu;
    CUdevice device;
    if (!GT_REAL(cuCtxGetDevice) || gt_real.cuCtxGetDevice(&device) != CUDA_SUCCESS)
        return -1;
    int gpu = gt_gpu_of_device(device);
    if (gpu >= 0)
        gt_note_gpu(gpu);
    cached_ctx = ctx;
    cached_gpu = gpu;
    return gpu;
}

/* A launch runs on its stream's device, which need not be the current context's: the CUDA runtime
 * may launch on a stream of device 1 while the thread's current context is device 0's (seen with
 * PyTorch on cuda:1 of a two-GPU host). The default streams mean the current context. */
static GT_TLS CUstream cached_stream;
static GT_TLS int cached_stream_gpu = -1;

int gt_stream_gpu(CUstream stream)
{
    if (!__atomic_load_n(&gt_proc.devices_known, __ATOMIC_ACQUIRE))
        learn_devices();
    if (gt_proc.device_count == 1)
        return gt_proc.single_gpu;
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD || !GT_REAL(cuStreamGetDevice))
        return gt_current_gpu();
    if (stream == cached_stream)
        return cached_stream_gpu;
    CUdevice device;
    if (gt_real.cuStreamGetDevice(stream, &device) != CUDA_SUCCESS)
        return gt_current_gpu();
    int gpu = gt_gpu_of_device(device);
    if (gpu >= 0)
        gt_note_gpu(gpu);
    cached_stream = stream;
    cached_stream_gpu = gpu;
    return gpu;
}

void gt_note_gpu(int gpu)
{
    if (gt_attached() && !(__atomic_load_n(&gt_proc.slot->gpu_mask, __ATOMIC_RELAXED) & (1u << gpu)))
        __atomic_fetch_or(&gt_proc.slot->gpu_mask, 1u << gpu, __ATOMIC_RELAXED);
}

/* --- lifecycle ---------------------------------------------------------------------------------- */

static void release_slot(void)
{
    struct gt_slot *slot = gt_proc.slot;
    if (!gt_attached() || !slot || __atomic_load_n(&slot->pid, __ATOMIC_RELAXED) != (int32_t)getpid())
        return;
    /* The flag first: a reader that still sees it after reading the counters read them whole. */
    __atomic_store_n(&slot->flags, 0, __ATOMIC_RELEASE);
    memset((char *)slot + offsetof(struct gt_slot, flags), 0, sizeof *slot - offsetof(struct gt_slot, flags));
    __atomic_store_n(&slot->pid, 0, __ATOMIC_RELEASE);
}

/* After fork the child holds none of the parent's memory and claims its own slot on its first gated
 * call: it forgets the parent's attachment (gate.h: each part forgets its own state). */
static void after_fork_in_child(void)
{
    pthread_mutex_init(&attach_lock, NULL);
    const struct gt_region *r = gt_proc.region;
    struct gt_slot_table *table = gt_proc.slots;
    memset(&gt_proc, 0, sizeof gt_proc);
    gt_proc.single_gpu = -1;
    if (r)
        munmap((void *)r, sizeof *r);
    if (table)
        munmap(table, sizeof *table);
    last_attempt_ns = 0;
    cached_ctx = NULL;
    cached_gpu = -1;
    cached_stream = NULL;
    cached_stream_gpu = -1;
}

GT_CONSTRUCTOR_ATTACH static void attach_init(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

__attribute__((destructor)) static void gate_fini(void) { release_slot(); }
