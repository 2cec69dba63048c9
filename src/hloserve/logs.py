"""structlog set-up for the `hloserve` binary: console lines on a terminal, JSON lines otherwise.

An application embedding the worker configures logging itself; hloserve only calls
`structlog.get_logger`.
"""

from __future__ import annotations

import logging
import sys

import structlog

from hloserve.config import LoggingConfig

__all__ = ["configure_logging"]


def configure_logging(config: LoggingConfig) -> None:
    json = config.format == "json" or (config.format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, config.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
