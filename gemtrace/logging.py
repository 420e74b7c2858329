"""Structured logging for the agent: structlog configured once, here.

JSON lines (one object per event) when stderr is not a terminal, as under systemd; colourful
key-values on a terminal. Event names are stable snake_case (`config_reloaded`, `oom_kill`, ...):
docs/alerts.md and operators' log queries rely on them.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", json: bool | None = None) -> None:
    as_json = not sys.stderr.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
