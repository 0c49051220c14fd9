"""The ``wandb`` metrics sink (Weights & Biases): ``pip install -e 'plugins/asyncrl-trackers[wandb]'``.

One W&B run per asyncrl run (id: the controller's run id; created with
``reinit="create_new"``, so a host's own ``wandb.run`` is left alone, and with
``console="off"``: W&B does not capture the terminal). The resolved config is the run's
config. ``train/*`` scalars are plotted against ``train/step``, ``eval/*`` against
``eval/version`` and the ``completions/table`` tables (a W&B Table) against
``completions/step``: W&B's own step only counts ``log`` calls, so an evaluation logged after a
later training step still lands at its version.

Online mode needs credentials first (``wandb login`` or ``WANDB_API_KEY``); a sink that cannot
start is logged and disabled, and the run goes on.

Options (``[metrics.options.wandb]``): ``project``, ``entity`` (default: W&B's own, e.g.
``WANDB_PROJECT``), ``name`` (default ``run.name``), ``mode`` (``online``, ``offline``,
``disabled``, or ``auto``, the default: W&B's own choice, e.g. ``WANDB_MODE``), ``dir``
(where W&B writes its files; default ``run.output_dir``; relative paths are taken relative
to it), ``tags`` (a list of strings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import PluginError
from asyncrl.plugin.sink import SinkPlugin, parse_options
from asyncrl_trackers.mapping import scalars, table

try:
    import wandb
except ImportError as exc:  # fail when the plugin is loaded, before any process starts
    raise PluginError(
        "the wandb metrics sink needs the wandb package: pip install -e 'plugins/asyncrl-trackers[wandb]'"
    ) from exc

__all__ = ["PLUGIN", "WandbSink"]

_STEP_METRICS = {"train": "train/step", "eval": "eval/version", "completions": "completions/step"}


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """``auto``: W&B's own choice (``WANDB_MODE``, else online)."""
    dir: str | None = None
    tags: tuple[str, ...] = ()


class WandbSink:
    """Starts its W&B run at the first call (``log_config`` normally), so that the config is
    given to ``wandb.init``."""

    def __init__(self, opts: _Options, *, run_dir: str, run_name: str, run_id: str) -> None:
        self._opts = opts
        self._dir = os.path.join(run_dir, os.path.expanduser(opts.dir or ""))
        self._name = opts.name or run_name or None
        self._id = run_id or None
        self._run: Any = None

    def _start(self, config: Mapping[str, Any]) -> Any:
        if self._run is None:
            os.makedirs(self._dir, exist_ok=True)
            o = self._opts
            run = wandb.init(
                project=o.project, entity=o.entity, name=self._name, id=self._id,
                mode=None if o.mode == "auto" else o.mode,
                dir=self._dir, tags=list(o.tags) or None, config=dict(config),
                reinit="create_new", settings=wandb.Settings(console="off"),
            )
            for prefix, step in _STEP_METRICS.items():
                run.define_metric(step)
                run.define_metric(f"{prefix}/*", step_metric=step)
            self._run = run
        return self._run

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self._run is None:
            self._start(config)
        else:  # started by a record that came first
            self._run.config.update(dict(config), allow_val_change=True)

    def log(self, record: Mapping[str, Any]) -> None:
        if (found := scalars(record)) is not None:
            step = _STEP_METRICS[str(record["kind"])]
            self._start({}).log({**found.values, step: found.step})
        elif (tab := table(record)) is not None:
            data = wandb.Table(columns=tab.columns, data=tab.rows)
            self._start({}).log({"completions/table": data, "completions/step": tab.step})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def _make(options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str) -> WandbSink:
    opts = parse_options("wandb", options, _Options)
    return WandbSink(opts, run_dir=run_dir, run_name=run_name, run_id=run_id)


def _check(options: dict[str, Any]) -> None:
    parse_options("wandb", options, _Options)


PLUGIN = SinkPlugin(make=_make, check_options=_check)
