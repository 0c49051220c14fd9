"""Metrics sinks: where the run's records go (``metrics.sinks``), as plugins.

Every record the controller writes (:class:`~asyncrl.obs.log.MetricsWriter`) goes to each sink
the config lists; ``jsonl`` (``<run.output_dir>/metrics.jsonl``, read by ``asyncrl plot`` and
``--resume``) is always one of them. The first-party ones:

=============== ======================================= ======================================
name            needs                                   options (``[metrics.options.<name>]``)
=============== ======================================= ======================================
``jsonl``       nothing (built in)                      none
``tensorboard`` ``plugins/asyncrl-trackers[tensorboard]`` ``dir`` (default
                (tensorboardX: no torch, no TensorFlow)  ``<run.output_dir>/tensorboard``)
``wandb``       ``plugins/asyncrl-trackers[wandb]``     ``project``, ``entity``, ``name``,
                                                        ``mode``, ``dir``, ``tags``
``mlflow``      ``plugins/asyncrl-trackers[mlflow]``    ``tracking_uri``, ``experiment``,
                (mlflow-skinny)                         ``run_name``
=============== ======================================= ======================================

The trackers are a distribution of their own (``pip install -e 'plugins/asyncrl-trackers[all]'``
installs all three; docs/observability.md says what each writes). Relative ``dir`` options are
taken relative to ``run.output_dir``.

Writing a sink
--------------
An ``asyncrl.metrics_sinks`` entry point names a :class:`SinkPlugin` (or a bare factory)::

    make(options: dict, *, run_dir: str, run_name: str, run_id: str) -> Sink

``options`` is the sink's ``[metrics.options.<name>]`` table, ``run_dir`` is
``run.output_dir``, ``run_name`` is ``run.name`` and ``run_id`` the controller's id of this
run. A :class:`Sink` has three methods:

* ``log_config(config)``: the run's resolved config (plain builtins), once, when the
  controller writes its ``config`` record (its first);
* ``log(record)``: every record, all kinds (``config`` too, after ``log_config``): see
  :mod:`asyncrl_trackers.mapping` for what trackers make of them; a sink must not mutate it;
* ``close()``: flush and release everything; called once, last.

Unless the plugin says ``synchronous=True`` (``jsonl`` does: it must never lose a record),
the factory and every method run on the sink's own thread, fed by a bounded queue: a slow
tracker never blocks the controller (a full queue drops records and counts them), and a sink
that raises is logged once and disabled, never stopping the run. Import the tracker's package
at the top of the sink's module, so a missing dependency fails when the plugin is loaded:
before any process starts.

``check_options(options)`` (optional) raises :class:`~asyncrl.errors.ConfigError` naming
``metrics.options.<name>.<key>`` for options the sink would refuse; the controller calls it
before any process starts. :func:`parse_options` does that for an options struct.

A bare factory may carry the same two as attributes of its own (``make.check_options``,
``make.synchronous``). Either way they are read and checked once, when the sink loads
(:meth:`SinkPlugin.of`): a ``check_options`` that is not a plain function, or a ``synchronous``
that is not a bool, is a :class:`~asyncrl.errors.PluginError` naming the sink and the member.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from asyncrl import registry
from asyncrl.errors import ConfigError, PluginError, config_error
from asyncrl.explain import explain

__all__ = [
    "GROUP",
    "Sink",
    "SinkPlugin",
    "check_sinks",
    "load_sinks",
    "parse_options",
    "sink_names",
]

GROUP = "asyncrl.metrics_sinks"

_S = TypeVar("_S", bound=msgspec.Struct)


class Sink(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkPlugin:
    """What a ``asyncrl.metrics_sinks`` entry point names."""

    make: Callable[..., Sink]
    """``make(options, *, run_dir, run_name, run_id) -> Sink`` (on the sink's thread unless
    :attr:`synchronous`)."""
    check_options: Callable[[dict[str, Any]], None] | None = None
    """``check_options(options)``: raise :class:`~asyncrl.errors.ConfigError` naming
    ``metrics.options.<name>.<key>``. Cheap; must not open anything."""
    synchronous: bool = False
    """Run on the writer's thread, every record delivered before ``write`` returns, errors
    raised to the writer (for a fast local file that must not lose records). Leave off for
    anything that does I/O over a network."""

    def __call__(
        self, options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str
    ) -> Sink:
        return self.make(options, run_dir=run_dir, run_name=run_name, run_id=run_id)

    @classmethod
    def of(cls, obj: Any, name: str = "?") -> SinkPlugin:
        """``obj`` as a plugin, checked: a :class:`SinkPlugin` as is; a bare factory wrapped
        (its ``check_options`` and ``synchronous`` attributes, when set, are used). The one
        place a sink's optional members are read.

        Raises:
            PluginError: ``obj`` is neither; ``make`` is not callable, ``check_options`` not a
                plain function, or ``synchronous`` not a bool (naming the sink and the member).
        """
        if isinstance(obj, SinkPlugin):
            plugin = obj
        elif callable(obj):
            synchronous = getattr(obj, "synchronous", None)
            plugin = cls(
                make=obj,
                check_options=getattr(obj, "check_options", None),
                synchronous=False if synchronous is None else synchronous,
            )
        else:
            raise PluginError(
                f"metrics sink {name!r}: the entry point must name a SinkPlugin or a factory, "
                f"got {obj!r}"
            )
        _check(plugin, name)
        return plugin


def _check(plugin: SinkPlugin, name: str) -> None:
    """Raises PluginError: a member of ``plugin`` is of the wrong kind."""
    problems = []
    if not callable(plugin.make):
        problems.append(f"'make' is not callable (it is a {type(plugin.make).__name__})")
    check = plugin.check_options
    if check is not None and not callable(check):
        problems.append(f"'check_options' is not callable (it is a {type(check).__name__})")
    elif check is not None and inspect.iscoroutinefunction(check):
        problems.append("'check_options' must be a plain function, not `async def` (the "
                        "controller calls it before any process starts)")  # fmt: skip
    if not isinstance(plugin.synchronous, bool):
        problems.append(f"'synchronous' must be a bool (True or False), got "
                        f"{plugin.synchronous!r}")  # fmt: skip
    if problems:
        raise PluginError(
            f"metrics sink {name!r} ({GROUP}): {'; '.join(problems)}. Fix: make "
            f"{'them' if len(problems) > 1 else 'it'} what asyncrl.plugin.sink.SinkPlugin says"
        )


def parse_options(name: str, options: Mapping[str, Any], struct: type[_S]) -> _S:
    """``options`` converted to ``struct`` (declare it ``forbid_unknown_fields=True``).

    Raises:
        ConfigError: naming ``metrics.options.<name>.<key>`` (an unknown key, with the
            known ones; a value of the wrong type or outside a ``Literal``).
    """
    try:
        return msgspec.convert(dict(options), struct)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, struct, f"metrics.options.{name}")) from None


def sink_names(sinks: Iterable[str]) -> list[str]:
    """The sinks to open, in order: ``jsonl`` first (always), then each other name once."""
    names = ["jsonl"]
    for name in sinks:
        if name not in names:
            names.append(name)
    return names


def load_sinks(
    sinks: Iterable[str], options: Mapping[str, Mapping[str, Any]]
) -> dict[str, SinkPlugin]:
    """Load every sink of :func:`sink_names` and run its ``check_options`` on its table of
    ``options``.

    Raises:
        PluginError: a sink is not installed (naming ``metrics.sinks``, with an install hint)
            or its module fails to import (a tracker's package is missing).
        ConfigError: ``options`` has a table for a sink that is not listed, or a sink refuses
            its options.
    """
    names = sink_names(sinks)
    for name in options:
        if name not in names:
            raise config_error(
                f"metrics.options.{name}",
                f"options for a sink that metrics.sinks does not list ({', '.join(names)})",
                f'add "{name}" to metrics.sinks, or remove [metrics.options.{name}]',
            )
    loaded: dict[str, SinkPlugin] = {}
    for name in names:
        plugin = SinkPlugin.of(registry.load(GROUP, name, "metrics.sinks"), name)
        if plugin.check_options is not None:
            plugin.check_options(dict(options.get(name, {})))
        loaded[name] = plugin
    return loaded


def check_sinks(cfg: Any) -> None:
    """:func:`load_sinks` for ``cfg.metrics`` (before any process starts; imports the
    trackers' packages, so call it off the event loop)."""
    load_sinks(cfg.metrics.sinks, cfg.metrics.options)
