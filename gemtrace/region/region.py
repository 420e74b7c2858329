"""`Region`: the region file and the slot table mapped, and the few operations on them that need care.

This module owns the mapping of the region file and the slot table: creating the region so a gate
never maps a half-written file, releasing a futex word, storing an assignment in one word, freeing a
dead process's slot. It never decides anything: the scheduler decides what to hold,
gemtrace/agent/membership.py which group a process is in, the agent when to reap.

`region` (the agent's word: header, GPUs, groups, control words, assignments, chunk owners) is root's,
mode 0644: gates map it read-only. The slot table (each gated process's own figures) is made of
per-user memfd chunks that the agent hands out over its socket (chunks.py, server.py): a process
writes only its own user's slots, and nothing read back from them is trusted (names are decoded
defensively; docs/security.md). A region whose header or tables are not sound is replaced rather
than adopted (layout.unsound). The top of gemtrace/region/: it imports every module below it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path

from gemtrace.contract import (
    ATTACH_SOCKET,
    ATTACH_VIEW,
    BESIDE_MANY,
    BESIDE_SLOTS,
    CHUNK_SLOTS,
    GROUP_UNASSIGNED,
    HELD,
    MAX_CHUNKS,
    MAX_GPUS,
    MAX_GROUPS,
    MAX_SLOTS,
    NAME_LEN,
    NO_LIMIT,
    NO_OWNER,
    REGION_FILE,
    RELEASED,
    UTIL_ONE,
    UUID_LEN,
    WAKE_FANOUT,
)
from gemtrace.contract import REGION_MAGIC as MAGIC
from gemtrace.contract import REGION_VERSION as VERSION
from gemtrace.region import futex
from gemtrace.region.chunks import ChunkKeeper, SlotSpace, find_chunks, sound_chunk
from gemtrace.region.doorbells import Doorbells
from gemtrace.region.layout import (
    REGION_SIZE,
    RELEASED_WORDS,
    Assignment,
    Control,
    GroupRecord,
    Header,
    RegionLayout,
    Slot,
    SlotTableLayout,
    Verified,
    assignment_word,
    decode_name,
    unsound,
)
from gemtrace.region.server import SlotServer, ask
from gemtrace.region.slots import SlotColumns

REGION_MODE = 0o644  # the agent's (root's) word: every user reads it, none writes it


class RegionError(Exception):
    """A region file that cannot be used; the message says why and what to do."""


class RegionVersionError(RegionError):
    pass


def os_error(path: Path, e: OSError) -> RegionError:
    """One line a person can act on for the errors a host can give while the region is created."""
    if e.errno == errno.ENOSPC:
        return RegionError(f"{path.parent}: no space left for the {REGION_SIZE}-byte region; "
                           "free space on that "
                           "filesystem (or point --state-dir elsewhere) and start the agent again")
    if e.errno == errno.EROFS:
        return RegionError(f"{path.parent} is on a read-only filesystem; the agent needs a writable --state-dir "
                           "(the unit's RuntimeDirectory, /run/gemtrace)")
    if e.errno == errno.EDQUOT:
        return RegionError(f"{path.parent}: disk quota exceeded writing the region; raise the quota or point "
                           "--state-dir elsewhere")
    return RegionError(f"{path}: cannot create the region: {e.strerror or e}")


# Region.release's `wake` for every waiter of the word at once, from the agent's thread: the protocol
# before the wake tree (issue 13), kept for bench/bench_release_wake.py to compare with.
WAKE_ALL = futex.EVERYONE


def _check_header(path: Path, fd: int, magic: int, size: int) -> None:
    """Refuse a file that is not of this layout before mapping it (a short one would be SIGBUS)."""
    size_of_head = ctypes.sizeof(Header)
    head = Header.from_buffer_copy(os.pread(fd, size_of_head, 0).ljust(size_of_head, b"\0"))
    if head.magic != magic:
        raise RegionError(f"{path}: not a gemtrace region (bad magic); remove it or restart the agent")
    if head.version != VERSION:
        raise RegionVersionError(
            f"{path}: layout version {head.version}, this gemtrace reads version {VERSION}; "
            "restart the agent of this version to replace it"
        )
    actual = os.fstat(fd).st_size
    if head.size != size or actual < size:
        raise RegionError(f"{path}: {actual} bytes, expected {size}")


def _map_file(path: Path, magic: int, size: int, writable: bool) -> tuple[int, mmap.mmap]:
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        _check_header(path, fd, magic, size)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    except BaseException:
        os.close(fd)
        raise


def _new_file(state_dir: Path, name: str, size: int, mode: int) -> tuple[Path, int, mmap.mmap]:
    """A zeroed, preallocated file under a temporary name (renamed into place by the caller once its
    header is written): a sparse file would kill the agent and every gated program with SIGBUS on a
    full filesystem."""
    tmp = state_dir / f".{name}.{os.getpid()}"
    # A new file, never one found there (a leftover of a crash, or a link planted by whoever could
    # write the directory): the checks of open_state_dir are not repeated here.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # No fallocate here (some filesystems): write the zeros, which allocates as surely.
            os.pwrite(fd, bytes(size), 0)
        return tmp, fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _create_region_file(state_dir: Path, path: Path) -> tuple[int, mmap.mmap]:
    """A new region file, every word in its initial state, renamed into place with its magic set."""
    tmp, fd, mapping = _new_file(state_dir, REGION_FILE, REGION_SIZE, REGION_MODE)
    try:
        layout = RegionLayout.from_buffer(mapping)
        layout.header.version = VERSION
        layout.header.size = REGION_SIZE
        layout.header.agent_pid = os.getpid()
        layout.header.region_id = int.from_bytes(os.urandom(8), "little")
        for gpu in range(MAX_GPUS):
            for group in range(MAX_GROUPS):
                layout.control[gpu][group].held = RELEASED
        words = memoryview(layout.assigned).cast("B").cast("Q")
        for index in range(MAX_SLOTS):
            words[index] = assignment_word(0, GROUP_UNASSIGNED)
        words.release()
        for chunk in range(MAX_CHUNKS):
            layout.chunk_owner[chunk] = NO_OWNER
        layout.header.magic = MAGIC
        del layout
        mapping.flush()
        os.rename(tmp, path)
    except BaseException:
        mapping.close()
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, mapping


def _place_view(space: SlotSpace, state_dir: Path, region_id: int) -> int:
    """Map every chunk the agent in `state_dir` serves, read-only; returns the view's chunk generation
    (-1 when no agent answered). Without an agent, root still finds the chunks live gates map (as a
    restarted agent would); anyone else then reads every slot free."""
    try:
        reply, fds = ask(state_dir, ATTACH_VIEW)
    except OSError:
        if os.geteuid() == 0:
            for chunk, (fd, _) in find_chunks(region_id).items():
                space.place(chunk, fd, writable=False)
                os.close(fd)
        return -1
    try:
        for k, fd in enumerate(fds):
            if sound_chunk(fd):
                space.place(reply.entries[k].chunk, fd, writable=False)
    finally:
        for fd in fds:
            os.close(fd)
    return int(reply.chunk_generation)


class Region:
    """The mapped region and the slot table. `layout` is the live ctypes view of the region,
    `slots_layout` of the slot table (a read-only opener gets copies of both).

    The agent's Region (`create`) makes the slot chunks and serves them on its socket; an observer's
    (`open`) asks that socket for every chunk, read-only, and maps again when chunks were added."""

    def __init__(self, path: Path, fd: int, mapping: mmap.mmap, space: SlotSpace) -> None:
        self.path = path
        self._fd, self._map = fd, mapping
        self._space: SlotSpace | None = space  # None: a read-only opener's snapshot
        self._keeper: ChunkKeeper | None = None
        self._server: SlotServer | None = None
        self.doorbells: Doorbells | None = None  # the agent's only
        self.layout = RegionLayout.from_buffer(mapping)
        self.slots_layout = space.table()
        self._view_generation = -1
        self._assigned_words = memoryview(self.layout.assigned).cast("B").cast("Q")
        self._verified_lock = threading.Lock()
        self._verified_cache: dict[int, tuple[int, dict[int, tuple[int, int]]]] = {}
        verified = self.layout.verified
        self._verified_pids = memoryview((ctypes.c_char * ctypes.sizeof(verified)).from_address(
            ctypes.addressof(verified))).cast("B").cast("i")[:: ctypes.sizeof(Verified) // 4]

    @property
    def slots(self) -> ctypes.Array[Slot]:
        return self.slots_layout.slots

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, state_dir: Path, on_replace: Callable[[str], None] | None = None,
               log: Callable[..., None] | None = None, on_join: Callable[[], None] | None = None) -> Region:
        """The agent's view: adopt a sound region file of this version (groups, assignments and the
        chunks live gates still map survive an agent restart, so running programs keep going), or
        replace a missing, foreign, torn or unsound one; `on_replace(reason)` hears why an existing
        file was replaced. Then serve the slot chunks on the socket (`on_join()` after each gate's
        join answered: it claims a slot next and waits for its group).

        A new file is written under a temporary name, its blocks allocated, and renamed into place
        with its magic already set.
        """
        path = state_dir / REGION_FILE
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise os_error(path, e) from None
        reason = None
        try:
            fd, mapping = _map_file(path, MAGIC, REGION_SIZE, True)
        except FileNotFoundError:
            fd = -1
        except RegionError as e:
            fd, reason = -1, str(e)
        except OSError as e:
            fd, reason = -1, f"{path}: {e.strerror or e}"
        adopted = False
        if fd >= 0:
            layout = RegionLayout.from_buffer(mapping)
            reason = unsound(layout)
            del layout
            if reason is None:
                # The region is the agent's alone, whoever left it: root's, read-only for the rest.
                os.fchown(fd, os.geteuid(), os.getegid())
                os.fchmod(fd, REGION_MODE)
                adopted = True
            else:
                mapping.close()
                os.close(fd)
                reason = f"{path}: {reason}"
        if reason is not None and on_replace is not None:
            on_replace(reason)
        if not adopted:
            try:
                fd, mapping = _create_region_file(state_dir, path)
            except OSError as e:
                raise os_error(path, e) from None
        space = SlotSpace()
        region = cls(path, fd, mapping, space)
        try:
            region.layout.header.agent_pid = os.getpid()
            region._keeper = ChunkKeeper(space, region.layout, log)
            if adopted:
                region._keeper.recover()  # a new file's chunk_owner[] already says "none"
            region.doorbells = Doorbells(int(region.layout.header.region_id))
            region._server = SlotServer(state_dir, region._keeper, region.doorbells.fd, on_join)
        except OSError as e:
            region.close()
            raise os_error(state_dir / ATTACH_SOCKET, e) from None
        except BaseException:
            region.close()
            raise
        return region

    @classmethod
    def open(cls, state_dir: Path, writable: bool = True) -> Region:
        """Map an existing region; refuse one of another layout version with a clear message, and ask
        the agent's socket for the slot chunks (none when no agent answers: every slot reads free).
        Only the region's owner (root) can open it writable, and then gets live views; a read-only
        opener gets snapshots of both."""
        path = state_dir / REGION_FILE
        fd, mapping = _map_file(path, MAGIC, REGION_SIZE, writable)
        space = SlotSpace()
        if writable:
            region = cls(path, fd, mapping, space)
            region._refresh_view()
            return region
        # ctypes.from_buffer needs a writable buffer; a read-only reader takes snapshots instead.
        try:
            _place_view(space, state_dir, int(RegionLayout.from_buffer_copy(mapping).header.region_id))
            slots = SlotTableLayout.from_buffer_copy(space.snapshot())
        finally:
            space.close()
        region = cls.__new__(cls)
        region.path = path
        region._fd, region._map, region._space, region._keeper, region._server = fd, mapping, None, None, None
        region.doorbells = None
        region.layout = RegionLayout.from_buffer_copy(mapping)
        region.slots_layout = slots
        region._view_generation = -1
        region._assigned_words = memoryview(region.layout.assigned).cast("B").cast("Q")
        region._verified_lock = threading.Lock()
        region._verified_cache = {}
        region._verified_pids = memoryview(b"")  # a snapshot publishes nothing
        return region

    def _refresh_view(self) -> None:
        """An observer's live view: map the chunks again when the agent added or gave away some."""
        if self._keeper is not None or self._space is None:
            return
        generation = self.layout.header.chunk_generation
        if generation != self._view_generation:
            self._view_generation = _place_view(self._space, self.path.parent, int(self.layout.header.region_id))

    def close(self) -> None:
        self.__dict__.pop("slot_columns", None)  # its views point into the mappings about to go
        self._assigned_words.release()
        self._verified_pids.release()
        del self.layout, self.slots_layout
        if self._server is not None:
            self._server.close()
        if self._keeper is not None:
            self._keeper.close()
        if self.doorbells is not None:
            self.doorbells.close()
        if self._space is not None:
            self._space.close()
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view into the mapping; the OS unmaps at exit
        os.close(self._fd)

    # -- agent-owned parts -----------------------------------------------------------------------

    def heartbeat(self, now_ns: int) -> None:
        self.layout.header.heartbeat_ns = now_ns

    def set_gpus(self, gpus: list[tuple[str, int]]) -> None:
        """Publish the GPUs as (uuid, memory_total); the index in this list is the gpu index. Stores
        only what differs: the agent re-asserts it with the group table."""
        if len(gpus) > MAX_GPUS:
            raise RegionError(f"{len(gpus)} GPUs found; the region has room for {MAX_GPUS}")
        for index, (uuid, total) in enumerate(gpus):
            gpu = self.layout.gpus[index]
            encoded = uuid.encode()[: UUID_LEN - 1]
            if gpu.uuid != encoded:
                gpu.uuid = encoded
            if gpu.memory_total != total:
                gpu.memory_total = total
        if self.layout.header.n_gpus != len(gpus):
            self.layout.header.n_gpus = len(gpus)

    def set_managed_host_limit(self, limit: int) -> None:
        """Publish how much managed memory all gated processes together may hold (hook/gemtrace_region.h)."""
        if self.layout.header.managed_host_limit != limit:
            self.layout.header.managed_host_limit = limit

    def set_unattached(self, choice: int) -> None:
        """Publish what a gate that cannot get a slot does (enum gt_unattached; the agent's --unattached)."""
        if self.layout.header.unattached != choice:
            self.layout.header.unattached = choice

    def attach_counts(self) -> dict[tuple[int, str], int]:
        """Refused and failed attaches per (uid, reason) since the agent started (server.py)."""
        return self._server.counts.counts() if self._server is not None else {}

    def chunk_holdings(self) -> tuple[dict[int, int], int]:
        """The slot chunks each user holds (uid -> count), and how many none holds."""
        return self._keeper.holdings() if self._keeper is not None else ({}, MAX_CHUNKS)

    def gpu_uuids(self) -> list[str]:
        n_gpus = min(self.layout.header.n_gpus, MAX_GPUS)
        return [decode_name(self.layout.gpus[i].uuid) for i in range(n_gpus)]

    def group_index(self, name: str) -> int | None:
        encoded = name.encode()
        for index in range(MAX_GROUPS):
            if self.layout.groups[index].name == encoded:
                return index
        return None

    def defined_groups(self) -> dict[str, int]:
        """name -> index of every group the resource file defines now."""
        return {decode_name(g.name): i for i, g in enumerate(self.layout.groups) if g.name and g.defined == 1}

    def group_names(self) -> dict[int, str]:
        return {i: decode_name(g.name) for i, g in enumerate(self.layout.groups) if g.name}

    def set_group(self, name: str, memory_limit: int | None, min_util: float, max_util: float,
                  oversubscribe: int = 0) -> int:
        """Define or update a group; a name keeps its index while any assignment refers to it (gates
        read it there)."""
        encoded = name.encode()
        if not encoded or len(encoded) >= NAME_LEN:
            raise RegionError(f"group name {name!r} must be 1 to {NAME_LEN - 1} bytes")
        index = self.group_index(name)
        if index is None:
            free = [i for i in range(MAX_GROUPS) if not self.layout.groups[i].name]
            if not free:
                raise RegionError(
                    f"the region has room for {MAX_GROUPS} groups and every one is defined or still used by a "
                    "running process; define fewer groups"
                )
            index = free[0]
        self.put_group(index, name, memory_limit, min_util, max_util, oversubscribe)
        return index

    def put_group(self, index: int, name: str, memory_limit: int | None, min_util: float, max_util: float,
                  oversubscribe: int = 0) -> None:
        """Make entry `index` say exactly this group, storing only what differs (the agent re-asserts
        its table every second). `oversubscribe` is the header's oversubscribe_limit: 0 for none,
        NO_LIMIT for no bound but the host's (GroupConfig.oversubscribe_word makes it)."""
        encoded = name.encode()
        group = self.layout.groups[index]
        limit = NO_LIMIT if memory_limit is None else memory_limit
        min_ppm, max_ppm = round(min_util * UTIL_ONE), round(max_util * UTIL_ONE)
        if group.memory_limit != limit:
            group.memory_limit = limit
        if group.min_util_ppm != min_ppm:
            group.min_util_ppm = min_ppm
        if group.max_util_ppm != max_ppm:
            group.max_util_ppm = max_ppm
        if group.oversubscribe_limit != oversubscribe:
            group.oversubscribe_limit = oversubscribe
        if group.defined != 1:
            group.defined = 1
        if group.name != encoded:
            group.name = encoded  # last: a gate looking the name up sees complete limits

    def undefine_group(self, index: int) -> None:
        """The resource file dropped the group: keep its entry while assignments refer to it (the
        agent moves their processes to the default group, see the header), lift its hold."""
        if self.layout.groups[index].defined != 0:
            self.layout.groups[index].defined = 0

    def free_group(self, index: int) -> None:
        """Forget an undefined group no assignment refers to, so that its entry can serve a new name."""
        group = self.layout.groups[index]
        group.name = b""  # first: no gate finds it from now on
        ctypes.memset(ctypes.addressof(group) + NAME_LEN, 0, ctypes.sizeof(GroupRecord) - NAME_LEN)

    # -- assignments (the agent's decision of each process's group) --------------------------------

    def assign(self, index: int, pid: int, group: int) -> None:
        """Store slot `index`'s process's group as one 8-byte word, so that a gate reading it never
        sees the pid of one decision with the group of another."""
        word = assignment_word(pid, group)
        if self._assigned_words[index] != word:
            self._assigned_words[index] = word
            if pid:  # a gate may be waiting for it at attach (GT_ASSIGN_WAIT_NS) on the group half
                self._wake(ctypes.addressof(self.layout.assigned[index]) + Assignment.group.offset)

    def unassign(self, index: int) -> None:
        self.assign(index, 0, GROUP_UNASSIGNED)

    def assigned_group(self, index: int, pid: int) -> int | None:
        """The group the agent decided for `pid` in slot `index`, or None (not decided for it)."""
        word = self._assigned_words[index]
        group = word >> 32
        return group if (word & 0xFFFF_FFFF) == (pid & 0xFFFF_FFFF) and group != GROUP_UNASSIGNED else None

    def slot_groups(self) -> dict[int, int]:
        """slot index -> assigned group of every claimed slot whose assignment names its process."""
        self._refresh_view()
        columns = self.slot_columns
        return {i: g for i, g in enumerate(columns.groups()) if g != GROUP_UNASSIGNED}

    def move_slot(self, index: int, pid: int, old: int, new: int) -> bool:
        """Move a live process from group `old` (no longer defined) to `new`; False if its assignment
        changed meanwhile."""
        if self.assigned_group(index, pid) != old:
            return False
        self.assign(index, pid, new)
        return True

    def bump_generation(self) -> None:
        self.layout.header.config_generation += 1

    def is_held(self, gpu: int, group: int) -> bool:
        return bool(self.layout.control[gpu][group].held == HELD)

    def hold(self, gpu: int, group: int) -> None:
        control = self.layout.control[gpu][group]
        if control.held != HELD:
            control.held = HELD

    def release(self, gpu: int, group: int, word: int = RELEASED, wake: int = WAKE_FANOUT) -> None:
        """Let the group launch, with `word` saying how much its processes may keep queued
        (RELEASED_WORDS; hook/gemtrace_region.h, enum gt_held). Wakes `wake` of the threads that sleep
        on the word; each woken one wakes WAKE_FANOUT more (the wake tree), so that this call costs
        the same however many wait."""
        if word not in RELEASED_WORDS:
            raise ValueError(f"{word} is not a released state of a control word")
        control = self.layout.control[gpu][group]
        if control.held == word:
            return
        was_held = control.held == HELD
        control.held = word
        if was_held:
            control.grant_seq += 1
            self._wake(ctypes.addressof(control) + Control.held.offset, wake)

    def set_beside(self, gpu: int, group: int, production: Sequence[int]) -> None:
        """Name the slots of the GPU's production processes to an opportunistic group released beside
        them (RELEASED_BESIDE): while one of them has work queued, the group's gates keep a queue of a
        few kernels. More than fit: BESIDE_MANY, and the gates count production busy all the while.
        Written count last, so that a gate never reads an entry past what was written."""
        control = self.layout.control[gpu][group]
        if len(production) > BESIDE_SLOTS:
            control.beside_n = BESIDE_MANY
            return
        if control.beside_n == len(production) and list(control.beside_slots[: len(production)]) == list(production):
            return
        control.beside_n = 0
        for i, index in enumerate(production):
            control.beside_slots[i] = index
        control.beside_n = len(production)

    def set_ring_quiet(self, gpu: int, group: int, ring: bool) -> None:
        """Ask the group's gates to ring GPU `gpu`'s doorbell when a sync of theirs leaves the group with
        nothing queued there (hook/gemtrace_region.h, Launch gating): set before the group is released
        while another group waits, so that no sync of its slice misses it."""
        control = self.layout.control[gpu][group]
        if control.ring_quiet != ring:
            control.ring_quiet = int(ring)

    def release_all(self) -> None:
        for gpu in range(MAX_GPUS):
            for group in range(MAX_GROUPS):
                self.release(gpu, group)

    def stop(self) -> None:
        """A clean stop of the agent: nobody waits on a word, and gates see no agent."""
        self.release_all()
        self.layout.header.heartbeat_ns = 0
        self.layout.header.agent_pid = 0
        if self.doorbells is not None:
            self.doorbells.ring_all()  # a scheduler asleep on its bell sees the stop now

    @staticmethod
    def _wake(address: int, count: int = futex.EVERYONE) -> None:
        futex.wake(address, count)

    # -- verified memory (issue 25) ---------------------------------------------------------------

    def publish_verified(self, figures: Mapping[int, Mapping[int, tuple[int, int]]]) -> None:
        """Store, for every claimed slot whose pid is in `figures` (pid -> GPU index -> (device bytes,
        managed bytes); a GPU left out holds nothing), what the agent verified that process holds:
        the figures other users' gates count for it (hook/gemtrace_region.h, Verified memory). A slot
        whose pid is not in `figures` keeps its entry. Stores only what differs."""
        if not figures:
            return
        columns = self.slot_columns
        pids = columns.pid
        with self._verified_lock:  # the poller and eBPF's watcher both publish
            self._store_verified(columns.live(), pids, figures)

    def _store_verified(self, live: list[int], pids: memoryview,
                        figures: Mapping[int, Mapping[int, tuple[int, int]]]) -> None:
        # On every eBPF wake-up with up to GT_MAX_SLOTS live slots: a slot whose entry still names its
        # process with the figures last stored is skipped on one dict comparison, not 32 ctypes reads.
        cache = self._verified_cache
        stored_pids = self._verified_pids
        for index in live:
            pid = pids[index]
            held = figures.get(pid)
            if held is None:
                continue
            before = cache.get(index)
            if before is not None and before[0] == pid and before[1] == held and stored_pids[index] == pid:
                continue
            entry = self.layout.verified[index]
            if entry.pid != pid or before is None or before[0] != pid:
                entry.pid = 0  # first: no reader takes the figures below for the former occupant's
                for gpu in range(MAX_GPUS):
                    entry.memory[gpu], entry.managed[gpu] = held.get(gpu, (0, 0))
                entry.pid = pid  # last: the figures are complete before a reader can match the pid
            else:  # only the GPUs it holds or held: what the cache says is stored there
                memory, managed = entry.memory, entry.managed
                for gpu in held.keys() | before[1].keys():
                    memory[gpu], managed[gpu] = held.get(gpu, (0, 0))
            cache[index] = (pid, dict(held))

    def owner_of(self, pid: int) -> int | None:
        """The uid whose chunk holds `pid`'s slot, or None (no live slot names it)."""
        columns = self.slot_columns
        for index in columns.live():
            if columns.pid[index] == pid:
                owner = int(self.layout.chunk_owner[index // CHUNK_SLOTS])
                return None if owner == NO_OWNER else owner
        return None

    def trust_chunks(self, trusted: Callable[[int], bool]) -> None:
        """chunk_trusted[c] = 1 for every chunk whose owner (a uid) `trusted` names, 0 for the rest:
        whose slots other users' gates count at their own figures rather than at the verified ones
        (hook/gemtrace_region.h, Verified memory)."""
        for chunk in range(MAX_CHUNKS):
            owner = self.layout.chunk_owner[chunk]
            word = 1 if owner != NO_OWNER and trusted(owner) else 0
            if self.layout.chunk_trusted[chunk] != word:
                self.layout.chunk_trusted[chunk] = word

    def verified(self, index: int) -> tuple[int, list[int], list[int]]:
        """Slot `index`'s verified entry: (pid, device bytes per GPU, managed bytes per GPU)."""
        entry = self.layout.verified[index]
        return entry.pid, list(entry.memory), list(entry.managed)

    # -- slots -----------------------------------------------------------------------------------

    @cached_property
    def slot_columns(self) -> SlotColumns:
        """The one reader of the slots' counters (the scheduler, the reaper and the accounting use it)."""
        return SlotColumns(self.layout, self.slots_layout)

    def live_slots(self) -> Iterator[tuple[int, Slot]]:
        """(index, slot) for every claimed slot; the slot is the live view, copy what must not move."""
        self._refresh_view()
        slots = self.slots
        for index in self.slot_columns.live():
            yield index, slots[index]

    def slot_pids(self) -> list[int]:
        """The pid of every slot (0 = free), read in one strided pass: cheap enough for every tick."""
        self._refresh_view()
        return self.slot_columns.pids()

    def translate_slot(self, index: int, pid: int, host_pid: int) -> bool:
        """Give a slot claimed from another PID namespace (`pid` there) the pid its process has in the
        agent's (`host_pid`); False if the slot changed owner meanwhile. Not atomic against a gate
        freeing and another claiming the slot between the check and the store: a window of a few
        instructions, and the reaper frees a slot whose pid is dead within a tick."""
        slot = self.slots[index]
        if slot.pid != pid:
            return False
        slot.pid = host_pid
        return True

    def free_slot(self, index: int, pid: int) -> bool:
        """Free the slot of a process that has died; False if the slot changed owner meanwhile."""
        slot = self.slots[index]
        if slot.pid != pid:
            return False
        if self.assigned_group(index, pid) is not None:
            self.unassign(index)
        if self.layout.verified[index].pid == pid:
            ctypes.memset(ctypes.addressof(self.layout.verified[index]), 0, ctypes.sizeof(Verified))
        slot.flags = 0  # first: a reader that still sees the flag after reading the counters read them whole
        ctypes.memset(ctypes.addressof(slot) + Slot.flags.offset, 0, ctypes.sizeof(Slot) - Slot.flags.offset)
        slot.pid = 0  # last: a gate claiming it with CAS finds a zeroed slot
        return True
