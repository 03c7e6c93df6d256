"""structlog JSON logging for every service: one JSON object per line on stderr, context bound per message."""

from __future__ import annotations

import logging
import sys
from typing import Any, Final

import structlog

from shared.errors import InvalidInput

LEVELS: Final = ("debug", "info", "warning", "warn", "error", "critical")


def check_level(level: str, where: str = "--log-level") -> None:
    """One of :data:`LEVELS` (any case); :class:`InvalidInput` otherwise, before anything starts."""
    if level.lower() not in LEVELS:
        raise InvalidInput(f"{level!r} is not a log level (expected one of {', '.join(LEVELS)})", where)


def configure(level: str = "info", *, stream: Any = None) -> None:
    """Configure structlog for production-style JSON lines. Safe to call more than once."""
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    out = stream if stream is not None else sys.stderr
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    # Libraries that log through stdlib logging (nats-py, aiohttp) go to the same stream as plain lines.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=out, format="%(message)s", force=True)
    quiet_library_noise()


class _NoEofNoise(logging.Filter):
    """Drops asyncio's warning that a TLS transport ignores ``eof_received()`` returning true (nats-py's protocol
    does, and every close of a ``tls://`` connection logged it: a second line after a command's one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


def quiet_library_noise() -> None:
    """Install :class:`_NoEofNoise` on asyncio's logger (once)."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _NoEofNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_NoEofNoise())


def get_logger(**context: Any) -> Any:
    return structlog.get_logger().bind(**context)
