/*
 * collective.c - collectives on the simulated GPU: a kernel that waits on its device for its peers'
 * kernels on other devices, spinning meanwhile, as NCCL's all-reduce kernel does (issue 29).
 *
 * The rule: the k-th collective of a communicator on each rank ends no earlier than every rank's k-th
 * collective has started, and then runs its own duration: end = latest start + duration. A rank that
 * starts first holds its device until then: its launch sets the device's busy_until to
 * SIM_SPINNING | pid, so that every launch on that device, of any process, waits until the spin is
 * placed, and the launching thread blocks until the last peer has started (sim_collective). Only then
 * is the end known: the spin and the duration go onto the timeline and into the busy time together,
 * and the ranks' values are reduced (the largest). While it spins, NVML counts it busy (sim_busy_done)
 * and the process's queue is not empty (its launch has not returned).
 *
 * A spin gives its device up (the spin so far stays busy time) and takes it again once every rank has
 * started, where another process's launch waits behind it: the real driver time-slices contexts, so
 * a spinning NCCL kernel slows another process's kernels on its GPU but does not stop them. Held
 * against every process, a rank stranded by a turn's end (its peer held back by gemtrace's gate)
 * stopped the group its GPU went to until the job's next turn (one request of 370 ms in
 * tests/test_gang_e2e.py), where a GPU runs that group beside the spin. Given up whole, not half as a
 * time slice: what the other process gets here is the better case. Nobody waits behind a spin whose
 * GPU's other groups gemtrace holds (at their gates, not here): that spin holds its device, charged,
 * as on the GPU. The same keeps two communicators on the same devices from waiting for each other
 * for ever (A's rank 0 spinning on GPU 0 for A's rank 1, whose launch waits behind B's rank 1
 * spinning on GPU 1 for B's rank 0, whose launch waits behind A's spin). A peer is known from its
 * first collective on: a job's ranks start with one, as DDP's constructor broadcasts the model and
 * NCCL's initialisation is itself a rendezvous (the ddp-loop client does).
 *
 * As everything in simgpu.h, no lock: a process killed at any instruction leaves at worst a spin
 * whose owner is dead, which the next launch on that device ends (sim_spin_wait), or a rank whose
 * process is dead, which its peers wait for at most SIMGPU_COLLECTIVE_TIMEOUT seconds. Waits sleep
 * on futexes in the shared mapping, woken at each start and each spin's end, and look again every
 * POLL_NS for dead processes. This file is the libcuda's only; the launch fast path never calls it.
 */
#define _DEFAULT_SOURCE
#include "simgpu.h"

#include <limits.h>
#include <stdbool.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POLL_NS 20000000ull
#define DEFAULT_TIMEOUT_S 10.0
#define ID_BITS 48 /* sim_comm.key: id << 16 | rank count */
#define SEQ_MASK 0xffffffffull

static void futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    /* Not FUTEX_PRIVATE: the word is in a file shared by every process of the simulation. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void ring(_Atomic uint32_t *word)
{
    atomic_fetch_add(word, 1);
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int32_t my_pid(void) { return (int32_t)getpid(); }

/* This process's start time, read from /proc once (again in a forked child). */
static uint64_t my_start_time(void)
{
    static _Atomic int32_t pid;
    static _Atomic uint64_t start;
    int32_t me = my_pid();
    if (atomic_load(&pid) != me) {
        atomic_store(&start, sim_proc_start_time(me));
        atomic_store(&pid, me);
    }
    return atomic_load(&start);
}

/* ---- spins: a device held by a collective ------------------------------------------------- */

/* Hold device d's timeline from when it is free, and not before `not_before`; returns the start. */
static uint64_t spin_begin(struct sim_device *d, uint64_t not_before, uint32_t comm)
{
    int32_t me = my_pid();
    uint64_t owner_start = my_start_time();
    uint64_t busy = atomic_load(&d->busy_until);
    for (;;) {
        if (busy & SIM_SPINNING) {
            sim_spin_wait(d, busy);
            uint64_t now = sim_now();
            if (not_before < now)
                not_before = now;
            busy = atomic_load(&d->busy_until);
            continue;
        }
        if (atomic_compare_exchange_weak(&d->busy_until, &busy, SIM_SPINNING | (uint32_t)me))
            break;
    }
    uint64_t start = busy > not_before ? busy : not_before;
    atomic_store(&d->spin_start, start);
    atomic_store(&d->spin_owner_start, owner_start);
    atomic_store(&d->spin_comm, comm);
    atomic_store(&d->spin_pid, me); /* last: spin_start is this spin's from now on */
    return start;
}

