/*
 * state.c - the simulated GPU's shared state: creating and attaching the state file, the process
 * table, memory capacity and the utilisation samples. Used by both simulated libraries.
 * It never waits for a lock another process could hold (see simgpu.h) and never dereferences a device
 * pointer (there is no device memory behind them).
 */
#define _DEFAULT_SOURCE
#include "simgpu.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Linux's open-file-description locks (since 3.15). fcntl.h declares them under _GNU_SOURCE only,
 * which these sources do not define (Makefile: the e2e image's glibc). */
#ifndef F_OFD_GETLK
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif

static struct sim_state *g_state;
static pthread_once_t g_state_once = PTHREAD_ONCE_INIT;

/* The holds files, beside the state: byte i of holds.<i / HOLDS_SLOTS> is read-locked by slot i's
 * process (hold_slot). Several files, since the kernel tests a lock against the file's locks one by
 * one: with every slot in one file, a poll of n processes made n tests that each went through up to n
 * locks; with HOLDS_SLOTS to a file a test costs about what the call itself does.
 * g_holds_fd[f] is this process's open file description of file f, kept open: -1 not opened yet (in a
 * forked child, until it needs one), HOLDS_NONE when it cannot be opened (slots judged by /proc). */
#define HOLDS_SLOTS 64
#define HOLDS_FILES (SIM_MAX_PROCS / HOLDS_SLOTS)
#define HOLDS_NONE (-2)
static char g_dir[PATH_MAX - 16];
static int g_holds_fd[HOLDS_FILES] = {[0 ... HOLDS_FILES - 1] = -1};
static int g_slot = -1;

uint64_t sim_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sim_sleep_until(uint64_t t)
{
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A UUID that depends only on the state directory and the device index: the same simulation always
 * shows the same GPUs, two simulations show different ones. */
static void make_uuid(struct sim_device *d, const char *dir, unsigned index)
{
    uint64_t seed = 1469598103934665603ull;
    for (const char *c = dir; *c; c++)
        seed = (seed ^ (unsigned char)*c) * 1099511628211ull;
    seed ^= (uint64_t)index * 0x100000001b3ull;
    uint64_t a = splitmix64(&seed), b = splitmix64(&seed);
    memcpy(d->uuid_bytes, &a, 8);
    memcpy(d->uuid_bytes + 8, &b, 8);
    d->uuid_bytes[6] = (uint8_t)((d->uuid_bytes[6] & 0x0f) | 0x40);
    d->uuid_bytes[8] = (uint8_t)((d->uuid_bytes[8] & 0x3f) | 0x80);
    const uint8_t *u = d->uuid_bytes;
    snprintf(d->uuid, sizeof d->uuid,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
             u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static void state_dir(char *out, size_t len)
{
    const char *env = getenv("SIMGPU_STATE_DIR");
    if (env && *env)
        snprintf(out, len, "%s", env);
    else
        snprintf(out, len, "/dev/shm/simgpu-%u", (unsigned)getuid());
}

static const char *const TOPOLOGY_NAMES[] = {
    [SIM_TOPOLOGY_HOSTBRIDGE] = "hostbridge",
    [SIM_TOPOLOGY_DGX1] = "dgx1",
    [SIM_TOPOLOGY_DGX_A100] = "dgx-a100",
    [SIM_TOPOLOGY_PCIE] = "pcie",
};

/* SIMGPU_TOPOLOGY's value, or -1 when it names none (unset or empty is the default). */
static int topology_from_env(void)
{
    const char *env = getenv("SIMGPU_TOPOLOGY");
    if (!env || !*env)
        return SIM_TOPOLOGY_HOSTBRIDGE;
    for (unsigned i = 0; i < sizeof TOPOLOGY_NAMES / sizeof *TOPOLOGY_NAMES; i++)
        if (strcmp(env, TOPOLOGY_NAMES[i]) == 0)
            return (int)i;
    return -1;
}

static void init_state(struct sim_state *s, const char *dir)
{
    const char *env = getenv("SIMGPU_DEVICES");
    long n = env && *env ? strtol(env, NULL, 10) : 1;
    if (n < 0 || n > SIM_MAX_DEVICES) {
        fprintf(stderr, "simgpu: SIMGPU_DEVICES=%s is outside 0..%d; using 1\n", env, SIM_MAX_DEVICES);
        n = 1;
    }
    env = getenv("SIMGPU_MEMORY");
    uint64_t mem = env && *env ? sim_parse_size(env) : SIM_DEFAULT_MEMORY;
    if (!mem) {
        fprintf(stderr, "simgpu: SIMGPU_MEMORY=%s is not a size such as 16GiB; using 16GiB\n", env);
        mem = SIM_DEFAULT_MEMORY;
    }
    int topology = topology_from_env();
    if (topology < 0) {
        fprintf(stderr, "simgpu: SIMGPU_TOPOLOGY=%s is not one of hostbridge, dgx1, dgx-a100, pcie; "
                        "using hostbridge\n", getenv("SIMGPU_TOPOLOGY"));
        topology = SIM_TOPOLOGY_HOSTBRIDGE;
    }
    s->topology = (uint32_t)topology;
    s->version = SIM_VERSION;
    s->size = sizeof *s;
    s->n_devices = (uint32_t)n;
    s->memory = mem;
    env = getenv("SIMGPU_HOST_MEMORY");
    s->host_memory = env && *env ? sim_parse_size(env) : SIM_DEFAULT_HOST_MEMORY;
    if (!s->host_memory) {
        fprintf(stderr, "simgpu: SIMGPU_HOST_MEMORY=%s is not a size such as 64GiB; using 64GiB\n", env);
        s->host_memory = SIM_DEFAULT_HOST_MEMORY;
    }
    for (unsigned i = 0; i < SIM_MAX_DEVICES; i++) {
        make_uuid(&s->dev[i], dir, i);
        s->dev[i].total = mem;
    }
}

static struct sim_state *map_fd(int fd)
{
    void *p = mmap(NULL, sizeof(struct sim_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void warn_if_env_differs(const struct sim_state *s, const char *path)
{
    const char *env = getenv("SIMGPU_DEVICES");
    const char *mem = getenv("SIMGPU_MEMORY");
    const char *topo = getenv("SIMGPU_TOPOLOGY");
    int topology = topology_from_env();
    if ((env && *env && strtol(env, NULL, 10) != (long)s->n_devices) ||
        (mem && *mem && sim_parse_size(mem) != s->memory) || (topo && *topo && topology >= 0 && (uint32_t)topology != s->topology))
        fprintf(stderr,
                "simgpu: %s was made with %u devices of %llu bytes, topology %s; this process's SIMGPU_DEVICES/"
                "SIMGPU_MEMORY/SIMGPU_TOPOLOGY differ and are ignored (use another SIMGPU_STATE_DIR)\n",
                path, s->n_devices, (unsigned long long)s->memory,
                s->topology < sizeof TOPOLOGY_NAMES / sizeof *TOPOLOGY_NAMES ? TOPOLOGY_NAMES[s->topology] : "?");
}

/* After fork the child is a process of its own: it claims its own slot when it next needs one, and
 * drops its copies of the parent's holds descriptors, whose locks (an open file description's, shared
 * by every descriptor of it) would otherwise keep the parent's slot alive as long as the child lives. */
static void forget_in_child(void)
{
    g_slot = -1;
    for (unsigned f = 0; f < HOLDS_FILES; f++) {
        if (g_holds_fd[f] >= 0)
            close(g_holds_fd[f]);
        if (g_holds_fd[f] != HOLDS_NONE)
            g_holds_fd[f] = -1;
    }
}

static void holds_path(char *out, size_t len, unsigned f) { snprintf(out, len, "%s/holds.%u", g_dir, f); }

/* Made with the state, before its magic, so that everyone who attaches finds them; afresh, since a
 * holds file left by an earlier state could still carry the locks of that state's processes. Readable
 * by all (a read lock needs read access only): whoever may map the state holds and checks through them. */
static void create_holds_files(void)
{
    char path[PATH_MAX];
    int failed = 0;
    for (unsigned f = 0; f < HOLDS_FILES; f++) {
        holds_path(path, sizeof path, f);
        unlink(path);
        int fd = open(path, O_RDONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if ((fd < 0 || fchmod(fd, 0644) != 0) && !failed++)
            fprintf(stderr, "simgpu: cannot create %s (%s): processes' liveness is read from /proc instead\n",
                    path, strerror(errno));
        g_holds_fd[f] = fd >= 0 ? fd : HOLDS_NONE;
    }
}

/* Creation is race-free without a lock: O_EXCL picks one creator, which fills the file and publishes
 * the magic last; the others wait for the magic. A creator that died before publishing leaves a file
 * without magic, which a waiter removes once the creator's pid is gone. */
static void attach(void)
{
    pthread_atfork(NULL, NULL, forget_in_child);
    char *dir = g_dir, path[PATH_MAX];
    state_dir(dir, sizeof g_dir);
    for (char *slash = strchr(dir + 1, '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = 0; /* make the parents too, as mkdir -p */
        mkdir(dir, 0755);
        *slash = '/';
    }
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "simgpu: cannot create state directory %s: %s\n", dir, strerror(errno));
        return;
    }
    snprintf(path, sizeof path, "%s/state", dir);
    for (int attempt = 0; attempt < 100; attempt++) {
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            struct sim_state *s = NULL;
            if (ftruncate(fd, sizeof *s) == 0)
                s = map_fd(fd);
            close(fd);
            if (!s) {
                fprintf(stderr, "simgpu: cannot size or map %s: %s\n", path, strerror(errno));
                unlink(path);
                return;
            }
            atomic_store(&s->creator_pid, (int32_t)getpid());
            init_state(s, dir);
            create_holds_files();
            atomic_store_explicit(&s->magic, SIM_MAGIC, memory_order_release);
            g_state = s;
            return;
        }
        if (errno != EEXIST) {
            fprintf(stderr, "simgpu: cannot create %s: %s\n", path, strerror(errno));
            return;
        }
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            continue; /* removed in between: try to create it again */
        struct stat st;
        uint64_t deadline = sim_now() + 5000000000ull;
        while (fstat(fd, &st) == 0 && (size_t)st.st_size < sizeof(struct sim_state) && sim_now() < deadline)
            usleep(1000);
        if ((size_t)st.st_size != sizeof(struct sim_state)) {
            close(fd);
            fprintf(stderr, "simgpu: %s has %lld bytes, not %zu: made by another simgpu build? "
                            "remove it or use another SIMGPU_STATE_DIR\n",
                    path, (long long)st.st_size, sizeof(struct sim_state));
            return;
        }
        struct sim_state *s = map_fd(fd);
        close(fd);
        if (!s)
            return;
        while (atomic_load_explicit(&s->magic, memory_order_acquire) != SIM_MAGIC) {
            int32_t creator = atomic_load(&s->creator_pid);
            if (sim_now() > deadline || (creator > 0 && kill(creator, 0) != 0 && errno == ESRCH))
                break;
            usleep(1000);
        }
        if (atomic_load_explicit(&s->magic, memory_order_acquire) == SIM_MAGIC) {
            if (s->version != SIM_VERSION || s->size != sizeof *s) {
                fprintf(stderr, "simgpu: %s has layout version %u; this build knows %u\n", path,
                        s->version, SIM_VERSION);
                munmap(s, sizeof *s);
                return;
            }
            warn_if_env_differs(s, path);
            g_state = s;
            return; /* the holds files are opened when first needed (holds_fd) */
        }
        munmap(s, sizeof *s);
        unlink(path); /* its creator died before publishing it */
    }
    fprintf(stderr, "simgpu: gave up attaching %s\n", path);
}

struct sim_state *sim_state(void)
{
    pthread_once(&g_state_once, attach);
    return g_state;
}

/* ---- processes ---------------------------------------------------------------------------- */

/* Start time (field 22 of /proc/<pid>/stat), 0 when the process is gone or a zombie. */
static uint64_t proc_start_time(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ')
        return 0;
    p += 2;
    if (*p == 'Z' || *p == 'X')
        return 0;
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

uint64_t sim_proc_start_time(int32_t pid) { return pid > 0 ? proc_start_time(pid) : 0; }

int sim_proc_alive(int32_t pid, uint64_t start_time)
{
    if (pid <= 0)
        return 0;
    uint64_t now = proc_start_time(pid);
    if (!now) /* no /proc entry, or a zombie: dead either way */
        return 0;
    return start_time == 0 || now == start_time;
}

/* This process's descriptor of the holds file of slot i, opened on first use; HOLDS_NONE where it
 * cannot be. */
static int holds_fd(unsigned i)
{
    int *slot_fd = &g_holds_fd[i / HOLDS_SLOTS];
    int fd = __atomic_load_n(slot_fd, __ATOMIC_ACQUIRE);
    if (fd != -1)
        return fd;
    char path[PATH_MAX];
    holds_path(path, sizeof path, i / HOLDS_SLOTS);
    int opened = g_dir[0] ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (opened < 0)
        opened = HOLDS_NONE;
    if (!__atomic_compare_exchange_n(slot_fd, &fd, opened, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        if (opened >= 0) /* another thread opened it first */
            close(opened);
        return fd;
    }
    return opened;
}

static struct flock slot_byte(short type, unsigned i)
{
    return (struct flock){.l_type = type, .l_whence = SEEK_SET, .l_start = (off_t)i, .l_len = 1};
}

/* The real driver's hold on a process ends when the process's file descriptors close: at exit, at a
 * kill (a zombie whose parent has not waited holds nothing) and at exec, whatever /proc still shows.
 * So a slot's process read-locks the slot's byte of its holds file through an open file description
 * of its own (O_CLOEXEC; a forked child drops its copy, forget_in_child): the kernel drops the lock
 * exactly then, and anyone can ask with one fcntl (slot_alive). The flag is set after the lock, so
 * that nobody sees it without the lock; until then the slot is judged by /proc, where its process is
 * alive. Where the lock cannot be had, the flag stays unset and /proc judges the slot, as before. */
static void hold_slot(struct sim_proc *p, unsigned i)
{
    int fd = holds_fd(i);
    struct flock lock = slot_byte(F_RDLCK, i);
    if (fd >= 0 && fcntl(fd, F_OFD_SETLK, &lock) == 0)
        atomic_store(&p->held, 1);
}

/* Whether slot i's process, `pid`, lives: while its lock is held, for a slot that has one (a test for
 * a write lock conflicts with any other description's read lock); by /proc otherwise. Not for this
 * process's own slot (its lock does not conflict with its own description): callers ask g_slot. */
static int slot_alive(struct sim_proc *p, unsigned i, int32_t pid)
{
    if (atomic_load(&p->held)) {
        int fd = holds_fd(i);
        struct flock test = slot_byte(F_WRLCK, i);
        if (fd >= 0 && fcntl(fd, F_OFD_GETLK, &test) == 0)
            return test.l_type != F_UNLCK;
    }
    return sim_proc_alive(pid, atomic_load(&p->start_time));
}

int sim_my_slot(void)
{
    int slot = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    if (slot >= 0)
        return slot;
    struct sim_state *s = sim_state();
    if (!s)
        return -1;
    int32_t me = (int32_t)getpid();
    uint64_t start = proc_start_time(me);
    for (int pass = 0; pass < 2; pass++) {
        for (unsigned k = 0; k < SIM_MAX_PROCS; k++) {
            unsigned i = ((unsigned)me + k) % SIM_MAX_PROCS; /* start near pid: O(1) when sparse */
            struct sim_proc *p = &s->proc[i];
            int32_t expect = 0;
            if (atomic_load(&p->pid) == 0 && atomic_compare_exchange_strong(&p->pid, &expect, me)) {
                atomic_store(&p->start_time, start);
                atomic_store(&p->ctx_devices, 0);
                /* Two threads may race here on first use; only one slot must be kept. */
                int none = -1;
                if (!__atomic_compare_exchange_n(&g_slot, &none, (int)i, 0, __ATOMIC_ACQ_REL,
                                                 __ATOMIC_ACQUIRE)) {
                    atomic_store(&p->start_time, 0);
                    atomic_store(&p->pid, 0);
                    return none;
                }
                hold_slot(p, i);
                return (int)i;
            }
        }
        sim_reap_dead();
    }
    fprintf(stderr, "simgpu: all %d process slots are taken\n", SIM_MAX_PROCS);
    return -1;
}

void sim_note_context(int phys)
{
    int slot = sim_my_slot();
    if (slot >= 0)
        atomic_fetch_or(&sim_state()->proc[slot].ctx_devices, 1u << phys);
}

/* Subtracts up to x, never below zero; returns what it took. */
static uint64_t sub_saturating(_Atomic uint64_t *v, uint64_t x)
{
    uint64_t cur = atomic_load(v);
    while (!atomic_compare_exchange_weak(v, &cur, cur > x ? cur - x : 0))
        ;
    return cur > x ? x : cur;
}

/* Takes the reaping of slot p for this process: from nobody, or from a reaper that died at it. Two
 * reapers therefore never work on one slot, and the slot keeps its pid (so nobody can claim it)
 * until its memory has been given back. */
static int claim_reaping(struct sim_proc *p, int32_t me)
{
    int32_t reaper = atomic_load(&p->reaper);
    if (reaper != 0 && (reaper == me || sim_proc_alive(reaper, 0)))
        return 0;
    return atomic_compare_exchange_strong(&p->reaper, &reaper, me);
}

/* Gives back everything slot p holds, then frees the slot. Exchanges make a repeat harmless. */
static void give_back_slot(struct sim_state *s, struct sim_proc *p, int32_t owner)
{
    for (unsigned d = 0; d < SIM_MAX_DEVICES; d++) {
        uint64_t bytes = atomic_exchange(&p->used[d], 0);
        if (bytes)
            sub_saturating(&s->dev[d].used, bytes);
        bytes = atomic_exchange(&p->managed[d], 0);
        if (bytes) {
            sub_saturating(&s->dev[d].managed, bytes);
            sub_saturating(&s->host_managed, bytes);
        }
    }
    atomic_store(&p->ctx_devices, 0);
    atomic_store(&p->held, 0);
    atomic_store(&p->start_time, 0);
    atomic_compare_exchange_strong(&p->pid, &owner, 0);
    atomic_store(&p->reaper, 0);
}

int sim_reap_dead(void)
{
    struct sim_state *s = sim_state();
    if (!s)
        return 0;
    int freed = 0;
    int mine = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    int32_t me = (int32_t)getpid();
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &s->proc[i];
        int32_t pid = atomic_load(&p->pid);
        if (pid <= 0 || i == mine || slot_alive(p, (unsigned)i, pid))
            continue;
        if (!claim_reaping(p, me))
            continue;
        if (atomic_load(&p->pid) != pid) { /* reaped and reused while we looked */
            atomic_store(&p->reaper, 0);
            continue;
        }
        give_back_slot(s, p, pid);
        freed++;
    }
    return freed;
}

int sim_reap_if_dead(unsigned i)
{
    struct sim_state *s = sim_state();
    if (!s || i >= SIM_MAX_PROCS)
        return 0;
    struct sim_proc *p = &s->proc[i];
    int32_t pid = atomic_load(&p->pid);
    if (pid <= 0)
        return 0;
    if ((int)i == __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE) || slot_alive(p, i, pid))
        return 1;
    if (claim_reaping(p, (int32_t)getpid())) {
        if (atomic_load(&p->pid) == pid)
            give_back_slot(s, p, pid);
        else /* reaped and reused while we looked */
            atomic_store(&p->reaper, 0);
    }
    return 0;
}

/* A process that exits gives its memory and its slot back at once, as the real driver tears down its
 * contexts at exit; one that is killed leaves them to the next reaper (sim_reap_dead). Only libcuda
 * claims slots, so this runs in the simulated libcuda's processes only. */
__attribute__((destructor)) static void release_slot_at_exit(void)
{
    int slot = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    if (slot < 0 || !g_state)
        return;
    struct sim_proc *p = &g_state->proc[slot];
    int32_t me = (int32_t)getpid();
    if (atomic_load(&p->pid) != me || !claim_reaping(p, me))
        return;
    int held = (int)atomic_load(&p->held);
    give_back_slot(g_state, p, me);
    __atomic_store_n(&g_slot, -1, __ATOMIC_RELEASE);
    /* At exit the kernel drops the lock anyway; a libcuda unloaded by dlclose must not leave it on a
     * byte that the slot's next owner takes, whose death it would hide. */
    struct flock unlock = slot_byte(F_UNLCK, (unsigned)slot);
    if (held && g_holds_fd[slot / HOLDS_SLOTS] >= 0)
        fcntl(g_holds_fd[slot / HOLDS_SLOTS], F_OFD_SETLK, &unlock);
}

/* The device counter goes first so that a process killed between the two adds leaves capacity
 * counted (lost until the simulation ends), never a counter that a reaper could take below zero. */
int sim_mem_reserve(int phys, uint64_t size)
{
    struct sim_state *s = sim_state();
    int slot = sim_my_slot();
    if (!s || slot < 0)
        return -1;
    struct sim_device *d = &s->dev[phys];
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t used = atomic_load(&d->used);
        while (size <= d->total && used <= d->total - size) {
            if (atomic_compare_exchange_weak(&d->used, &used, used + size)) {
                atomic_fetch_add(&s->proc[slot].used[phys], size);
                return 0;
            }
        }
        if (!sim_reap_dead())
            break;
    }
    return -1;
}

void sim_mem_release(int phys, uint64_t size)
{
    struct sim_state *s = sim_state();
    int slot = sim_my_slot();
    if (!s || slot < 0)
        return;
    /* The device gives back only what this process's slot held: a free after the slot was released
     * (at exit) or reaped cannot take bytes that other processes hold. */
    sub_saturating(&s->dev[phys].used, sub_saturating(&s->proc[slot].used[phys], size));
}

/* As sim_mem_reserve, against the host's memory; the host counter goes first for the same reason. */
int sim_managed_reserve(int phys, uint64_t size)
{
    struct sim_state *s = sim_state();
    int slot = sim_my_slot();
    if (!s || slot < 0)
        return -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t held = atomic_load(&s->host_managed);
        while (size <= s->host_memory && held <= s->host_memory - size) {
            if (atomic_compare_exchange_weak(&s->host_managed, &held, held + size)) {
                atomic_fetch_add(&s->dev[phys].managed, size);
                atomic_fetch_add(&s->proc[slot].managed[phys], size);
                return 0;
            }
        }
        if (!sim_reap_dead())
            break;
    }
    return -1;
}

void sim_managed_release(int phys, uint64_t size)
{
    struct sim_state *s = sim_state();
    int slot = sim_my_slot();
    if (!s || slot < 0)
        return;
    uint64_t taken = sub_saturating(&s->proc[slot].managed[phys], size);
    sub_saturating(&s->dev[phys].managed, taken);
    sub_saturating(&s->host_managed, taken);
}

/* ---- utilisation -------------------------------------------------------------------------- */

uint64_t sim_busy_done(struct sim_device *d, uint64_t now)
{
    /* Kernels are queued back to back from max(now, busy_until), so everything between `now` and
     * busy_until is queued kernel time: what is not done yet is exactly busy_until - now. */
    uint64_t total = atomic_load(&d->busy_total);
    uint64_t until = atomic_load(&d->busy_until);
    uint64_t spun = 0;
    if (until & SIM_SPINNING) {
        /* busy_total covers the kernels queued before the spin, which end at its start; the spin is
         * busy from then to now. Until spin_pid names the spinner, its start is not stored yet. */
        int32_t pid = atomic_load(&d->spin_pid);
        uint64_t start = atomic_load(&d->spin_start);
        if (pid != (int32_t)(uint32_t)until)
            start = now;
        until = start;
        spun = now > start ? now - start : 0;
    }
    uint64_t ahead = until > now ? until - now : 0;
    return (total > ahead ? total - ahead : 0) + spun;
}

double sim_utilisation(struct sim_device *d)
{
    uint64_t now = sim_now();
    uint64_t done = sim_busy_done(d, now);
    /* Pick the sample closest to one second old (the readers' window, as NVML's up to 1 s). */
    struct sim_util_sample *best = NULL;
    uint64_t best_gap = UINT64_MAX, newest = 0;
    for (int i = 0; i < SIM_UTIL_SAMPLES; i++) {
        uint64_t t = atomic_load(&d->samples[i].t);
        if (!t || t >= now)
            continue;
        uint64_t age = now - t;
        uint64_t gap = age > 1000000000ull ? age - 1000000000ull : 1000000000ull - age;
        if (gap < best_gap) {
            best_gap = gap;
            best = &d->samples[i];
        }
        if (t > newest)
            newest = t;
    }
    if (now - newest >= SIM_UTIL_SAMPLE_NS || !newest) {
        uint32_t seq = atomic_fetch_add(&d->sample_seq, 1);
        struct sim_util_sample *s = &d->samples[seq % SIM_UTIL_SAMPLES];
        atomic_store(&s->t, 0); /* readers skip a sample while it is being written */
        atomic_store(&s->busy, done);
        atomic_store(&s->t, now);
    }
    if (!best)
        return 0.0;
    uint64_t t0 = atomic_load(&best->t), b0 = atomic_load(&best->busy);
    if (!t0 || t0 >= now || done < b0)
        return 0.0;
    double u = (double)(done - b0) / (double)(now - t0);
    return u > 1.0 ? 1.0 : u;
}
