"""Logging setup (opt-in) and the metrics writer (``metrics.jsonl`` and the other sinks).

Library code only calls ``structlog.get_logger(...)``. :func:`configure` is called by the CLI
and by worker processes — never on import, and never over a host application's own structlog
configuration.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Literal

import structlog
import structlog.tracebacks

from asyncrl import registry
from asyncrl.obs.console import claim_terminal
from asyncrl.sinks import GROUP, Sink, SinkPlugin, load_sinks
from asyncrl.sinks.threaded import SinkThread, deliver

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
        logger_factory=structlog.PrintLoggerFactory(claim_terminal(fmt)),
        cache_logger_on_first_use=True,
    )


class MetricsWriter:
    """The run's metrics: each record goes to every sink of :mod:`asyncrl.sinks`.

    ``jsonl`` (``<run_dir>/metrics.jsonl``) is always one of them and is written before
    :meth:`write` returns, flushed per record; every other sink runs on its own thread behind a
    bounded queue of ``queue_size`` records (:class:`~asyncrl.sinks.threaded.SinkThread`), so
    :meth:`write` never waits for a tracker: a full queue drops the record (counted, warned
    once, the total logged at close), a sink that raises is logged once and disabled.

    With ``origin`` (a ``time.perf_counter()`` reading: the run's clock), each record is
    stamped ``t``: seconds since then when it was written (the run timeline of
    ``asyncrl plot``). Threaded sinks get a copy of the record as ``metrics.jsonl`` holds it
    (a JSON round trip), so the caller may reuse its dicts.

    Args:
        run_dir: the run's output directory (``run.output_dir``), handed to every sink.
        sinks: name -> :class:`~asyncrl.sinks.SinkPlugin` (or factory); ``jsonl`` is loaded
            through its entry point when missing. :meth:`open` loads them from a config.
        options: name -> that sink's options, checked here by its ``check_options``.
        close_timeout_s: how long :meth:`close` waits for the threaded sinks to deliver what
            is queued and close; what is left then is dropped (and counted).

    Raises:
        ConfigError: a sink refused its options (nothing is left open).
        PluginError: ``jsonl`` is not installed (entry points missing: reinstall asyncrl).
    """

    def __init__(
        self,
        run_dir: str,
        origin: float | None = None,
        *,
        sinks: Mapping[str, Any] | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        run_name: str = "",
        run_id: str = "",
        queue_size: int = 1000,
        close_timeout_s: float = 30.0,
    ) -> None:
        found = dict(sinks or {})
        if "jsonl" not in found:
            found = {"jsonl": registry.load(GROUP, "jsonl", "metrics.sinks"), **found}
        chosen = {name: SinkPlugin.of(obj, name) for name, obj in found.items()}
        options = options or {}
        for name, plugin in chosen.items():
            if plugin.check_options is not None:
                plugin.check_options(dict(options.get(name, {})))
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.origin = origin
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._sync: list[Sink] = []
        self._threads: list[SinkThread] = []
        kwargs = {"run_dir": run_dir, "run_name": run_name, "run_id": run_id}
        try:
            for name, plugin in chosen.items():
                opts = dict(options.get(name, {}))
                if plugin.synchronous:
                    self._sync.append(plugin(opts, **kwargs))
                else:
                    self._threads.append(SinkThread(name, plugin, opts, queue_size, **kwargs))
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, cfg: Any, *, run_id: str, origin: float | None = None) -> MetricsWriter:
        """The writer of a run with config ``cfg``: the sinks of ``metrics.sinks`` with the
        options of ``metrics.options``, in ``run.output_dir``, named ``run.name``.

        Raises:
            PluginError: a sink is not installed, or its package is missing.
            ConfigError: a sink refused its options.
        """
        return cls(
            cfg.run.output_dir,
            origin,
            sinks=load_sinks(cfg.metrics.sinks, cfg.metrics.options),
            options=cfg.metrics.options,
            run_name=cfg.run.name,
            run_id=run_id,
        )

    @property
    def dropped(self) -> dict[str, int]:
        """Records each threaded sink did not get: its queue was full, or they were still
        queued at the close deadline."""
        return {t.name: t.dropped + t.abandoned for t in self._threads}

    @property
    def failed(self) -> dict[str, BaseException]:
        """The threaded sinks that raised (and were disabled), with what they raised."""
        return {t.name: t.error for t in self._threads if t.error is not None}

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` (a JSON-able dict with a ``kind``) to ``metrics.jsonl`` and queue
        it for the other sinks. Never blocks on a tracker.

        Raises:
            ValueError: the writer is closed.
            OSError, TypeError: ``metrics.jsonl`` could not be written, or ``record`` is not
                JSON-able (from a synchronous sink).
        """
        if self.origin is not None:
            record = {**record, "t": round(time.perf_counter() - self.origin, 6)}
        with self._lock:
            if self._closed:
                raise ValueError("write to a closed MetricsWriter")
            for sink in self._sync:
                deliver(sink, record)
            if self._threads:
                snapshot = json.loads(json.dumps(record))
                for thread in self._threads:
                    thread.put(snapshot)

    def close(self) -> None:
        """Deliver what is queued (within ``close_timeout_s``), close every sink, end their
        threads (a sink stuck past the deadline is left behind as a daemon thread, logged).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            deadline = time.monotonic() + self.close_timeout_s
            for thread in self._threads:
                thread.stop(deadline)
            for thread in self._threads:
                thread.join(deadline)
        finally:
            for sink in self._sync:
                sink.close()
