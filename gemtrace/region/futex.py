"""Shared futex words between the agent and the gates (never FUTEX_PRIVATE: the other side is another
process mapping the same memory). x86-64 only, as the gate and the agent are (see packaging)."""

from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_futex = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
EVERYONE = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


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
