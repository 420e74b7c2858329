"""A daemon's signals, taken by its main loop in the loop's own time.

A Python signal handler runs in the main thread between two bytecodes of whatever that thread is
doing, which may be holding a lock the handler needs. `Event.set()` from a SIGTERM handler deadlocked
the agent's stop when the signal landed inside the main loop's own `Event.wait()` (which holds the
event's lock around its sleep): 3 stops in 40 on a loaded 2-core host, stack in hand. So the handlers
here take no lock and call nothing: they append to a deque, and `signal.set_wakeup_fd` ends the main
loop's wait at once.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import time
from collections.abc import Iterable


class SignalInbox:
    """Installs recording handlers for `signals`; call from the main thread (Python's rule)."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending: collections.deque[tuple[signal.Signals, float]] = collections.deque()
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in signals:
            signal.signal(signum, self._record)

    def _record(self, signum: int, _frame: object) -> None:
        # deque.append is atomic and lock-free; time.monotonic takes no lock.
        self._pending.append((signal.Signals(signum), time.monotonic()))

    def fileno(self) -> int:
        """Readable once a signal arrived: for a loop that waits on other descriptors too (then `take`)."""
        return self._read

    def wait(self, timeout: float) -> list[tuple[signal.Signals, float]]:
        """The signals received (with when, time.monotonic()) once one arrives or `timeout` passes."""
        if not self._pending:
            select.select([self._read], [], [], timeout)
        return self.take()

    def take(self) -> list[tuple[signal.Signals, float]]:
        """The signals received since the last call, without waiting (emptying the wake-up pipe)."""
        try:
            while os.read(self._read, 512):
                pass
        except BlockingIOError:
            pass
        received = []
        while self._pending:
            received.append(self._pending.popleft())
        return received
