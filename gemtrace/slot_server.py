"""The agent's socket where gates get their slots (hook/gemtrace_region.h: GT_ATTACH_SOCKET).

One SOCK_SEQPACKET message each way: a request (join, or view), a reply carrying one descriptor per
chunk and then the doorbells' (SCM_RIGHTS; gemtrace/doorbells.py). The asker's uid comes from the
kernel (SO_PEERCRED), never from the message, so a process gets writable chunks of its own user
only. The socket is mode 0666 in the root-owned state dir: any local user may ask, nobody but the
agent can replace it.

`SlotServer` is a thread of the agent. It never blocks on one client: connections wait in a poll set,
a silent one is dropped after CLIENT_TIMEOUT_SECONDS, and at most MAX_PENDING are kept (the oldest goes),
so a user who opens connections and sends nothing delays nobody's attach by more than that.
`ask()` is the client side for Python observers (`gemtrace top`, the launcher, tests).
"""

from __future__ import annotations

import array
import ctypes
import os
import select
import socket
import struct
import threading
import time
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
from gemtrace.eventlog import USER_LINES
from gemtrace.slot_space import ChunkKeeper

log = structlog.get_logger("gemtrace.slots")

SOCKET_MODE = 0o666  # every local user's gates ask here; the kernel says who asks
CLIENT_TIMEOUT_SECONDS = 1.0
MAX_PENDING = 256


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


class SlotServer:
    """The socket and its thread."""

    def __init__(self, state_dir: Path, keeper: ChunkKeeper, bells_fd: int,
                 on_join: Callable[[], None] | None = None) -> None:
        self.path = state_dir / ATTACH_SOCKET
        self.keeper = keeper
        self.bells_fd = bells_fd
        self._on_join = on_join  # called after each join answered: a gate is about to claim a slot
        self.path.unlink(missing_ok=True)  # a dead agent's
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(str(self.path))
        os.chmod(self.path, SOCKET_MODE)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
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
        poll = select.poll()
        poll.register(self._listener.fileno(), select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        pending: dict[int, tuple[socket.socket, float]] = {}
        while True:
            for fd, _ in poll.poll(int(CLIENT_TIMEOUT_SECONDS * 500)):
                if fd == self._stop_r:
                    for conn, _ in pending.values():
                        conn.close()
                    return
                if fd == self._listener.fileno():
                    self._accept(poll, pending)
                elif fd in pending:
                    conn, _ = pending.pop(fd)
                    poll.unregister(fd)
                    self._answer(conn)
            now = time.monotonic()
            for fd, (conn, since) in list(pending.items()):
                if now - since > CLIENT_TIMEOUT_SECONDS:
                    del pending[fd]
                    poll.unregister(fd)
                    conn.close()

    def _accept(self, poll: select.poll, pending: dict[int, tuple[socket.socket, float]]) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the client retries within a second
                USER_LINES.log(log.warning, None, "slot_socket_accept_failed", error=e.strerror or str(e))
                return
            if len(pending) >= MAX_PENDING:
                oldest = min(pending, key=lambda fd: pending[fd][1])
                pending.pop(oldest)[0].close()
                poll.unregister(oldest)
            conn.setblocking(False)
            pending[conn.fileno()] = (conn, time.monotonic())
            poll.register(conn.fileno(), select.POLLIN)

    def _answer(self, conn: socket.socket) -> None:
        uid: int | None = None  # who asked, for the per-uid limit on the lines below (gemtrace/eventlog.py)
        try:
            with conn:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
                request = conn.recv(256)
                reply, fds = reply_for(request, uid, self.keeper, self.bells_fd)
                if reply.status == ATTACH_REFUSED:
                    USER_LINES.log(log.info, uid, "slot_request_refused", pid=pid, size=len(request))
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
                conn.sendmsg([bytes(reply)], ancillary)
                joined = reply.status == ATTACH_OK and AttachRequest.from_buffer_copy(request).kind == ATTACH_JOIN
                if joined and self._on_join is not None:
                    self._on_join()
        except OSError as e:
            USER_LINES.log(log.info, uid, "slot_request_failed", error=e.strerror or str(e))
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
