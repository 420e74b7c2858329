"""The agent's socket where gates get their slots (hook/gemtrace_region.h: GT_ATTACH_SOCKET).

One SOCK_SEQPACKET message each way: a request (join, or view), a reply carrying one descriptor per
chunk and then the doorbells' (SCM_RIGHTS; doorbells.py). The asker's uid comes from the
kernel (SO_PEERCRED), never from the message, so a process gets writable chunks of its own user
only. The socket is mode 0666 in the root-owned state dir: any local user may ask, nobody but the
agent can replace it.

`SlotServer` is a thread of the agent, and every local user shares it, so it is fair per user
(docs/security.md, "Attaching"): it accepts every connection at once and learns its uid there; a
user's connections wait in that user's own queue, at most PENDING_PER_UID of them (past that the
user's oldest goes, nobody else's), each for CLIENT_TIMEOUT_SECONDS at most; the ready ones are
answered one user at a time, round-robin, at most ANSWERS_PER_UID of each user's between two looks
at the listener, so that a new connection is accepted within one short round whatever one user
sends. It never blocks on a client (every socket is
non-blocking). Whatever one user sends, silence, garbage, or valid requests it never uses, costs
that user's queue and chunks only. Each refused or failed attach is counted per uid
(`AttachCounts`: gemtrace_attach_refusals_total) and logged through the per-uid limit on lines a
user's input triggers (gemtrace/eventlog.py, USER_LINES: a burst, then one a second, and a count of
the rest).
`ask()` is the client side for Python observers (`gemtrace top`, the launcher, tests).
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import structlog

from gemtrace.contract import (
    ATTACH_FULL,
    ATTACH_JOIN,
    ATTACH_OK,
    ATTACH_REFUSED,
    ATTACH_SOCKET,
    ATTACH_VIEW,
    MAX_CHUNKS,
    REGION_VERSION,
)
from gemtrace.eventlog import USER_LINES, UserLines
from gemtrace.region.chunks import ChunkKeeper

log = structlog.get_logger("gemtrace.slots")

SOCKET_MODE = 0o666  # every local user's gates ask here; the kernel says who asks
CLIENT_TIMEOUT_SECONDS = 1.0  # a connection says what it wants within this, or is closed
# One user's connections waiting for a request; past it that user's oldest goes. A user's gates that
# start together (hundreds at once) each connect and ask at once: they fit, and any dropped retries.
PENDING_PER_UID = 256
LISTEN_BACKLOG = 4096  # the kernel's queue before accept: drained at every wake, so a flood rarely fills it
ACCEPT_BATCH = 1024  # connections accepted per wake at most, so that ready ones are answered meanwhile
ANSWERS_PER_UID = 8  # a user's requests answered per wake at most; the rest wait for the next

# Why an attach was refused or failed (the `reason` label of gemtrace_attach_refusals_total).
FULL = "full"  # the user's chunks (or all chunks) have no free slot
MALFORMED = "malformed"  # a request of another size, version or kind
TIMEOUT = "timeout"  # no request within CLIENT_TIMEOUT_SECONDS
DROPPED = "dropped"  # the user had PENDING_PER_UID connections waiting; its oldest was closed
FAILED = "failed"  # the reply could not be sent (the client went, or does not read)
REASONS = (FULL, MALFORMED, TIMEOUT, DROPPED, FAILED)


class AttachRequest(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("kind", ctypes.c_uint32)]


class AttachEntry(ctypes.Structure):
    _fields_ = [("chunk", ctypes.c_uint32), ("writable", ctypes.c_uint32)]


class AttachReply(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
        ("chunk_generation", ctypes.c_uint64),
        ("n_entries", ctypes.c_uint32),
        ("bells", ctypes.c_uint32),
        ("entries", AttachEntry * MAX_CHUNKS),
    ]


def reply_for(request: bytes, uid: int, keeper: ChunkKeeper, bells_fd: int) -> tuple[AttachReply, list[int]]:
    """The reply to one request from a process of `uid`, and the descriptors that go with it: the
    chunks', then the doorbells' (`bells_fd`)."""
    reply = AttachReply(version=REGION_VERSION, status=ATTACH_REFUSED)
    if len(request) != ctypes.sizeof(AttachRequest):
        return reply, []
    asked = AttachRequest.from_buffer_copy(request)
    if asked.version != REGION_VERSION or asked.kind not in (ATTACH_JOIN, ATTACH_VIEW):
        return reply, []
    if asked.kind == ATTACH_JOIN:
        chunks, ok = keeper.join(uid)
        reply.status = ATTACH_OK if ok else ATTACH_FULL
    else:
        chunks, reply.status = keeper.view(), ATTACH_OK
    reply.chunk_generation = keeper.generation
    reply.n_entries = len(chunks)
    for k, (chunk, _, writable) in enumerate(chunks):
        reply.entries[k] = AttachEntry(chunk, int(writable))
    reply.bells = 1
    return reply, [fd for _, fd, _ in chunks] + [bells_fd]


class AttachCounts:
    """Refused and failed attaches per (uid, reason), and the one place they are logged, through the
    per-uid limit on lines a user's input triggers (`lines`), so that a user's flood cannot flood the
    journal. Thread-safe (the socket's thread counts, scrapes read)."""

    def __init__(self, lines: UserLines = USER_LINES) -> None:
        self._lines = lines
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str], int] = {}

    def note(self, uid: int, reason: str, **fields: object) -> None:
        with self._lock:
            self._counts[uid, reason] = self._counts.get((uid, reason), 0) + 1
        self._lines.log(log.warning, uid, "attach_refused", reason=reason, **fields)

    def counts(self) -> dict[tuple[int, str], int]:
        with self._lock:
            return dict(self._counts)


