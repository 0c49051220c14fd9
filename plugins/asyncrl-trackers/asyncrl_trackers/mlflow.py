"""The ``mlflow`` metrics sink: ``pip install -e 'plugins/asyncrl-trackers[mlflow]'`` (mlflow-skinny: the client
only, no server, no pandas).

One MLflow run per asyncrl run (tag ``asyncrl.run_id``), in the experiment ``experiment``
(created when missing). ``train/*`` and ``eval/*`` scalars are metrics at their steps
(:mod:`asyncrl_trackers.mapping`), a ``/`` after the first one written ``.``
(``train/reward/correct`` is ``train/reward.correct``: the file store cannot hold both it and
``train/reward``) and characters MLflow refuses in a name written ``_``; the resolved
config is the run's parameters (flattened to ``section.key``, long values cut to MLflow's
limit) and the artifact ``config.json``; each ``completions`` record is the artifact
``completions/step_<N>.json`` in MLflow's table layout (``{"columns": [...], "data":
[[...], ...]}``). The client is used directly (``MlflowClient``), so the process-wide
"active run" of ``mlflow.start_run`` is left alone.

Options (``[metrics.options.mlflow]``): ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``,
else ``file:<run.output_dir>/mlruns``; ``mlflow ui --backend-store-uri <that>`` shows it),
``experiment`` (default ``run.name``), ``run_name`` (default ``run.name``). MLflow 3 keeps
the ``file:`` store only on request: for a ``file:`` URI the sink sets
``MLFLOW_ALLOW_FILE_STORE=true`` in this process unless it is already set. A ``sqlite:`` URI
needs the full ``mlflow`` package (SQLAlchemy); an ``http(s)://`` server works with skinny.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.plugin.common import PluginError
from asyncrl.plugin.sink import SinkPlugin, parse_options
from asyncrl_trackers.mapping import config_params, scalars, table

try:
    import mlflow  # noqa: F401 - the package itself first: its submodules may be cached
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
except ImportError as exc:  # fail when the plugin is loaded, before any process starts
    raise PluginError(
        "the mlflow metrics sink needs mlflow (or mlflow-skinny): pip install -e 'plugins/asyncrl-trackers[mlflow]'"
    ) from exc

__all__ = ["PLUGIN", "MlflowSink"]

_BAD_NAME = re.compile(r"[^\w\-. /]")  # MLflow's names: alphanumerics, _ - . space /
_PARAM_VALUE_MAX = 6000
_PARAM_KEY_MAX = 250
_BATCH = 100  # params per log_batch (MLflow's limit); metrics are limited to 1000


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    tracking_uri: str = ""
    experiment: str = ""
    run_name: str = ""


def _name(key: str) -> str:
    return _BAD_NAME.sub("_", key)


def _metric_name(name: str) -> str:
    """``train/reward/correct`` -> ``train/reward.correct``: the file store keeps a metric
    per file under directories named by its ``/`` parts, so ``train/reward`` (a file) and
    ``train/reward/correct`` (a file in a directory of the same name) cannot both exist."""
    section, _, key = name.partition("/")
    return _name(f"{section}/{key.replace('/', '.')}" if key else section)


class MlflowSink:
    def __init__(self, opts: _Options, *, run_dir: str, run_name: str, run_id: str) -> None:
        uri = opts.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = Path(os.path.abspath(os.path.join(run_dir, "mlruns"))).as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        name = opts.experiment or run_name or "asyncrl"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment is not None
            else self.client.create_experiment(name)
        )
        tags = {"asyncrl.run_id": run_id} if run_id else None
        run = self.client.create_run(
            experiment_id, run_name=opts.run_name or run_name or None, tags=tags
        )
        self.run_id: str = run.info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [
            Param(_name(k.replace("/", "."))[:_PARAM_KEY_MAX], v[:_PARAM_VALUE_MAX])
            for k, v in config_params(config).items()
        ]
        for start in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + _BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log(self, record: Mapping[str, Any]) -> None:
        if (found := scalars(record)) is not None:
            now = int(time.time() * 1000)
            metrics = [
                Metric(_metric_name(k), v, now, found.step) for k, v in found.values.items()
            ]
            for start in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        elif (tab := table(record)) is not None:
            self.client.log_dict(
                self.run_id, {"columns": tab.columns, "data": tab.rows},
                f"completions/step_{tab.step:06d}.json",
            )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def _make(options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str) -> MlflowSink:
    opts = parse_options("mlflow", options, _Options)
    return MlflowSink(opts, run_dir=run_dir, run_name=run_name, run_id=run_id)


def _check(options: dict[str, Any]) -> None:
    parse_options("mlflow", options, _Options)


PLUGIN = SinkPlugin(make=_make, check_options=_check)
