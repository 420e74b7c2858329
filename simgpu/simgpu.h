/*
 * simgpu.h - the simulated GPU's cross-process state and the helpers both simulated libraries use.
 *
 * The simulated libcuda.so.1 and libnvidia-ml.so.1 map one file, $SIMGPU_STATE_DIR/state (default
 * /dev/shm/simgpu-$UID/state), MAP_SHARED. It holds the simulated devices (capacity, memory in use,
 * the kernel timeline) and a table of processes (memory per device, devices with a context), so
 * that every process of a test sees one GPU, as on a real machine.
 *
 * Nothing here is a lock anybody waits for: every shared word changes by atomic add or compare-and-swap,
 * so a process killed at any instruction blocks nobody. The worst a killed process can leave behind is
 * a few bytes counted as used that nobody owns (killed between two adds; see sim_mem_reserve) or one
 * process slot that stays claimed (killed while reaping another's slot). The one kind of file lock, a
 * read lock on a slot's byte of a holds file beside the state, is never waited for: it only tells
 * others that the slot's process still holds the devices (state.c, hold_slot).
 *
 * Time is CLOCK_MONOTONIC nanoseconds everywhere.
 */
#ifndef SIMGPU_H
#define SIMGPU_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define SIM_MAGIC 0x3155504753494d53ULL /* "SMISGPU1" little-endian */
#define SIM_VERSION 7u
#define SIM_MAX_DEVICES 16
#define SIM_MAX_PROCS 1024
#define SIM_UUID_LEN 48
#define SIM_NAME "Simulated GPU"
#define SIM_DEFAULT_MEMORY (16ull << 30)
#define SIM_DEFAULT_HOST_MEMORY (64ull << 30) /* what managed memory may take, all devices together */
#define SIM_UTIL_SAMPLES 8
#define SIM_UTIL_SAMPLE_NS 125000000ull /* readers store a utilisation sample at most this often */
#define SIM_MAX_COMMS 64
#define SIM_MAX_RANKS SIM_MAX_DEVICES /* a rank per device, as NCCL allows */
/* busy_until's top bit: a collective spins on the device until its peers start theirs; the low 32
 * bits are its process's pid. No time reaches 2^63 ns. */
#define SIM_SPINNING (1ull << 63)

#define SIM_API __attribute__((visibility("default")))

/* How the devices are linked, as NVML reports it (nvml.c); chosen by SIMGPU_TOPOLOGY when the state
 * file is made. The 8-GPU layouts are NVIDIA's: docs/placement.md and nvml.c's tables. */
enum sim_topology {
    SIM_TOPOLOGY_HOSTBRIDGE = 0, /* "hostbridge" (default): all devices under one host bridge, no NVLink */
    SIM_TOPOLOGY_DGX1 = 1,       /* "dgx1": DGX-1 (Volta), hybrid cube-mesh NVLink, PCIe switch pairs */
    SIM_TOPOLOGY_DGX_A100 = 2,   /* "dgx-a100": every GPU's 12 NVLinks to 6 NVSwitches, PCIe switch pairs */
    SIM_TOPOLOGY_PCIE = 3,       /* "pcie": two CPUs, PCIe switch pairs, no NVLink */
};

struct sim_util_sample {
    _Atomic uint64_t t;    /* when the sample was taken */
    _Atomic uint64_t busy; /* kernel time completed by then */
};