class SlotServer:
    """The socket and its thread."""

    def __init__(self, state_dir: Path, keeper: ChunkKeeper, bells_fd: int,
                 on_join: Callable[[], None] | None = None) -> None:
        self.path = state_dir / ATTACH_SOCKET
        self.keeper = keeper
        self.bells_fd = bells_fd
        self.counts = AttachCounts()
        self._on_join = on_join  # called after each join answered: a gate is about to claim a slot
        self.path.unlink(missing_ok=True)  # a dead agent's
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(str(self.path))
        os.chmod(self.path, SOCKET_MODE)
        self._listener.listen(LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll = select.poll()
        # uid -> its connections waiting for a request, oldest first: fd -> (socket, pid, deadline)
        self._pending: dict[int, OrderedDict[int, tuple[socket.socket, int, float]]] = {}
        self._uid_of: dict[int, int] = {}  # fd -> uid
        self._thread = threading.Thread(target=self._serve, name="gemtrace-slots", daemon=True)
        self._thread.start()

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        try:
            self.path.unlink()
        except OSError:
            pass

    def _serve(self) -> None:
        self._poll.register(self._listener.fileno(), select.POLLIN)
        self._poll.register(self._stop_r, select.POLLIN)
        while True:
            ready: dict[int, list[tuple[int, socket.socket]]] = {}
            for fd, _ in self._poll.poll(self._wait_ms()):
                if fd == self._stop_r:
                    for fd in list(self._uid_of):
                        self._forget(fd)[0].close()
                    return
                if fd == self._listener.fileno():
                    self._accept()
                elif fd in self._uid_of:
                    uid = self._uid_of[fd]
                    ready.setdefault(uid, []).append((fd, self._pending[uid][fd][0]))
            # One answer per user in turn: a user with many ready connections goes no faster than
            # one with a single one. What is left stays ready for the next wake (poll is level-triggered).
            for _ in range(ANSWERS_PER_UID):
                for uid in list(ready):
                    fd, ready_conn = ready[uid].pop(0)
                    if not ready[uid]:
                        del ready[uid]
                    # The very connection that was ready: an accept in this wake may have dropped it
                    # and given its descriptor number to a new connection, maybe another user's.
                    queue = self._pending.get(uid)
                    entry = queue.get(fd) if queue is not None else None
                    if entry is not None and entry[0] is ready_conn:
                        conn, pid, _ = self._forget(fd)
                        self._answer(conn, pid, uid)
            self._expire()

    def _wait_ms(self) -> int:
        """Until the nearest deadline (each user's oldest connection is its nearest)."""
        deadlines = [next(iter(q.values()))[2] for q in self._pending.values() if q]
        if not deadlines:
            return -1
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _expire(self) -> None:
        now = time.monotonic()
        for uid, queue in list(self._pending.items()):
            while queue:
                fd, (_, pid, deadline) = next(iter(queue.items()))
                if deadline > now:
                    break
                self._forget(fd)[0].close()
                self.counts.note(uid, TIMEOUT, pid=pid)

    def _forget(self, fd: int) -> tuple[socket.socket, int, float]:
        uid = self._uid_of.pop(fd)
        queue = self._pending[uid]
        entry = queue.pop(fd)
        if not queue:
            del self._pending[uid]
        self._poll.unregister(fd)
        return entry

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._shed():
                    continue  # a descriptor is free again: the connection waiting in the kernel comes next
                USER_LINES.log(log.warning, None, "slot_socket_accept_failed", error=e.strerror or str(e))
                return
            try:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
            except OSError:
                conn.close()
                continue
            conn.setblocking(False)
            queue = self._pending.setdefault(uid, OrderedDict())
            if len(queue) >= PENDING_PER_UID:
                old, old_pid, _ = self._forget(next(iter(queue)))
                old.close()
                self.counts.note(uid, DROPPED, pid=old_pid)
                queue = self._pending.setdefault(uid, OrderedDict())
            fd = conn.fileno()
            queue[fd] = (conn, pid, time.monotonic() + CLIENT_TIMEOUT_SECONDS)
            self._uid_of[fd] = uid
            self._poll.register(fd, select.POLLIN)

    def _shed(self) -> bool:
        """Out of descriptors: close the oldest connection of the user with the most waiting, so that
        the agent's limit is spent by whoever spends most of it. False when none waits."""
        if not self._pending:
            return False
        uid = max(self._pending, key=lambda u: len(self._pending[u]))
        fd = next(iter(self._pending[uid]))
        conn, pid, _ = self._forget(fd)
        conn.close()
        self.counts.note(uid, DROPPED, pid=pid)
        return True

    def _answer(self, conn: socket.socket, pid: int, uid: int) -> None:
        try:
            with conn:
                request = conn.recv(256)
                if not request:
                    return  # the client went away before asking: nothing was refused
                reply, fds = reply_for(request, uid, self.keeper, self.bells_fd)
                if reply.status == ATTACH_REFUSED:
                    self.counts.note(uid, MALFORMED, pid=pid, size=len(request))
                elif reply.status == ATTACH_FULL:
                    self.counts.note(uid, FULL, pid=pid)
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
                conn.sendmsg([bytes(reply)], ancillary)
                joined = reply.status == ATTACH_OK and AttachRequest.from_buffer_copy(request).kind == ATTACH_JOIN
                if joined and self._on_join is not None:
                    self._on_join()
        except OSError as e:
            self.counts.note(uid, FAILED, pid=pid, error=e.strerror or str(e))
        except Exception:  # never let one client end the thread every gate needs
            USER_LINES.log(log.exception, uid, "slot_request_crashed")


def ask(state_dir: Path, kind: int = ATTACH_VIEW) -> tuple[AttachReply, list[int]]:
    """Ask the agent in `state_dir`; returns its reply and the chunks' descriptors, one per entry (the
    caller closes them; the doorbells', which only gates ring, is closed here). Raises OSError when no
    agent answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(CLIENT_TIMEOUT_SECONDS * 2)
        sock.connect(str(state_dir / ATTACH_SOCKET))
        sock.send(bytes(AttachRequest(REGION_VERSION, kind)))
        data, fds, _, _ = socket.recv_fds(sock, ctypes.sizeof(AttachReply), MAX_CHUNKS + 1)
    reply = AttachReply.from_buffer_copy(data.ljust(ctypes.sizeof(AttachReply), b"\0"))
    if reply.version == REGION_VERSION and reply.bells == 1 and len(fds) == reply.n_entries + 1:
        os.close(fds.pop())
    if reply.version != REGION_VERSION or reply.n_entries != len(fds) or reply.n_entries > MAX_CHUNKS:
        for fd in fds:
            os.close(fd)
        raise OSError(f"{state_dir / ATTACH_SOCKET}: an answer of another version or shape")
    return reply, fds
