"""Structured event logging for the agent: structlog configured once, here.

JSON lines (one object per event) when stderr is not a terminal, as under systemd; colourful
key-values on a terminal. Event names are stable snake_case (`config_reloaded`, `oom_kill`, ...):
docs/alerts.md and operators' log queries rely on them.

When stderr is the journal itself (systemd's JOURNAL_STREAM names its device and inode), each line
starts with the sd-daemon priority prefix `<N>`, which journald strips and keeps as the entry's
PRIORITY (SyslogLevelPrefix=yes is its default), so `journalctl -u gemtrace -p warning` finds the
warnings. A terminal, a pipe or a file gets no prefix: there it would only be noise. See
sd-daemon(3) and systemd.exec(5), "JOURNAL_STREAM".

Named eventlog, not logging: a module named logging would shadow the standard library's for
anything run from inside this directory.
"""

from __future__ import annotations

import logging
import os
import sys
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


def configure(level: str = "info", json: bool | None = None, stream: TextIO | None = None) -> None:
    """Log events at `level` and above to `stream` (default stderr); `json` None: JSON unless a terminal."""
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
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