struct sim_device {
    char uuid[SIM_UUID_LEN];  /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    uint8_t uuid_bytes[16];
    uint64_t total;           /* bytes of memory */
    _Atomic uint64_t used;    /* bytes reserved by all processes; changes only by CAS/add */
    _Atomic uint64_t launches;
    _Atomic uint64_t managed; /* managed memory allocated on this device: host-backed, not in `used` */
    uint64_t pad0[3];
    /* The timeline, on a cache line of its own: every launch of every process writes it. */
    _Atomic uint64_t busy_until; /* end of the last kernel queued on the device */
    _Atomic uint64_t busy_total; /* sum of the durations of all kernels ever queued */
    /* While busy_until is SIM_SPINNING | pid: when that collective started (kernels queued before it
     * end then), and its process's start time. spin_pid is stored last: spin_start is that spin's
     * once spin_pid names its pid (collective.c). */
    _Atomic uint64_t spin_start;
    _Atomic uint64_t spin_owner_start;
    _Atomic int32_t spin_pid;
    _Atomic uint32_t spin_bell; /* futex: bumped when a spin ends */
    /* Other processes' launches waiting behind the spin, and the spinning communicator's index (its
     * bell rung by each such wait): a spin gives its device up to them, as the driver time-slices. */
    _Atomic uint32_t spin_waiters;
    _Atomic uint32_t spin_comm;
    uint64_t pad1[2];
    _Atomic uint32_t sample_seq;
    uint32_t pad2;
    struct sim_util_sample samples[SIM_UTIL_SAMPLES];
};

struct sim_proc {
    _Atomic int32_t pid;          /* 0 free, else the owner (alive or not yet reaped) */
    _Atomic int32_t reaper;       /* 0, or the process giving back a dead owner's memory */
    _Atomic uint32_t ctx_devices; /* bit per physical device on which the process made a context */
    _Atomic uint32_t held;        /* 1: the owner read-locks the slot's byte of its holds file, and
                                   * the lock, not /proc, says whether it lives (state.c, hold_slot) */
    _Atomic uint64_t start_time;  /* /proc/<pid>/stat start time; tells a reused pid apart */
    _Atomic uint64_t used[SIM_MAX_DEVICES];
    _Atomic uint64_t managed[SIM_MAX_DEVICES];
};

/* A rank of a communicator (collective.c). `word` is its process's pid << 32 | the number of
 * collectives it has started, so that one store publishes both; start[k & 1] is when its k-th
 * collective started and value[k & 1] what it brought to be reduced, both stored before the word: a
 * peer is never more than one round ahead. */
struct sim_rank {
    _Atomic uint64_t word;             /* 0 free */
    _Atomic uint64_t owner_start_time; /* /proc start time of the word's pid */
    _Atomic uint64_t start[2];
    _Atomic uint64_t value[2];
};

struct sim_comm {
    _Atomic uint64_t key;  /* communicator id << 16 | rank count; 0 free */
    _Atomic uint32_t bell; /* futex: bumped at each rank's start */
    uint32_t pad;
    struct sim_rank rank[SIM_MAX_RANKS];
};

struct sim_state {
    _Atomic uint64_t magic;   /* stored last by the creator */
    uint32_t version;
    uint32_t size;
    uint32_t n_devices;
    _Atomic int32_t creator_pid;
    uint64_t memory;          /* per device */
    uint32_t topology;        /* enum sim_topology, from SIMGPU_TOPOLOGY (0 in files made before it) */
    uint32_t reserved0;
    uint64_t host_memory;     /* SIMGPU_HOST_MEMORY: the bound of all managed memory together */
    _Atomic uint64_t host_managed; /* managed memory of all processes on all devices */
    uint64_t reserved[5];
    struct sim_device dev[SIM_MAX_DEVICES];
    struct sim_proc proc[SIM_MAX_PROCS];
    struct sim_comm comm[SIM_MAX_COMMS];
};

/* The state of this process's simulation, attached on first use; NULL with a message on stderr when
 * the state file cannot be made. Thread-safe. */
struct sim_state *sim_state(void);

uint64_t sim_now(void);
void sim_sleep_until(uint64_t t);

/* "16GiB", "8G", "512MiB", "1000000": bytes; 0 when the text is not a size. */
uint64_t sim_parse_size(const char *text);

/* This process's slot in the table, claimed on first call (again in a forked child); -1 when full. */
int sim_my_slot(void);
void sim_note_context(int phys);

