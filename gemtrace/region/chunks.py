"""The slot table's memory: GT_MAX_SLOTS slots in one reserved address range, made of per-user chunks.

hook/gemtrace_region.h says why: each chunk is a memfd sealed against shrinking and growing, given to
one user (uid), mapped writable only by that user's gates (and the agent) and read-only by everyone
else, so a process can write only its own user's slots and nobody can truncate the table under anyone.
Chunk c sits at offset c * CHUNK_BYTES of the range on every side, so the table reads as one array
(`table()`), and the range reads as zeros (free slots) wherever no chunk is mapped.

`SlotSpace` is the range and the placing of chunk descriptors in it (agent and observers alike).
`ChunkKeeper` is the agent's side: it makes chunks for users, knows whose each is (the region's
chunk_owner[] and chunk_generation, which gates read), and takes back after a restart the chunks that
live gates still map. server.py hands the chunks out over the socket.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gemtrace.contract import (
    CHUNK_BYTES,
    CHUNK_SLOTS,
    MAX_CHUNKS,
    MAX_SLOTS,
    NO_OWNER,
    SLOT_SIZE,
    SLOTS_MEMFD,
    USER_CHUNKS,
)
from gemtrace.region.layout import RegionLayout, SlotTableLayout

TABLE_BYTES = MAX_SLOTS * CHUNK_BYTES // CHUNK_SLOTS
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
CHUNK_MODE = 0o600

# A chunk no slot of which was taken for this long may be given to another user when none is left
# unowned: a gate that was just told the chunk is its user's has claimed its slot by then.
RECLAIM_AFTER_SECONDS = 10.0
JOIN_WINDOW_SECONDS = 1.0  # a gate claims its slot within this of its answer

# Every local user may ask for chunks, and a user's process can keep a slot of each of its chunks
# taken for as long as it lives, so chunks are shared out so that no user's asking can take another's
# (docs/security.md, "Attaching"): root's gates (the operator's) always find ROOT_RESERVED_CHUNKS that
# no other user may take, and a user's second and later chunks leave SHARED_HEADROOM_CHUNKS unowned,
# so that every other user still finds a first chunk (32 processes) while some hoard.
ROOT_UID = 0
ROOT_RESERVED_CHUNKS = 8
SHARED_HEADROOM_CHUNKS = 8

_PROT_READ, _PROT_WRITE = 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(address: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    result = _libc.mmap(address, size, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    return int(result)


def chunk_name(region_id: int, chunk: int, uid: int) -> str:
    return f"{SLOTS_MEMFD}-{region_id:x}-c{chunk}-u{uid}"


def _chunk_pattern(region_id: int) -> re.Pattern[str]:
    return re.compile(rf"/memfd:{re.escape(SLOTS_MEMFD)}-{region_id:x}-c(\d+)-u(\d+) \(deleted\)$")


def sound_chunk(fd: int) -> bool:
    """A descriptor that is a sealed chunk of the right size: no mapping of it can fault."""
    try:
        return os.fstat(fd).st_size == CHUNK_BYTES and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:
        return False


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of `size` bytes, root's and mode 0600, sealed against shrinking and growing (and
    against new seals): no mapping of it can fault, whoever holds a descriptor. The caller closes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        # A memfd is made mode 0777: anyone holding a read-only descriptor could open it again
        # writable through /proc/self/fd. The agent's (root's) alone, then; a user gets a writable
        # descriptor from the socket where it may write, and cannot change the mode (not the owner).
        os.fchmod(fd, CHUNK_MODE)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def find_chunks(region_id: int, proc_root: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """The chunks of region `region_id` that live processes map: chunk -> (read-write descriptor, uid).
    Found by the memfd's name in /proc/PID/maps, opened through /proc/PID/map_files (root only), and
    believed only when root made it, mode 0600, sealed and of the right size."""
    found: dict[int, tuple[int, int]] = {}
    pattern = _chunk_pattern(region_id)
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            match = pattern.search(line)
            if not match or int(match[1]) in found or int(match[1]) >= MAX_CHUNKS:
                continue
            try:
                fd = os.open(entry / "map_files" / line.split(" ", 1)[0], os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            info = os.fstat(fd)
            if info.st_uid != 0 or info.st_mode & 0o077 or not sound_chunk(fd):
                os.close(fd)
                continue
            found[int(match[1])] = (fd, int(match[2]))
    return found


class SlotSpace:
    """The reserved range. Writable anonymous memory where no chunk is placed: the agent's own tests
    stand in for gates by writing slots there; no gate ever sees those."""

    def __init__(self) -> None:
        self.address = _mmap(None, TABLE_BYTES, _PROT_READ | _PROT_WRITE,
                             _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)

    def table(self) -> SlotTableLayout:
        return SlotTableLayout.from_address(self.address)

    def place(self, chunk: int, fd: int, writable: bool) -> None:
        """Map chunk descriptor `fd` at chunk `chunk`'s place (the descriptor stays the caller's)."""
        if not 0 <= chunk < MAX_CHUNKS:
            raise ValueError(f"chunk {chunk} is outside the table's {MAX_CHUNKS}")
        _mmap(self.address + chunk * CHUNK_BYTES, CHUNK_BYTES,
              _PROT_READ | (_PROT_WRITE if writable else 0), _MAP_SHARED | _MAP_FIXED, fd)

    def snapshot(self) -> bytes:
        return ctypes.string_at(self.address, TABLE_BYTES)

    def close(self) -> None:
        """Unmap the range. Nothing may read the table afterwards (its views point into it)."""
        if self.address:
            _libc.munmap(self.address, TABLE_BYTES)
            self.address = 0


class ChunkKeeper:
    """The agent's chunks: one memfd each, writable and read-only descriptors for the socket, and the
    region's chunk_owner[]/chunk_generation kept in step. Thread-safe (the socket's thread asks, the
    agent's threads read the table)."""

    def __init__(self, space: SlotSpace, layout: RegionLayout, log: Callable[..., None] | None = None) -> None:
        self.space = space
        self.layout = layout
        self._log = log or (lambda event, **kw: None)
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[int, int]] = {}  # chunk -> (read-write fd, read-only fd)
        self._empty_since: dict[int, float] = {}  # chunk -> when it was first seen with no slot taken
        self._joins: dict[int, list[float]] = {}  # uid -> when its recent joins were answered

    # -- what the socket asks ----------------------------------------------------------------------

    def join(self, uid: int) -> tuple[list[tuple[int, int, bool]], bool]:
        """The chunks to send a gate of `uid`: (chunk, fd, writable) for every chunk, its user's
        read-write, and whether its user's chunks have a free slot (made if need be). Gates of a user
        that ask together (hundreds of processes starting at once) each need a slot: the user's chunks
        keep one free slot for every join answered in the last JOIN_WINDOW_SECONDS."""
        with self._lock:
            now = time.monotonic()
            recent = [t for t in self._joins.get(uid, []) if now - t < JOIN_WINDOW_SECONDS] + [now]
            self._joins[uid] = recent
            mine = self._owned_by(uid)
            while sum(self._free_slots(c) for c in mine) < len(recent) and len(mine) < USER_CHUNKS:
                chunk = self._new_chunk(uid)
                if chunk is None:
                    break
                mine.append(chunk)
            ok = any(self._free_slots(c) for c in mine)
            return [(c, rw if c in mine else ro, c in mine) for c, (rw, ro) in sorted(self._fds.items())], ok

    def view(self) -> list[tuple[int, int, bool]]:
        """Every chunk, read-only (an observer, or a gate mapping chunks added since it joined)."""
        with self._lock:
            return [(c, ro, False) for c, (_, ro) in sorted(self._fds.items())]

    @property
    def generation(self) -> int:
        return int(self.layout.header.chunk_generation)

    def holdings(self) -> tuple[dict[int, int], int]:
        """The chunks each user holds (uid -> count), and how many no user holds."""
        with self._lock:
            held: dict[int, int] = {}
            for chunk in self._fds:
                uid = int(self.layout.chunk_owner[chunk])
                held[uid] = held.get(uid, 0) + 1
            return held, MAX_CHUNKS - len(self._fds)

    # -- restart -------------------------------------------------------------------------------------

    def recover(self, proc_root: Path = Path("/proc")) -> int:
        """Take back the chunks live processes still map (an agent restart): each is found by its
        memfd's name in /proc/PID/maps and opened through /proc/PID/map_files, and only one that root
        made, sealed and of the right size, is believed. Returns how many chunks came back. Chunks the
        adopted region names but nobody maps are forgotten (their processes are gone)."""
        found = find_chunks(int(self.layout.header.region_id), proc_root)
        with self._lock:
            for chunk in range(MAX_CHUNKS):
                if chunk in found:
                    fd, uid = found[chunk]
                    self._adopt(chunk, fd, uid)
                elif self.layout.chunk_owner[chunk] != NO_OWNER:
                    self.layout.chunk_owner[chunk] = NO_OWNER
            self.layout.header.chunk_generation += 1
        for chunk, (_, uid) in sorted(found.items()):
            self._log("slot_chunk_recovered", chunk=chunk, uid=uid)
        return len(found)

    def close(self) -> None:
        with self._lock:
            for rw, ro in self._fds.values():
                os.close(rw)
                os.close(ro)
            self._fds.clear()

    # -- inside the lock -------------------------------------------------------------------------------

    def _owned_by(self, uid: int) -> list[int]:
        return [c for c in self._fds if self.layout.chunk_owner[c] == uid]

    def _free_slots(self, chunk: int) -> int:
        # The chunk's pids (the first word of each slot) in one read: every join asks this of each of
        # its user's chunks, and a user may join as fast as it can.
        words = (ctypes.c_int32 * (CHUNK_BYTES // 4)).from_address(self.space.address + chunk * CHUNK_BYTES)
        return memoryview(words).cast("B").cast("i")[::SLOT_SIZE // 4].tolist().count(0)

    def _new_chunk(self, uid: int) -> int | None:
        free = [c for c in range(MAX_CHUNKS) if c not in self._fds]
        kept = self._kept_from(uid)
        if len(free) <= kept:
            free += self._reclaimable(uid)
        if len(free) <= kept:
            return None  # the socket counts and logs the refusal (server.py), once per user
        chunk = free[0]
        fd = sealed_memfd(chunk_name(int(self.layout.header.region_id), chunk, uid), CHUNK_BYTES)
        old = self._fds.get(chunk)
        self._adopt(chunk, fd, uid)
        if old is not None:
            os.close(old[0])
            os.close(old[1])
        self.layout.header.chunk_generation += 1
        self._log("slot_chunk_made", chunk=chunk, uid=uid)
        return chunk

    def _kept_from(self, uid: int) -> int:
        """How many of the chunks free now a new chunk for `uid` must leave free: root's reserve (what
        root does not hold of it yet), and for a user who has a chunk already, the others' headroom."""
        if uid == ROOT_UID:
            return 0
        root_short = max(0, ROOT_RESERVED_CHUNKS - len(self._owned_by(ROOT_UID)))
        return root_short + (SHARED_HEADROOM_CHUNKS if self._owned_by(uid) else 0)

    def _reclaimable(self, uid: int) -> list[int]:
        """Chunks that have had no slot taken for RECLAIM_AFTER_SECONDS (root's only past its reserve,
        unless root asks)."""
        now = time.monotonic()
        ready = []
        spare_root = uid == ROOT_UID or len(self._owned_by(ROOT_UID)) > ROOT_RESERVED_CHUNKS
        for chunk in sorted(self._fds):
            if not spare_root and self.layout.chunk_owner[chunk] == ROOT_UID:
                continue
            if self._free_slots(chunk) < CHUNK_SLOTS:
                self._empty_since.pop(chunk, None)
                continue
            since = self._empty_since.setdefault(chunk, now)
            if now - since >= RECLAIM_AFTER_SECONDS:
                ready.append(chunk)
        return ready

    def _adopt(self, chunk: int, fd: int, uid: int) -> None:
        # A read-only descriptor of the same memfd, for the users who may only read it.
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.space.place(chunk, fd, writable=True)
        self._fds[chunk] = (fd, ro)
        self._empty_since.pop(chunk, None)
        self.layout.chunk_owner[chunk] = uid
