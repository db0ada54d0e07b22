"""structlog: JSON lines on stdout for journald, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(*, json: bool | None = None, level: int = logging.INFO) -> None:
    if json is None:
        json = not sys.stdout.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )


log = structlog.get_logger("oom-supervisor")
