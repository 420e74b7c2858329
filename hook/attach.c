/*
 * attach.c - the process's attachment to the region: mapping it, claiming a slot, knowing its GPUs.
 *
 * Attaching happens lazily on the first gated call, never in a constructor, so a program that never
 * uses CUDA sees no difference. It is O(1) in the number of live processes: the slot search starts
 * at a hash of the pid and claims with one CAS (HAMi's start-up took about a minute with hundreds of
 * processes on a node: HAMi #1662, https://github.com/Project-HAMi/HAMi/issues/1662). The region is
 * mapped read-only; the slot table comes from the agent's socket, as sealed memfd chunks: our user's
 * writable, the rest read-only (gemtrace_region.h). The gate asks for a group (GEMTRACE_GROUP, written
 * in its slot) and the agent decides. Without a live agent (no region, another layout version, a
 * silent heartbeat), the gate says so once on stderr and passes everything through, retrying at most
 * once a second (the agent may start after the program). With a live agent that gives no slot (its
 * socket busy, this user's slots all taken), the gate does what the operator chose (header.unattached,
 * enum gt_unattached): its allocations wait, retrying with a backoff, or after a few seconds run
 * ungated or fail; it says which in one line on stderr (docs/security.md, "Attaching").
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

struct gt_process gt_proc = {.single_gpu = -1};

static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t last_attempt_ns;
static unsigned said; /* bit per message kind already printed */

/* Attaching to a live agent that gives no slot (under attach_lock): since when, why, and whether the
 * operator's ungated or refuse has been given to the program (enum gt_unattached + 1, 0 while trying). */
static uint64_t first_refusal_ns;
static char refusal[160];
static int gave_up;
#define GAVE_UP(choice) ((choice) + 1)

enum { SAID_NO_REGION = 1, SAID_VERSION = 2, SAID_GROUP = 4, SAID_WAITING = 8, SAID_FOREIGN = 16, SAID_UNASSIGNED = 32,
       SAID_NO_DEFAULT = 64, SAID_NO_SOCKET = 128, SAID_BAD_CHUNK = 256, SAID_BAD_BELLS = 512, SAID_GAVE_UP = 1024 };

#define GT_TABLE_BYTES ((size_t)GT_MAX_SLOTS * GT_SLOT_SIZE)

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

static bool alive(const struct gt_region *r)
{
    uint64_t beat = __atomic_load_n(&r->header.heartbeat_ns, __ATOMIC_ACQUIRE);
    return beat != 0 && gt_now_ns() - beat < GT_HEARTBEAT_STALE_NS;
}

bool gt_agent_alive(void) { return alive(gt_proc.region); }

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
    const char *end;
    uint64_t start = 0;
    return p && gt_parse_decimal(p, &end, &start) ? start : 0;
}

/* Open the region and check its header before mapping it: a file of another layout, or one shorter
 * than its layout (a mapping past the end of a file is SIGBUS on first touch), is refused. Returns the
 * read-only mapping or NULL. */
static const struct gt_region *map_region(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, GT_REGION_FILE);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        say_once(SAID_NO_REGION, "cannot open %s (%s): is the gemtrace agent running? Running ungated for now.",
                 path, strerror(errno));
        return NULL;
    }
    struct gt_header header;
    int64_t size = gt_fd_size(fd);
    if (size < 0 || pread(fd, &header, sizeof header, 0) != (ssize_t)sizeof header) {
        close(fd);
        return NULL;
    }
    if (header.magic != GT_REGION_MAGIC) {
        say_once(SAID_FOREIGN, "%s is not a gemtrace region; running ungated.", path);
        close(fd);
        return NULL;
    }
    if (header.version != GT_REGION_VERSION || header.size != sizeof(struct gt_region) ||
        (uint64_t)size < sizeof(struct gt_region)) {
        say_once(SAID_VERSION,
                 "%s has layout version %u, this gate speaks version %u; running ungated "
                 "(restart the program under the agent's gate of the same version).",
                 path, header.version, GT_REGION_VERSION);
        close(fd);
        return NULL;
    }
    void *map = mmap(NULL, sizeof(struct gt_region), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return map == MAP_FAILED ? NULL : map;
}

/* --- the slot table: chunks from the agent's socket ------------------------------------------------ */

/* One request, one reply with a descriptor per entry, then the doorbells'. A silent agent costs at most
 * a second. Returns the number of chunk descriptors received (into fds[], close-on-exec), or -1; the
 * doorbells' goes to *bells (-1 when the reply has none). */
