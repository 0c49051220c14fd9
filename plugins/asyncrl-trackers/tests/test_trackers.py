"""The trackers as metrics sinks: the record mapping by hand, their option checks and install
hints, and each tracker read back from what it wrote (TensorBoard's event files with a reader
written here from the format, a W&B offline run's transaction log, an MLflow file store).
(The core's fan-out and jsonl: tests/unit/test_sinks.py.)"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl import registry
from asyncrl.errors import ConfigError, PluginError
from asyncrl.obs.log import MetricsWriter
from asyncrl.sinks import GROUP, load_sinks
from asyncrl_trackers.mapping import (
    Scalars,
    Table,
    config_params,
    config_text,
    markdown_table,
    scalars,
    table,
)

CONFIG = {"run": {"name": "demo", "seed": 3}, "grpo": {"lr": 1e-6, "clip": [0.2, 0.28]},
          "metrics": {"sinks": ["jsonl"], "options": {}}}
TRAIN = {
    "kind": "train", "step": 7, "reward": 0.5, "accuracy": 0.25, "staleness_max": 2,
    "loss": -0.125, "reward/correct": 1.0, "failed": True, "ok": False,
    "staleness_hist": {"0": 3}, "gen_by_worker": [1, 2], "note": "x", "maybe": None,
    "gen_start": 11.0, "train_end": 12.0, "time": 13.0, "t": 14.0,
}


def _sink_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncrl-sink-")]


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ the mapping, by hand
def test_train_record_scalars() -> None:
    assert scalars(TRAIN) == Scalars(7, {
        "train/reward": 0.5, "train/accuracy": 0.25, "train/staleness_max": 2.0,
        "train/loss": -0.125, "train/reward/correct": 1.0, "train/failed": 1.0,
        "train/ok": 0.0,
    })


def test_eval_record_scalars_at_version_without_label() -> None:
    record = {"kind": "eval", "label": "step-10", "version": 10, "accuracy": 0.75,
              "num_prompts": 8, "seconds": 1.5, "start": 3.0, "end": 4.5}
    assert scalars(record) == Scalars(
        10, {"eval/accuracy": 0.75, "eval/num_prompts": 8.0, "eval/seconds": 1.5}
    )


def test_other_records_are_not_scalars() -> None:
    assert scalars({"kind": "checkpoint", "step": 3, "seconds": 1.0}) is None
    assert scalars({"kind": "train", "reward": 1.0}) is None  # no step
    assert scalars({"kind": "train", "step": True, "reward": 1.0}) is None
    assert table({"kind": "train", "step": 1}) is None
    assert table({"kind": "completions", "step": 1, "rows": []}) is None


def test_completions_table() -> None:
    record = {"kind": "completions", "step": 4, "rows": [
        {"prompt": "1+1?", "completion": "2", "reward": 1.0, "correct": True},
        {"prompt": "2+2?", "completion": "5", "reward": 0.0, "correct": False, "extra": [1]},
    ]}
    assert table(record) == Table(
        4, ["prompt", "completion", "reward", "correct", "extra"],
        [["1+1?", "2", 1.0, True, None], ["2+2?", "5", 0.0, False, "[1]"]],
    )


def test_markdown_table_escapes_cells() -> None:
    tab = Table(1, ["prompt", "completion"], [["a|b", "<think>x</think>\nok & done"]])
    assert markdown_table(tab) == (
        "| prompt | completion |\n"
        "|---|---|\n"
        "| a\\|b | &lt;think&gt;x&lt;/think&gt;<br>ok &amp; done |"
    )


def test_config_params_flatten() -> None:
    assert config_params(CONFIG) == {
        "run.name": "demo", "run.seed": "3", "grpo.lr": "1e-06", "grpo.clip": "[0.2, 0.28]",
        "metrics.sinks": '["jsonl"]', "metrics.options": "{}",
    }


# ------------------------------------------------------------------ options and plugins
def test_option_errors_name_the_field() -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboardX")
    with pytest.raises(ConfigError, match=r"metrics\.options\.wandb\.projekt: unknown key.*"
                       r"did you mean 'project'"):
        load_sinks(["wandb"], {"wandb": {"projekt": "x"}})
    with pytest.raises(ConfigError, match=r"metrics\.options\.wandb\.mode: .*'offline'"):
        load_sinks(["wandb"], {"wandb": {"mode": "sideways"}})
    with pytest.raises(ConfigError, match=r"metrics\.options\.tensorboard\.dir: expected str"):
        load_sinks(["tensorboard"], {"tensorboard": {"dir": 3}})
    # the writer checks them too (nothing is opened)
    with pytest.raises(ConfigError, match=r"metrics\.options\.wandb\.tags"):
        MetricsWriter("/nonexistent/never", sinks=load_sinks(["wandb"], {}),
                      options={"wandb": {"tags": "not-a-list"}})
    assert _sink_threads() == []


def test_unknown_sink_is_a_plugin_error() -> None:
    with pytest.raises(PluginError, match=r"metrics\.sinks: no metrics sink named 'wandbb' is "
                       r"installed \(installed: jsonl, mlflow, tensorboard, wandb\)"):
        load_sinks(["wandbb"], {})


def test_missing_tracker_package_fails_on_load_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for package, name in (("tensorboardX", "tensorboard"), ("wandb", "wandb"),
                          ("mlflow", "mlflow")):
        monkeypatch.setitem(sys.modules, package, None)  # import fails: not installed
        monkeypatch.delitem(sys.modules, f"asyncrl_trackers.{name}", raising=False)
        with pytest.raises(PluginError, match=rf"metrics\.sinks: .*{name}.*failed to import.*"
                           rf"pip install -e 'plugins/asyncrl-trackers\[{name}\]'"):
            load_sinks([name], {})


def test_plugins_lists_the_trackers() -> None:
    assert {"jsonl", "tensorboard", "wandb", "mlflow"} <= set(registry.available(GROUP))


# ------------------------------------------------------------------ TensorBoard files
# An independent reader of TensorBoard's event files (TFRecord framing with masked CRC-32C),
# written from the format.
def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecords(path: str) -> list[bytes]:
    """The records of a TFRecord file: u64 length, u32 masked crc32c of the length, the data,
    u32 masked crc32c of the data (little-endian), each crc checked."""
    out = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        header = blob[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
        assert length_crc == _masked(_crc32c(header))
        data = blob[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length : pos + 16 + length])
        assert data_crc == _masked(_crc32c(data))
        out.append(data)
        pos += 16 + length
    return out


# ------------------------------------------------------------------ TensorBoard
def _run_cfg(tmp_path: Any, sinks: list[str], options: dict[str, Any]) -> Any:
    return SimpleNamespace(
        run=SimpleNamespace(output_dir=str(tmp_path), name="demo"),
        metrics=SimpleNamespace(sinks=sinks, options=options),
    )


COMPLETIONS = {"kind": "completions", "step": 2, "rows": [
    {"prompt": "1+1?", "completion": "2", "reward": 1.0, "correct": True}]}


def _write_run(writer: MetricsWriter) -> None:
    writer.write({"kind": "config", "run_id": "abc123", "config": CONFIG})
    writer.write({**TRAIN, "step": 1, "reward": 0.25})
    writer.write({**TRAIN, "step": 2, "reward": 0.75})
    writer.write({"kind": "eval", "label": "end", "version": 2, "accuracy": 0.5, "start": 1.0})
    writer.write(COMPLETIONS)
    writer.write({"kind": "checkpoint", "step": 2, "path": "x"})
    writer.close()


def test_tensorboard_event_files_hold_scalars_config_and_completions(tmp_path: Any) -> None:
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event

    cfg = _run_cfg(tmp_path, ["tensorboard"], {"tensorboard": {"dir": "tb"}})
    writer = MetricsWriter.open(cfg, run_id="abc123", origin=time.perf_counter())
    _write_run(writer)
    assert _sink_threads() == []
    assert len(_lines(os.path.join(str(tmp_path), "metrics.jsonl"))) == 6  # jsonl always on
    scalar: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    (path,) = glob.glob(os.path.join(str(tmp_path), "tb", "events.out.tfevents.*"))
    for data in tfrecords(path):
        event = Event.FromString(data)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalar.setdefault(value.tag, []).append((event.step, value.simple_value))
            else:
                text = value.tensor.string_val[0].decode()
                texts.setdefault(value.tag, []).append((event.step, text))
    assert scalar["train/reward"] == [(1, 0.25), (2, 0.75)]
    assert scalar["train/loss"] == [(1, -0.125), (2, -0.125)]
    assert scalar["train/failed"] == [(1, 1.0), (2, 1.0)]
    assert scalar["eval/accuracy"] == [(2, 0.5)]
    assert not {"train/gen_start", "train/time", "train/t", "eval/start", "train/step"} & set(
        scalar
    )
    ((step, text),) = texts["config/text_summary"]
    assert step == 0 and json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == CONFIG
    ((step, text),) = texts["completions/text_summary"]
    assert step == 2 and "| 1+1? | 2 | 1.0 | True |" in text.splitlines()


# ------------------------------------------------------------------ W&B (offline)
def _leveldb_records(path: str) -> list[bytes]:
    """The records of a W&B transaction log: a 7-byte header, then LevelDB log blocks of
    32 KiB made of chunks (u32 crc, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last)."""
    with open(path, "rb") as f:
        blob = f.read()
    assert blob[:4] == b":W&B"
    block, pos, out, partial = 32768, 7, [], b""
    while pos + 7 <= len(blob):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", blob[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = blob[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            out.append(partial + chunk)
    return out


def test_wandb_offline_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "data"),
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(var, value)
    options = {"wandb": {"mode": "offline", "dir": str(tmp_path / "wb"), "project": "p",
                         "tags": ["a", "b"]}}
    try:
        writer = MetricsWriter.open(_run_cfg(tmp_path, ["wandb"], options), run_id="abc123")
        _write_run(writer)
        assert writer.failed == {}
    finally:
        wandb.teardown()  # W&B's own service threads (process-wide), not the sink's
    assert _sink_threads() == []
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*-abc123"))
    run: Any = None
    history: list[dict[str, Any]] = []
    for data in _leveldb_records(os.path.join(run_dir, "run-abc123.wandb")):
        record = pb.Record.FromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            })
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (
        "abc123", "p", "demo", ["a", "b"]
    )
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config == CONFIG
    train = [(h["train/step"], h["train/reward"]) for h in history if "train/reward" in h]
    assert train == [(1, 0.25), (2, 0.75)]
    assert [(h["eval/version"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h] \
        == [(2, 0.5)]
    (row,) = [h for h in history if "completions/table/path" in h]
    assert row["completions/step"] == 2
    with open(os.path.join(run_dir, "files", row["completions/table/path"])) as f:
        saved = json.load(f)
    assert saved["columns"] == ["prompt", "completion", "reward", "correct"]
    assert saved["data"] == [["1+1?", "2", 1.0, True]]


# ------------------------------------------------------------------ MLflow (file store)
def test_mlflow_file_store(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the sink opts in itself
    options = {"mlflow": {"experiment": "exp", "run_name": "first"}}
    writer = MetricsWriter.open(_run_cfg(tmp_path, ["mlflow"], options), run_id="abc123")
    _write_run(writer)
    assert writer.failed == {} and _sink_threads() == []
    store = tmp_path / "mlruns"  # the default tracking URI: file:<run.output_dir>/mlruns
    assert store.is_dir()
    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name("exp")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.data.tags["asyncrl.run_id"] == "abc123"
    rid = run.info.run_id
    history = client.get_metric_history(rid, "train/reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(rid, "eval/accuracy")] == [
        (2, 0.5)
    ]
    assert "train/gen_start" not in run.data.metrics
    # beside train/reward in the file store (a file there cannot also be a directory)
    assert run.data.metrics["train/reward.correct"] == 1.0
    assert run.data.params["grpo.lr"] == "1e-06" and run.data.params["run.name"] == "demo"
    artifacts = os.path.join(str(store), experiment.experiment_id, rid, "artifacts")
    with open(os.path.join(artifacts, "config.json")) as f:
        assert json.load(f) == CONFIG
    with open(os.path.join(artifacts, "completions", "step_000002.json")) as f:
        assert json.load(f) == {"columns": ["prompt", "completion", "reward", "correct"],
                                "data": [["1+1?", "2", 1.0, True]]}


def test_config_text_round_trips() -> None:
    text = config_text(CONFIG)
    assert text.startswith("```json\n") and json.loads(text[8:-4]) == CONFIG
