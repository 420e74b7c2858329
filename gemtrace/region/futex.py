"""Shared futex words between the agent and the gates (never FUTEX_PRIVATE: the other side is another
process mapping the same memory). x86-64 only, as the gate and the agent are (see packaging).

`waitv` sleeps on several words at once (Linux's futex_waitv, 5.16 and later), so that one thread can
wait on every GPU's doorbell; `waitv_unsupported` says why it cannot be used where it cannot (an older
kernel, or a seccomp filter that refuses system calls it does not know)."""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Sequence

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_futex = 202
_SYS_futex_waitv = 449  # (the same number on aarch64)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_FUTEX2_SIZE_U32 = 0x02  # and not FUTEX2_PRIVATE (0x80): the words are shared with the gates
_CLOCK_MONOTONIC = 1  # time.monotonic_ns's clock
EVERYONE = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Waiter(ctypes.Structure):
    """struct futex_waitv (include/uapi/linux/futex.h)."""

    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]


def wake(address: int, count: int = EVERYONE) -> int:
    """Wake up to `count` waiters on the word at `address`; returns how many woke."""
    return int(_libc.syscall(_SYS_futex, ctypes.c_void_p(address), _FUTEX_WAKE, count, None, None, 0))


def wait(address: int, expected: int, timeout_ns: int) -> None:
    """Sleep while the word at `address` says `expected`, at most `timeout_ns`; may return early. The
    GIL is released meanwhile (a ctypes call)."""
    if timeout_ns <= 0:
        return
    timeout = _Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000)
    _libc.syscall(_SYS_futex, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected),
                  ctypes.byref(timeout), None, 0)


def waitv(words: Sequence[tuple[int, int]], timeout_ns: int) -> int | None:
    """Sleep while every word (address, expected) says what is expected, at most `timeout_ns`; returns
    the index of a word woken, None at the timeout, at once where a word already differs, or on a
    signal. The GIL is released meanwhile. OSError where the kernel refuses the call (ENOSYS, EPERM)."""
    waiters = (_Waiter * len(words))(*(_Waiter(expected, address, _FUTEX2_SIZE_U32, 0) for address, expected in words))
    # An absolute time on CLOCK_MONOTONIC, as futex_waitv takes it.
    at = time.monotonic_ns() + max(0, timeout_ns)
    timeout = _Timespec(at // 1_000_000_000, at % 1_000_000_000)
    woken = _libc.syscall(_SYS_futex_waitv, waiters, len(words), 0, ctypes.byref(timeout), _CLOCK_MONOTONIC)
    if woken >= 0:
        return int(woken)
    code = ctypes.get_errno()
    if code in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        return None
    raise OSError(code, f"futex_waitv: {os.strerror(code)}")


def waitv_unsupported() -> str | None:
    """Why `waitv` cannot be used here (None: it can): one call on a word that differs, which returns at
    once where the kernel has futex_waitv and lets this process call it."""
    word = ctypes.c_uint32(0)
    try:
        waitv([(ctypes.addressof(word), 1)], 0)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "this kernel has no futex_waitv (Linux 5.16 or later has it)"
        if e.errno == errno.EPERM:
            return "futex_waitv is refused (a seccomp filter that does not know it)"
        return str(e)
    return None