static int ask_agent(const char *dir, uint32_t kind, struct gt_attach_reply *reply, int fds[GT_MAX_CHUNKS], int *bells)
{
    *bells = -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%s", dir, GT_ATTACH_SOCKET) >= sizeof addr.sun_path)
        return -1;
    int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -1;
    struct timeval timeout = {.tv_sec = 1};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    struct gt_attach_request request = {.version = GT_REGION_VERSION, .kind = kind};
    if (connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0 || send(sock, &request, sizeof request, 0) != sizeof request) {
        snprintf(refusal, sizeof refusal, "cannot reach the agent at %s: %s", addr.sun_path, strerror(errno));
        close(sock);
        return -1;
    }
    int got_fds[GT_MAX_CHUNKS + 1];
    union { char buf[CMSG_SPACE(sizeof(int) * (GT_MAX_CHUNKS + 1))]; struct cmsghdr align; } control;
    struct iovec iov = {.iov_base = reply, .iov_len = sizeof *reply};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
    memset(reply, 0, sizeof *reply);
    ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (got <= 0)
        snprintf(refusal, sizeof refusal, "the agent at %s did not answer: %s", addr.sun_path,
                 got < 0 ? strerror(errno) : "it closed the connection");
    close(sock);
    int n = 0;
    for (struct cmsghdr *c = got > 0 ? CMSG_FIRSTHDR(&msg) : NULL; c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int k = 0; k < count; k++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
            if (n < GT_MAX_CHUNKS + 1)
                got_fds[n++] = fd;
            else
                close(fd);
        }
    }
    bool sound = got >= (ssize_t)offsetof(struct gt_attach_reply, entries) && !(msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) &&
                 reply->version == GT_REGION_VERSION && reply->bells <= 1 && reply->n_entries <= GT_MAX_CHUNKS &&
                 reply->n_entries + reply->bells == (uint32_t)n;
    for (uint32_t k = 0; sound && k < reply->n_entries; k++)
        sound = reply->entries[k].chunk < GT_MAX_CHUNKS;
    if (!sound) {
        if (got > 0)
            snprintf(refusal, sizeof refusal, "the agent at %s answered in another shape", addr.sun_path);
        for (int k = 0; k < n; k++)
            close(got_fds[k]);
        return -1;
    }
    memcpy(fds, got_fds, reply->n_entries * sizeof(int));
    if (reply->bells)
        *bells = got_fds[n - 1];
    return (int)reply->n_entries;
}

/* A memfd of `size` bytes that nobody can shrink or grow: no mapping of it can fault. */
static bool sealed_of_size(int fd, off_t size)
{
    int seals = fcntl(fd, F_GET_SEALS);
    return gt_fd_size(fd) == (int64_t)size && seals >= 0 &&
           (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW);
}

/* Map the doorbells' descriptor (over the old mapping: a restarted agent sends new ones), if it is a
 * sealed page: no ring can fault. Closes fd. */
static void place_bells(int fd)
{
    if (fd < 0)
        return;
    if (sealed_of_size(fd, GT_BELLS_BYTES)) {
        struct gt_bells *old = __atomic_load_n(&gt_proc.bells, __ATOMIC_ACQUIRE);
        void *map = mmap(old, GT_BELLS_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | (old ? MAP_FIXED : 0), fd, 0);
        if (map != MAP_FAILED)
            __atomic_store_n(&gt_proc.bells, (struct gt_bells *)map, __ATOMIC_RELEASE);
    } else {
        say_once(SAID_BAD_BELLS, "the agent sent doorbells that are not a sealed memfd of %d bytes; ignored.",
                 GT_BELLS_BYTES);
    }
    close(fd);
}

void gt_ring(int gpu)
{
    gt_refresh_slots(); /* a restarted agent listens on new doorbells */
    struct gt_bells *bells = __atomic_load_n(&gt_proc.bells, __ATOMIC_ACQUIRE);
    if (!bells)
        return;
    __atomic_fetch_add(&bells->ring[gpu], 1, __ATOMIC_SEQ_CST);
    gt_futex_wake(&bells->ring[gpu], 1); /* the agent sleeps on it in its own process */
}

/* Map chunk descriptor `fd` over its place in the table. Only a sealed chunk of the right size is
 * mapped: nobody can shrink it, so no read of it can fault. Closes fd. */