/* Reserve or give back device memory for this process. Reserve fails (returns -1) when the device
 * would go over capacity, after reclaiming the memory of dead processes once. */
int sim_mem_reserve(int phys, uint64_t size);
void sim_mem_release(int phys, uint64_t size);

/* Managed memory (cuMemAllocManaged): the driver pages it between host and device, so it is not taken
 * from the device's capacity but from the host's (SIMGPU_HOST_MEMORY), and counted per device and per
 * process apart from device memory. Reserve fails (returns -1) past the host's memory. */
int sim_managed_reserve(int phys, uint64_t size);
void sim_managed_release(int phys, uint64_t size);

/* Free the slots and memory of processes that have died. Returns how many slots were freed. */
int sim_reap_dead(void);
/* Whether slot i's process lives; if not, its memory and slot are given back, as sim_reap_dead would. */
int sim_reap_if_dead(unsigned i);
/* Whether `pid` lives by /proc and, unless start_time is 0, is the process that started then; for a
 * slot, only where its process holds no lock (state.c, slot_alive). */
int sim_proc_alive(int32_t pid, uint64_t start_time);
/* /proc/<pid>/stat's start time; 0 for a process gone or a zombie. */
uint64_t sim_proc_start_time(int32_t pid);

/* Kernel time the device has completed by `now` (the queue ahead of `now` is contiguous; a spinning
 * collective is busy from its start to `now`). */
uint64_t sim_busy_done(struct sim_device *d, uint64_t now);
/* Busy fraction (0..1) over roughly the last second, from samples that readers keep. */
double sim_utilisation(struct sim_device *d);

/* ---- collectives (collective.c; libcuda only) ---- */

/* Wait while `busy` (a busy_until holding SIM_SPINNING) is still d's; a spin whose process died is
 * ended for it. */
void sim_spin_wait(struct sim_device *d, uint64_t busy);

/* This process's rank in one communicator. */
struct sim_member {
    uint64_t key;  /* as sim_comm.key */
    int32_t pid;   /* the process that joined (a forked child joins again) */
    unsigned comm; /* index in sim_state.comm */
    unsigned rank;
    uint64_t round; /* collectives started so far */
    int failed;     /* a collective failed: the later ones fail at once */
};

enum sim_comm_result {
    SIM_COMM_OK = 0,
    SIM_COMM_BAD_ARGS,  /* rank count 1..SIM_MAX_RANKS, rank below it, id 1..2^48-1 */
    SIM_COMM_MISMATCH,  /* a live communicator has this id and another rank count */
    SIM_COMM_TAKEN,     /* a live process holds this rank */
    SIM_COMM_FULL,      /* SIM_MAX_COMMS live communicators */
    SIM_COMM_PEER_LATE, /* a peer did not start its collective within the bound */
};

/* Join communicator `id` as `rank` of `world`: peers' entries left by dead processes are cleared. */
enum sim_comm_result sim_comm_join(uint64_t id, unsigned world, unsigned rank, struct sim_member *m);
/* Run m's next collective on device d: it starts when d is free and not before `not_before`, holds d
 * (spins) until every rank's has started, then runs `ns`; *value goes in as this rank's and comes
 * back as the largest of every rank's (an all-reduce with MAX). The spin gives d up while another
 * process's launch waits behind it (the real driver time-slices them; two communicators each spinning
 * on the device the other needs so go on), and takes it again to finish. Gives the start and the
 * end (on failure, when it gave up). Waits at most SIMGPU_COLLECTIVE_TIMEOUT seconds (10) for a peer;
 * then prints why on stderr and returns SIM_COMM_PEER_LATE. */
enum sim_comm_result sim_collective(struct sim_member *m, struct sim_device *d, uint64_t not_before, uint64_t ns,
                                   uint64_t *value, uint64_t *start, uint64_t *end);

#endif