/* Give d up at `end`: the spin from `start` to `end` is busy time. */
static void spin_end(struct sim_device *d, uint64_t start, uint64_t end)
{
    uint64_t spinning = SIM_SPINNING | (uint32_t)my_pid();
    atomic_store(&d->spin_pid, 0);
    atomic_fetch_add(&d->busy_total, end - start);
    /* Fails only where another process took us for dead and ended the spin: its value stands. */
    atomic_compare_exchange_strong(&d->busy_until, &spinning, end);
    ring(&d->spin_bell);
}

void sim_spin_wait(struct sim_device *d, uint64_t busy)
{
    int32_t pid = (int32_t)(uint32_t)busy;
    uint32_t bell = atomic_load(&d->spin_bell);
    if (atomic_load(&d->busy_until) != busy)
        return;
    /* spin_owner_start tells a reused pid apart once spin_pid names the spinner. */
    bool stored = atomic_load(&d->spin_pid) == pid;
    uint64_t start = stored ? atomic_load(&d->spin_start) : 0;
    if (pid == my_pid() || sim_proc_alive(pid, stored ? atomic_load(&d->spin_owner_start) : 0)) {
        /* Another process's wait is counted, and rung to the spinner, which gives the device up to it. */
        bool other = pid != my_pid();
        if (other) {
            atomic_fetch_add(&d->spin_waiters, 1);
            uint32_t comm = atomic_load(&d->spin_comm);
            if (comm < SIM_MAX_COMMS)
                ring(&sim_state()->comm[comm].bell);
        }
        futex_wait(&d->spin_bell, bell, POLL_NS);
        if (other)
            atomic_fetch_sub(&d->spin_waiters, 1);
        return;
    }
    /* Its process died while it spun: the spin ends now; what was queued before it ends at its start. */
    uint64_t now = sim_now();
    if (!stored)
        start = now;
    uint64_t until = start > now ? start : now;
    if (atomic_compare_exchange_strong(&d->busy_until, &busy, until)) {
        if (now > start)
            atomic_fetch_add(&d->busy_total, now - start);
        ring(&d->spin_bell);
    }
}

/* ---- communicators ------------------------------------------------------------------------ */

static bool rank_alive(struct sim_rank *r, uint64_t word)
{
    int32_t pid = (int32_t)(word >> 32);
    return pid && sim_proc_alive(pid, atomic_load(&r->owner_start_time));
}

static bool comm_dead(struct sim_comm *c, uint64_t key)
{
    unsigned world = (unsigned)(key & 0xffff);
    for (unsigned p = 0; p < world && p < SIM_MAX_RANKS; p++) {
        uint64_t w = atomic_load(&c->rank[p].word);
        if (w && rank_alive(&c->rank[p], w))
            return false;
    }
    return true;
}

/* The communicator's entry, claimed if need be. Entries are claimed lowest first and never become
 * free again (a dead one is taken over by exchanging its key), so two ranks that join at once find
 * the same one. */
static int find_comm(struct sim_state *s, uint64_t id, uint64_t key, enum sim_comm_result *why)
{
    for (unsigned i = 0; i < SIM_MAX_COMMS; i++) {
        struct sim_comm *c = &s->comm[i];
        uint64_t k = atomic_load(&c->key);
        if (!k && atomic_compare_exchange_strong(&c->key, &k, key))
            return (int)i;
        if (k == key)
            return (int)i;
        if (k >> 16 == id) { /* the same id with another rank count: a communicator of a run that ended? */
            if (comm_dead(c, k) && (atomic_compare_exchange_strong(&c->key, &k, key) || k == key))
                return (int)i;
            *why = SIM_COMM_MISMATCH;
            return -1;
        }
    }
    for (unsigned i = 0; i < SIM_MAX_COMMS; i++) { /* full: take over one whose ranks are all dead */
        struct sim_comm *c = &s->comm[i];
        uint64_t k = atomic_load(&c->key);
        if (k == key || (comm_dead(c, k) && (atomic_compare_exchange_strong(&c->key, &k, key) || k == key)))
            return (int)i;
    }
    *why = SIM_COMM_FULL;
    return -1;
}

