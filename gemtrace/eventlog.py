"""Structured event logging for the agent: structlog configured once, here.

JSON lines (one object per event) when stderr is not a terminal, as under systemd; colourful
key-values on a terminal. Event names are stable snake_case (`config_reloaded`, `oom_kill`, ...):
docs/alerts.md and operators' log queries rely on them.

When stderr is the journal itself (systemd's JOURNAL_STREAM names its device and inode), each line
starts with the sd-daemon priority prefix `<N>`, which journald strips and keeps as the entry's
PRIORITY (SyslogLevelPrefix=yes is its default), so `journalctl -u gemtrace -p warning` finds the
warnings. A terminal, a pipe or a file gets no prefix: there it would only be noise. See
sd-daemon(3) and systemd.exec(5), "JOURNAL_STREAM".

Lines a user's input can trigger (a garbage request on the attach socket, a client gone before its
answer) go through `USER_LINES`, which lets each uid log a burst and then a line a second, and counts
the rest: a flood from one user would otherwise fill the disk and, past journald's rate limit, hide
everyone's lines, `oom_kill` included. Each uid's dropped lines are summed up in one
`log_lines_dropped` line per SUMMARY_SECONDS while it floods, and once after.

Named eventlog, not logging: a module named logging would shadow the standard library's for
anything run from inside this directory.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog

# structlog's method names (after its own aliasing: exception -> error, warn -> warning) -> syslog
# priorities, as sd-daemon(3) numbers them.
JOURNAL_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}


def is_journal_stream(journal_stream: str | None, st: os.stat_result) -> bool:
    """Whether the stream whose fstat is `st` is the one systemd connected to the journal (pure).

    JOURNAL_STREAM is `device:inode` in decimal; a child that inherited the variable but whose
    stderr was redirected has another device or inode, so the variable alone is not enough."""
    if not journal_stream:
        return False
    device, _, inode = journal_stream.partition(":")
    try:
        return (int(device), int(inode)) == (st.st_dev, st.st_ino)
    except ValueError:
        return False


def _stream_is_journal(stream: TextIO) -> bool:
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False  # no descriptor (a test's StringIO): not the journal
    return is_journal_stream(os.environ.get("JOURNAL_STREAM"), st)


def _journal_priority_prefix(_logger: Any, method_name: str, rendered: Any) -> str:
    """Runs after the renderer, so `rendered` is the line (structlog types it as the event dict):
    the line as journald reads a priority from it."""
    return f"<{JOURNAL_PRIORITY.get(method_name, JOURNAL_PRIORITY['info'])}>{rendered}"


# The level `configure` last set (none until it runs: a program that never configures logs no debug trace).
_configured_level: int | None = None


def debug_enabled() -> bool:
    """Did `configure` set the debug level? For callers that build a costly debug event only then (the
    filtering loggers of structlog before 23 have no `is_enabled_for`; Debian 12 ships 22.3)."""
    return _configured_level is not None and _configured_level <= logging.DEBUG


def configure(level: str = "info", json: bool | None = None, stream: TextIO | None = None) -> None:
    """Log events at `level` and above to `stream` (default stderr); `json` None: JSON unless a terminal."""
    global _configured_level
    _configured_level = logging.getLevelNamesMapping()[level.upper()]
    out = sys.stderr if stream is None else stream
    as_json = not out.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=True)
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    if _stream_is_journal(out):
        processors.append(_journal_priority_prefix)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_configured_level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )


# Per uid: this many lines at once, then one every LINE_SECONDS (a token bucket). A uid logs at most
# USER_BURST + t / LINE_SECONDS lines in t seconds, whatever it sends.
USER_BURST = 20
LINE_SECONDS = 1.0
SUMMARY_SECONDS = 10.0


@dataclass
class _Bucket:
    tokens: float
    at: float
    dropped: Counter[str] = field(default_factory=Counter)
    first_drop: float = 0.0


def _timer(seconds: float, action: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


class UserLines:
    """Rate-limits log lines by the uid whose input triggered them. `clock` and `schedule(seconds,
    action)` (runs `action` once, that many seconds later) are the world's: a test passes fakes."""

    def __init__(self, burst: int = USER_BURST, line_seconds: float = LINE_SECONDS,
                 summary_seconds: float = SUMMARY_SECONDS, clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], None] = _timer) -> None:
        self.burst, self.line_seconds, self.summary_seconds = burst, line_seconds, summary_seconds
        self._clock, self._schedule = clock, schedule
        self._buckets: dict[int | None, _Bucket] = {}
        self._lock = threading.Lock()
        self._summary_due = False
        self._log = structlog.get_logger("gemtrace.eventlog")

    def log(self, emit: Callable[..., Any], uid: int | None, event: str, /, **values: Any) -> bool:
        """`emit(event, uid=uid, **values)` (a logger's method: `log.info`) unless `uid` (None: a user
        the agent cannot tell) is over its rate; then count it. True when the line went out. `uid` is
        whose input triggered the line; a `uid` in `values` is what the line says (the process's, where
        another user's input names it)."""
        with self._lock:
            now = self._clock()
            bucket = self._buckets.get(uid)
            if bucket is None:
                bucket = self._buckets[uid] = _Bucket(float(self.burst), now)
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) / self.line_seconds)
            bucket.at = now
            if bucket.tokens < 1:
                if not bucket.dropped:
                    bucket.first_drop = now
                bucket.dropped[event] += 1
                if not self._summary_due:
                    self._summary_due = True
                    self._schedule(self.summary_seconds, self.summarize)
                return False
            bucket.tokens -= 1
        emit(event, **{"uid": uid, **values})
        return True

    def summarize(self) -> None:
        """One `log_lines_dropped` line per uid that had lines dropped since the last; forget the uids
        whose bucket is full again."""
        with self._lock:
            self._summary_due = False
            now = self._clock()
            report = []
            for uid, bucket in list(self._buckets.items()):
                if bucket.dropped:
                    report.append((uid, dict(bucket.dropped), round(now - bucket.first_drop, 1)))
                    bucket.dropped = Counter()
                elif bucket.tokens + (now - bucket.at) / self.line_seconds >= self.burst:
                    del self._buckets[uid]
        for uid, events, seconds in report:
            self._log.warning("log_lines_dropped", uid=uid, dropped=sum(events.values()), events=events,
                              seconds=seconds, consequence=f"this user's input triggered more than {self.burst} "
                              f"lines at once or one a {self.line_seconds:g} s; the rest were counted, not logged")


# The agent's one limiter: every line a user's input triggers shares that user's budget.
USER_LINES = UserLines()
