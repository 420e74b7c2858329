"""What the tests share that belongs to no one fixture: units, a free port, waiting on a condition,
and a gate's claim of a slot. Each is written here once; test modules and bench/ import it.

Must stay light: no fixture, no build, nothing started on import (unit tests import it), and no
pytest (the GPU benches import it on machines that have only their own dependencies).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gemtrace import contract
from gemtrace import region as rg

MiB = 1 << 20
GiB = 1 << 30


# The host's gemtrace directories (/etc/gemtrace, /usr/lib/gemtrace, /var/lib/gemtrace, /run/gemtrace) are
# owned by one test run at a time: tests/test_deb.py installs and purges the package there, and the test
# cluster binds its node's directories over them (a purge removes those mount points, which detaches the
# node's binds: its pods then got the host's paths, and hostPaths made as empty directories).
HOST_DIRS_LOCK = Path("/run/lock/gemtrace-tests-host-dirs.lock")
HOST_DIRS_WAIT_S = 45 * 60


@contextmanager
def owning_host_dirs(what: str, wait_s: float = HOST_DIRS_WAIT_S) -> Iterator[None]:
    """Hold the host's gemtrace directories for `what`, waiting while another test run holds them. The
    lock is an open file's, not inherited by children: it goes when this process does, however it ends."""
    HOST_DIRS_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(HOST_DIRS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = HOST_DIRS_LOCK.read_text().strip() or "another test run"
                    raise TimeoutError(f"{what} waited {wait_s:.0f} s for the host's gemtrace directories, which "
                                       f"{holder} holds ({HOST_DIRS_LOCK})") from None
                time.sleep(1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def free_port() -> int:
    """A loopback port nobody holds now (the kernel's choice, so parallel tests do not collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(what: str, check: Callable[[], Any], timeout: float = 20, step: float = 0.01, *,
               proc: subprocess.Popen[Any] | None = None,
               retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Wait for `check()` to be true and return it; fail naming `what`, and the last value seen, after
    `timeout` seconds. Tests wait on a condition this way, never on a fixed sleep: a sleep is either too
    short on a loaded machine or longer than needed everywhere else.

    `proc`: fail at once when that process exits (a server that died will never answer).
    `retry_on`: exceptions that mean "not yet" (a server that does not listen yet raises OSError)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with status {proc.returncode}")
        try:
            last = check()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def claim(region: rg.Region, index: int, pid: int, group: int) -> rg.Slot:
    """A gate's claim of slot `index` and the agent's decision putting it in `group`, as they would
    leave the region (gemtrace/agent/membership.py decides for real)."""
    slot = region.slots[index]
    slot.flags = contract.SLOT_GATED
    slot.pid = pid
    region.assign(index, pid, group)
    return slot


@contextmanager
def scratch_cgroup(path: str) -> Iterator[Path]:
    """The cgroup `path` (relative, unique to the caller: a pid in it), made for the test (root only)
    and removed afterwards with the parents it had to make. Yields its cgroup.procs file, where a
    process writes its pid to enter it; /proc/PID/cgroup then shows "/" + path. On cgroup v2 under the
    unified root; on v1 under the pids hierarchy, which every process is in. Never under /kubepods:
    the test cluster's kubelet removes cgroups there that it did not make."""
    root = Path("/sys/fs/cgroup")
    hierarchy = root if (root / "cgroup.controllers").exists() else root / "pids"
    made: list[Path] = []
    directory = hierarchy
    for part in path.strip("/").split("/"):
        directory = directory / part
        if not directory.is_dir():
            directory.mkdir()
            made.append(directory)
    try:
        yield directory / "cgroup.procs"
    finally:
        # Its processes are the test's, killed by now: wait for the kernel to see them gone.
        deadline = time.monotonic() + 10
        for made_dir in reversed(made):
            while True:
                try:
                    made_dir.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
