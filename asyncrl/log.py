"""Logging setup (opt-in) and the metrics file.

Library code only calls ``structlog.get_logger(...)``. :func:`configure` is called by the CLI
and by worker processes — never on import, and never over a host application's own structlog
configuration.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Literal

import structlog
import structlog.tracebacks

__all__ = ["MetricsWriter", "configure"]


def configure(fmt: Literal["auto", "console", "json"] = "auto", level: str = "") -> None:
    """Configure structlog for a process asyncrl owns. Leaves an existing setup alone.

    ``level``: ``debug``, ``info``, ``warning``... (default: the ``ASYNCRL_LOG_LEVEL``
    environment variable, else ``info``). At ``debug`` the controller also logs each step's
    phases (``step_started``, ``refit_started``, ``checkpoint_started``) and every call."""
    if structlog.is_configured():
        return
    level = level or os.environ.get("ASYNCRL_LOG_LEVEL", "info")
    levels = logging.getLevelNamesMapping()
    if level.upper() not in levels:
        raise ValueError(
            f"log level {level!r} (ASYNCRL_LOG_LEVEL?) is not one of debug, info, warning, error"
        )
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        # tracebacks as data, without local variables (they can be huge: configs, tensors)
        processors.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(levels[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (flushed per record). With ``origin`` (a
    ``time.perf_counter()`` reading: the run's clock), each record is stamped ``t``: seconds
    since then when it was written (the run timeline of ``asyncrl plot``)."""

    def __init__(self, path: str, origin: float | None = None) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.origin = origin
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self.origin is not None:
            record = {**record, "t": round(time.perf_counter() - self.origin, 6)}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
