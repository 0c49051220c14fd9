"""The ``tensorboard`` metrics sink, through tensorboardX (no torch, no TensorFlow):
``pip install -e 'plugins/asyncrl-trackers[tensorboard]'``, then ``tensorboard --logdir <run.output_dir>/tensorboard``.

Writes ``train/*`` and ``eval/*`` scalars at their steps (:mod:`asyncrl_trackers.mapping`), the
resolved config as the text ``config`` (JSON, step 0) and each ``completions`` record as the
text ``completions`` (a markdown table) at its step.

Options (``[metrics.options.tensorboard]``): ``dir``: where the event files go (default
``<run.output_dir>/tensorboard``; a relative path is taken relative to ``run.output_dir``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from asyncrl.plugin.common import PluginError
from asyncrl.plugin.sink import SinkPlugin, parse_options
from asyncrl_trackers.mapping import config_text, markdown_table, scalars, table

try:
    from tensorboardX import SummaryWriter
except ImportError as exc:  # fail when the plugin is loaded, before any process starts
    raise PluginError(
        "the tensorboard metrics sink needs tensorboardX: pip install -e 'plugins/asyncrl-trackers[tensorboard]'"
    ) from exc

__all__ = ["PLUGIN", "TensorBoardSink"]

_FLUSH_S = 10  # how stale the event file may be for a live `tensorboard` reading it


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    dir: str = "tensorboard"
    """Where the event files go (relative: under ``run.output_dir``)."""


class TensorBoardSink:
    def __init__(self, logdir: str) -> None:
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self._writer = SummaryWriter(logdir=logdir, flush_secs=_FLUSH_S)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text("config", config_text(config), global_step=0)

    def log(self, record: Mapping[str, Any]) -> None:
        if (found := scalars(record)) is not None:
            for name, value in found.values.items():
                self._writer.add_scalar(name, value, global_step=found.step)
        elif (tab := table(record)) is not None:
            self._writer.add_text("completions", markdown_table(tab), global_step=tab.step)

    def close(self) -> None:
        self._writer.close()


def _make(
    options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str
) -> TensorBoardSink:
    opts = parse_options("tensorboard", options, _Options)
    return TensorBoardSink(os.path.join(run_dir, os.path.expanduser(opts.dir)))


def _check(options: dict[str, Any]) -> None:
    parse_options("tensorboard", options, _Options)


PLUGIN = SinkPlugin(make=_make, check_options=_check)