static bool place_chunk(struct gt_slot *table, uint32_t chunk, int fd, bool writable)
{
    bool ok = sealed_of_size(fd, GT_CHUNK_BYTES);
    if (ok)
        ok = mmap((char *)table + (size_t)chunk * GT_CHUNK_BYTES, GT_CHUNK_BYTES,
                  writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) != MAP_FAILED;
    else
        say_once(SAID_BAD_CHUNK, "the agent sent a slot chunk that is not a sealed memfd of %d bytes; ignored.",
                 GT_CHUNK_BYTES);
    close(fd);
    return ok;
}

/* A range for the whole table that reads as zeros (free slots) wherever no chunk is mapped. */
static struct gt_slot *reserve_table(void)
{
    void *table = mmap(NULL, GT_TABLE_BYTES, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return table == MAP_FAILED ? NULL : table;
}

static const char *state_dir(void)
{
    const char *dir = getenv(GT_ENV_STATE_DIR);
    return dir && *dir ? dir : GT_DEFAULT_STATE_DIR;
}

static pthread_mutex_t view_lock = PTHREAD_MUTEX_INITIALIZER;

void gt_refresh_slots(void)
{
    const struct gt_region *r = gt_proc.region;
    uint64_t generation = __atomic_load_n(&r->header.chunk_generation, __ATOMIC_ACQUIRE);
    if (GT_LIKELY(generation == __atomic_load_n(&gt_proc.view_generation, __ATOMIC_ACQUIRE)))
        return;
    if (gt_mutex_trylock(&view_lock) != 0)
        return; /* another thread maps it now; this sum uses the table as it is */
    struct gt_attach_reply reply;
    int fds[GT_MAX_CHUNKS], bells;
    int n = ask_agent(state_dir(), GT_ATTACH_VIEW, &reply, fds, &bells);
    place_bells(bells);
    uint32_t mine = gt_proc.slot_index / GT_CHUNK_SLOTS;
    for (int k = 0; k < n; k++) {
        if (reply.entries[k].chunk == mine)
            close(fds[k]); /* ours stays as it is: writable, and never given away while our slot is live */
        else
            place_chunk(gt_proc.slots, reply.entries[k].chunk, fds[k], false);
    }
    /* On failure keep the old generation, so that the next sum asks again (at most once a second:
     * a failed ask is quick unless the agent hangs, which its 1 s timeout bounds). */
    if (n >= 0 && reply.status == GT_ATTACH_OK)
        __atomic_store_n(&gt_proc.view_generation, reply.chunk_generation, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&view_lock);
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

/* Claim a free slot in one of our user's chunks (`writable` lists them), from a hash of the pid. */
static int claim_slot(struct gt_slot *table, const uint32_t *writable, int n_writable, int32_t pid)
{
    uint32_t hash = (uint32_t)pid * 2654435761u; /* Knuth's multiplicative hash */
    for (int c = 0; c < n_writable; c++) {
        uint32_t chunk = writable[(hash / GT_CHUNK_SLOTS + (uint32_t)c) % (uint32_t)n_writable];
        for (uint32_t k = 0; k < GT_CHUNK_SLOTS; k++) {
            uint32_t index = chunk * GT_CHUNK_SLOTS + (hash + k) % GT_CHUNK_SLOTS;
            struct gt_slot *slot = &table[index];
            int32_t free_pid = 0;
            if (__atomic_load_n(&slot->pid, __ATOMIC_RELAXED) == 0 &&
                __atomic_compare_exchange_n(&slot->pid, &free_pid, pid, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                return (int)index;
        }
    }
    return -1;
}

/* Ask to join, map what the agent sends, claim a slot in our user's chunks. The agent makes sure our
 * user has a free slot for each of its recent asks when it answers; another process of ours may still
 * take ours first, so a failed claim asks again (four times at most). Returns the slot index or -1. */
static int join(const char *dir, struct gt_slot *table, int32_t pid, uint64_t *generation)
{
    for (int attempt = 0; attempt < 4; attempt++) {
        struct gt_attach_reply reply;
        int fds[GT_MAX_CHUNKS], bells;
        int n = ask_agent(dir, GT_ATTACH_JOIN, &reply, fds, &bells);
        if (n < 0)
            return -1;
        place_bells(bells);
        uint32_t writable[GT_MAX_CHUNKS];
        int n_writable = 0;
        for (int k = 0; k < n; k++) {
            bool mine = reply.entries[k].writable == 1;
            if (place_chunk(table, reply.entries[k].chunk, fds[k], mine) && mine)
                writable[n_writable++] = reply.entries[k].chunk;
        }
        *generation = reply.chunk_generation;
        if (reply.status != GT_ATTACH_OK)
            break;
        int index = claim_slot(table, writable, n_writable, pid);
        if (index >= 0)
            return index;
    }
    snprintf(refusal, sizeof refusal, "the agent has no free process slot for this user (at most %d each, %d in all)",
             GT_USER_CHUNKS * GT_CHUNK_SLOTS, GT_MAX_SLOTS);
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
        int32_t mine = __atomic_load_n(&gt_proc.slots[index].pid, __ATOMIC_RELAXED);
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

enum attempt { ATTACHED, NO_AGENT, NO_SLOT };

/* One try: map the region, join, claim a slot. NO_SLOT: a live agent gave none (`refusal` says why),
 * and *choice is what the operator chose for that (enum gt_unattached). */
static enum attempt try_attach(int *choice)
{
    const char *dir = state_dir();
    /* Unset: no wish, an empty request. The agent places the process by its cgroup (a pod's binding
     * Cgroup rule) or in "default"; asking for "default" here would be a wish it must weigh. */
    const char *requested = getenv(GT_ENV_GROUP);
    if (!requested)
        requested = "";
    const struct gt_region *r = map_region(dir);
    int fallback = r ? find_group(r, GT_DEFAULT_GROUP) : -1;
    if (r && fallback < 0)
        say_once(SAID_NO_DEFAULT, "the agent's region defines no \"" GT_DEFAULT_GROUP "\" group; running ungated.");
    if (fallback >= 0 && *requested && find_group(r, requested) < 0)
        say_once(SAID_GROUP, "group '%s' is not defined by the agent's resource file; the agent places this "
                 "process in its cgroup's group or \"" GT_DEFAULT_GROUP "\".", requested);
    struct gt_slot *table = fallback >= 0 ? reserve_table() : NULL;
    int32_t pid = (int32_t)getpid();
    uint64_t generation = 0;
    int index = table ? join(dir, table, pid, &generation) : -1;
    if (index >= 0) {
        struct gt_slot *slot = &table[index];
        fill_slot(slot, requested);
        gt_proc.region = r;
        gt_proc.slots = table;
        gt_proc.view_generation = generation;
        gt_proc.slot = slot;
        gt_proc.slot_index = (uint32_t)index;
        gt_proc.fallback_group = (uint32_t)fallback;
        await_assignment(r, (uint32_t)index);
        __atomic_store_n(&gt_proc.attached, 1, __ATOMIC_RELEASE);
        return ATTACHED;
    }
    enum attempt outcome = table && alive(r) ? NO_SLOT : NO_AGENT;
    if (outcome == NO_SLOT) {
        uint32_t chosen = __atomic_load_n(&r->header.unattached, __ATOMIC_ACQUIRE);
        *choice = chosen <= GT_UNATTACHED_REFUSE ? (int)chosen : GT_UNATTACHED_WAIT;
    } else if (table) {
        say_once(SAID_NO_SOCKET, "%s, and its heartbeat is silent; running ungated until it is back.", refusal);
    }
    if (table)
        munmap(table, GT_TABLE_BYTES); /* the chunks mapped into it go with it */
    if (r)
        munmap((void *)r, sizeof *r);
    return outcome;
}

static void pause_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Try, and while a live agent gives no slot do what the operator chose: with `wait` (an allocation)
 * retry with a backoff, for ever under GT_UNATTACHED_WAIT, for GT_UNATTACHED_TRY_NS under the others,
 * which then let the program through ungated or refuse its allocations. Under attach_lock. */
static bool attach_or_wait(bool wait)
{
    uint64_t backoff = 10000000ull;
    for (;;) {
        int choice = GT_UNATTACHED_WAIT;
        last_attempt_ns = gt_now_ns();
        enum attempt outcome = try_attach(&choice);
        if (outcome == ATTACHED) {
            first_refusal_ns = 0;
            __atomic_store_n(&gave_up, 0, __ATOMIC_RELEASE);
            return true;
        }
        if (outcome == NO_AGENT) {
            first_refusal_ns = 0;
            return false;
        }
        uint64_t now = gt_now_ns();
        if (first_refusal_ns == 0)
            first_refusal_ns = now;
        if (choice == GT_UNATTACHED_WAIT) {
            __atomic_store_n(&gave_up, 0, __ATOMIC_RELEASE);
            say_once(SAID_WAITING, "%s; this program's allocations wait until it gets one, as the operator chose "
                     "(gemtrace agent --unattached=wait).", refusal);
        } else if (now - first_refusal_ns >= GT_UNATTACHED_TRY_NS) {
            __atomic_store_n(&gave_up, GAVE_UP(choice), __ATOMIC_RELEASE);
            if (choice == GT_UNATTACHED_UNGATED)
                say_once(SAID_GAVE_UP, "%s; running ungated, as the operator chose (gemtrace agent --unattached=ungated): "
                         "this program's memory is not held to its group's limit.", refusal);
            else
                say_once(SAID_GAVE_UP, "%s; its allocations fail with CUDA_ERROR_NOT_PERMITTED, as the operator chose "
                         "(gemtrace agent --unattached=refuse): run it again later, or ask the operator.", refusal);
            return false;
        }
        if (!wait)
            return false;
        pause_ns(backoff);
        backoff = backoff * 2 < GT_ATTACH_BACKOFF_MAX_NS ? backoff * 2 : GT_ATTACH_BACKOFF_MAX_NS;
    }
}

bool gt_attach_held_back(void)
{
    return __atomic_load_n(&first_refusal_ns, __ATOMIC_ACQUIRE) != 0 &&
           __atomic_load_n(&gave_up, __ATOMIC_ACQUIRE) == 0 && !gt_attached();
}

bool gt_attach_refused(void)
{
    return __atomic_load_n(&gave_up, __ATOMIC_ACQUIRE) == GAVE_UP(GT_UNATTACHED_REFUSE) && !gt_attached();
}

bool gt_attach_slow(bool wait)
{
    if (gt_attached())
        return true;
    /* Allocations wait for a thread that is attaching (an allocation let through uncounted could
     * overshoot the limit); launches do not wait, they run ungated this once. */
    if (wait)
        pthread_mutex_lock(&attach_lock);
    else if (gt_mutex_trylock(&attach_lock) != 0)
        return false;
    bool ok = gt_attached();
    /* At most a try a second, except for an allocation while a live agent gives no slot and the
     * program has not been let through (or refused) yet: that one waits for its slot. */
    bool due = last_attempt_ns == 0 || gt_now_ns() - last_attempt_ns >= 1000000000ull;
    bool holding = first_refusal_ns != 0 && __atomic_load_n(&gave_up, __ATOMIC_ACQUIRE) == 0;
    if (!ok && (due || (wait && holding)))
        ok = attach_or_wait(wait);
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
    uint32_t bit = 1u << gpu;
    if (!gt_attached() || (__atomic_load_n(&gt_proc.slot->gpu_mask, __ATOMIC_RELAXED) & bit))
        return;
    if (__atomic_fetch_or(&gt_proc.slot->gpu_mask, bit, __ATOMIC_SEQ_CST) & bit)
        return; /* another thread of ours was first */
    /* A new user of the GPU: its scheduler scans the slot table for users only when this count moved
     * (after the bit: a scan that sees the count sees the bit), not at every ring. */
    struct gt_bells *bells = __atomic_load_n(&gt_proc.bells, __ATOMIC_ACQUIRE);
    if (bells)
        __atomic_fetch_add(&bells->joined[gpu], 1, __ATOMIC_SEQ_CST);
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
    pthread_mutex_init(&view_lock, NULL);
    const struct gt_region *r = gt_proc.region;
    struct gt_slot *table = gt_proc.slots;
    struct gt_bells *bells = gt_proc.bells;
    memset(&gt_proc, 0, sizeof gt_proc);
    gt_proc.single_gpu = -1;
    if (r)
        munmap((void *)r, sizeof *r);
    if (bells)
        munmap(bells, GT_BELLS_BYTES);
    if (table)
        munmap(table, GT_TABLE_BYTES);
    last_attempt_ns = 0;
    first_refusal_ns = 0;
    gave_up = 0;
    cached_ctx = NULL;
    cached_gpu = -1;
    cached_stream = NULL;
    cached_stream_gpu = -1;
}

GT_CONSTRUCTOR_ATTACH static void attach_init(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

__attribute__((destructor)) static void gate_fini(void) { release_slot(); }