enum sim_comm_result sim_comm_join(uint64_t id, unsigned world, unsigned rank, struct sim_member *m)
{
    struct sim_state *s = sim_state();
    if (!s || !id || id >> ID_BITS || world < 1 || world > SIM_MAX_RANKS || rank >= world)
        return SIM_COMM_BAD_ARGS;
    uint64_t key = id << 16 | world;
    enum sim_comm_result why = SIM_COMM_OK;
    int index = find_comm(s, id, key, &why);
    if (index < 0)
        return why;
    struct sim_comm *c = &s->comm[index];
    int32_t me = my_pid();
    struct sim_rank *r = &c->rank[rank];
    uint64_t w = atomic_load(&r->word);
    for (;;) {
        if ((int32_t)(w >> 32) == me)
            break;
        if (w && rank_alive(r, w))
            return SIM_COMM_TAKEN;
        atomic_store(&r->owner_start_time, my_start_time());
        if (atomic_compare_exchange_strong(&r->word, &w, (uint64_t)(uint32_t)me << 32)) {
            w = (uint64_t)(uint32_t)me << 32;
            break;
        }
    }
    /* A peer's entry whose process is dead is from a run that ended (no collective of this run can
     * have ended before this rank's first started): clear it, so that its count is not taken for
     * this run's. */
    for (unsigned p = 0; p < world; p++) {
        uint64_t pw = atomic_load(&c->rank[p].word);
        if (p != rank && pw && !rank_alive(&c->rank[p], pw))
            atomic_compare_exchange_strong(&c->rank[p].word, &pw, 0);
    }
    *m = (struct sim_member){.key = key, .pid = me, .comm = (unsigned)index, .rank = rank, .round = w & SEQ_MASK};
    return SIM_COMM_OK;
}

static double timeout_s(void)
{
    const char *env = getenv("SIMGPU_COLLECTIVE_TIMEOUT");
    double v = env && *env ? strtod(env, NULL) : 0;
    return v > 0 ? v : DEFAULT_TIMEOUT_S;
}

enum sim_comm_result sim_collective(struct sim_member *m, struct sim_device *d, uint64_t not_before, uint64_t ns,
                                   uint64_t *value, uint64_t *pstart, uint64_t *pend)
{
    struct sim_state *s = sim_state();
    struct sim_comm *c = &s->comm[m->comm];
    unsigned world = (unsigned)(m->key & 0xffff);
    uint64_t k = m->round++, seq = (k + 1) & SEQ_MASK;
    uint64_t start = spin_begin(d, not_before, m->comm), held_from = start;
    bool held = true;
    struct sim_rank *mine = &c->rank[m->rank];
    atomic_store(&mine->start[k & 1], start); /* both before the count that publishes them */
    atomic_store(&mine->value[k & 1], *value);
    atomic_store(&mine->word, (uint64_t)(uint32_t)m->pid << 32 | seq);
    ring(&c->bell);
    *pstart = start;
    double limit = timeout_s();
    uint64_t bound = (uint64_t)(limit * 1e9), since = sim_now();
    for (;;) {
        uint32_t bell = atomic_load(&c->bell);
        uint64_t late = start, largest = *value;
        int missing = -1;
        for (unsigned p = 0; p < world; p++) {
            struct sim_rank *q = &c->rank[p];
            uint64_t w = atomic_load(&q->word);
            /* A peer at most one round ahead (it cannot end round k+1 without us): start[k & 1]
             * is still its k-th. A peer that started and then exited counts as started. */
            if (w && (uint32_t)((w & SEQ_MASK) - seq) < 2) {
                uint64_t t = atomic_load(&q->start[k & 1]), v = atomic_load(&q->value[k & 1]);
                late = t > late ? t : late;
                largest = v > largest ? v : largest;
            } else if (missing < 0) {
                missing = (int)p;
            }
        }
        uint64_t now = sim_now();
        if (missing < 0) {
            if (!held) /* it gave its device up: it finishes once it has it again */
                held_from = spin_begin(d, now, m->comm);
            *pend = (late > held_from ? late : held_from) + ns;
            *value = largest;
            spin_end(d, held_from, *pend);
            return SIM_COMM_OK;
        }
        struct sim_rank *q = &c->rank[missing];
        uint64_t w = atomic_load(&q->word);
        if (now - since >= bound) {
            fprintf(stderr,
                    "simgpu: collective %llu of communicator %llu (rank %u of %u) waited %.0f s for rank %d, "
                    "which has not started it (%s); start one process per rank, or set "
                    "SIMGPU_COLLECTIVE_TIMEOUT to wait longer\n",
                    (unsigned long long)k, (unsigned long long)(m->key >> 16), m->rank, world, limit, missing,
                    rank_alive(q, w) ? "its process lives: held back, or behind another collective on its device"
                                     : "no live process has reached a collective as that rank");
            m->failed = 1;
            *pend = held ? (now > held_from ? now : held_from) : now;
            if (held)
                spin_end(d, held_from, *pend);
            return SIM_COMM_PEER_LATE;
        }
        if (held && atomic_load(&d->spin_waiters) > 0) {
            spin_end(d, held_from, now > held_from ? now : held_from);
            held = false;
        }
        uint64_t left = bound - (now - since);
        futex_wait(&c->bell, bell, left < POLL_NS ? left : POLL_NS);
    }
}
