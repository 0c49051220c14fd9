"""Metrics sinks in the core: sink names, the fan-out (bounded queues, failing sinks, threads
joined), option checks and the registry. (The trackers, TensorBoard, W&B and MLflow, and their
record mapping are asyncrl-trackers': plugins/asyncrl-trackers/tests/test_trackers.py.)"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from asyncrl import registry
from asyncrl.errors import ConfigError, PluginError
from asyncrl.obs.log import MetricsWriter
from asyncrl.sinks import GROUP, SinkPlugin, check_sinks, load_sinks, sink_names

CONFIG = {"run": {"name": "demo", "seed": 3}, "grpo": {"lr": 1e-6, "clip": [0.2, 0.28]},
          "metrics": {"sinks": ["jsonl"], "options": {}}}


def _sink_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncrl-sink-")]


def test_sink_names_put_jsonl_first_once() -> None:
    assert sink_names([]) == ["jsonl"]
    assert sink_names(["wandb", "jsonl", "wandb", "mlflow"]) == ["jsonl", "wandb", "mlflow"]


# ------------------------------------------------------------------ the fan-out
class Recorder:
    """A sink that records what it gets (and on which thread); ``gate`` holds each ``log``
    until set; ``fail_at`` makes ``log`` raise at that step."""

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None) -> None:
        self.gate, self.fail_at = gate, fail_at
        self.configs: list[Any] = []
        self.records: list[dict[str, Any]] = []
        self.threads: set[str] = set()
        self.made_with: dict[str, Any] = {}
        self.entered = threading.Event()
        self.closed = False

    def plugin(self) -> SinkPlugin:
        def make(options: dict[str, Any], **kwargs: str) -> Recorder:
            self.threads.add(threading.current_thread().name)
            self.made_with = {"options": options, **kwargs}
            return self
        return SinkPlugin(make=make)

    def log_config(self, config: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.configs.append(config)

    def log(self, record: dict[str, Any]) -> None:
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail_at is not None and record.get("step") == self.fail_at:
            raise RuntimeError("tracker is down")
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_config_and_records_reach_every_sink_on_its_thread(tmp_path: Any) -> None:
    a, b = Recorder(), Recorder()
    writer = MetricsWriter(
        str(tmp_path), origin=time.perf_counter(), sinks={"a": a.plugin(), "b": b.plugin()},
        options={"a": {"x": 1}}, run_name="demo", run_id="r1",
    )
    assert len(_sink_threads()) == 2
    hist = {"0": 1}
    writer.write({"kind": "config", "run_id": "r1", "config": CONFIG})
    writer.write({"kind": "train", "step": 1, "reward": 0.5, "staleness_hist": hist})
    hist["0"] = 99  # the caller reuses its dict: the sinks keep what was written
    writer.close()
    assert _sink_threads() == []
    assert a.made_with == {"options": {"x": 1}, "run_dir": str(tmp_path), "run_name": "demo",
                           "run_id": "r1"}
    for sink, name in ((a, "a"), (b, "b")):
        assert sink.configs == [CONFIG]
        assert [r["kind"] for r in sink.records] == ["config", "train"]
        assert sink.records[1]["staleness_hist"] == {"0": 1}
        assert sink.threads == {f"asyncrl-sink-{name}"}
        assert sink.closed
    lines = _lines(os.path.join(str(tmp_path), "metrics.jsonl"))
    assert [r["kind"] for r in lines] == ["config", "train"]
    assert lines[0]["config"] == CONFIG and lines[1]["staleness_hist"] == {"0": 1}
    assert all(isinstance(r["t"], float) and r["t"] >= 0 for r in lines)
    assert a.records == lines  # the sinks got exactly what metrics.jsonl holds
    with pytest.raises(ValueError, match="closed"):
        writer.write({"kind": "train", "step": 2})
    writer.close()  # idempotent


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Any) -> None:
    gate = threading.Event()
    slow = Recorder(gate=gate)
    writer = MetricsWriter(str(tmp_path), sinks={"slow": slow.plugin()}, queue_size=3)
    with capture_logs() as logs:
        try:
            writer.write({"kind": "train", "step": 1})
            assert slow.entered.wait(5)  # step 1 is held inside log(): the queue is empty
            start = time.monotonic()
            for step in range(2, 7):  # 2, 3, 4 fill the queue; 5 and 6 are dropped
                writer.write({"kind": "train", "step": step})
            assert time.monotonic() - start < 1.0
            assert writer.dropped == {"slow": 2}
        finally:
            gate.set()
            writer.close()
    assert [r["step"] for r in slow.records] == [1, 2, 3, 4]
    assert [r["step"] for r in _lines(writer.path)] == [1, 2, 3, 4, 5, 6]
    events = [e["event"] for e in logs]
    assert events.count("metrics_sink_lagging") == 1
    (dropped,) = [e for e in logs if e["event"] == "metrics_sink_dropped"]
    assert (dropped["sink"], dropped["dropped"], dropped["abandoned"]) == ("slow", 2, 0)
    assert _sink_threads() == []


def test_raising_sink_is_disabled_and_the_others_go_on(tmp_path: Any) -> None:
    bad, good = Recorder(fail_at=2), Recorder()

    def broken(options: dict[str, Any], **kwargs: str) -> Recorder:
        raise OSError("cannot reach the tracker")

    with capture_logs() as logs:
        writer = MetricsWriter(
            str(tmp_path), sinks={"bad": bad.plugin(), "good": good.plugin(), "dead": broken}
        )
        for step in range(1, 6):
            writer.write({"kind": "train", "step": step})
        writer.close()
    assert [r["step"] for r in bad.records] == [1]
    assert [r["step"] for r in good.records] == [1, 2, 3, 4, 5]
    assert bad.closed  # close is still tried
    assert {k: type(v) for k, v in writer.failed.items()} == {
        "bad": RuntimeError, "dead": OSError,
    }
    failed = sorted(e["sink"] for e in logs if e["event"] == "metrics_sink_failed")
    assert failed == ["bad", "dead"]  # once each
    assert len(_lines(writer.path)) == 5
    assert _sink_threads() == []


def test_close_drops_what_is_left_at_its_deadline(tmp_path: Any) -> None:
    gate = threading.Event()
    slow = Recorder(gate=gate)
    writer = MetricsWriter(
        str(tmp_path), sinks={"slow": slow.plugin()}, queue_size=2, close_timeout_s=0.3
    )
    opener = threading.Timer(1.0, gate.set)  # the tracker answers long after the deadline
    try:
        writer.write({"kind": "train", "step": 1})
        assert slow.entered.wait(5)
        writer.write({"kind": "train", "step": 2})
        writer.write({"kind": "train", "step": 3})
        opener.start()
        start = time.monotonic()
        writer.close()
        elapsed = time.monotonic() - start
    finally:
        gate.set()
        writer.close()
        if opener.is_alive():
            opener.join()
    assert 0.3 <= elapsed < 5.0
    assert [r["step"] for r in slow.records] == [1]
    assert writer.dropped == {"slow": 2}
    assert slow.closed and _sink_threads() == []


# ------------------------------------------------------------------ options and plugins
def test_option_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"metrics\.options\.jsonl\.path: unknown key"):
        load_sinks([], {"jsonl": {"path": "x"}})
    with pytest.raises(ConfigError, match=r"metrics\.options\.mlflow: options for a sink that "
                       r"metrics\.sinks does not list"):
        check_sinks(SimpleNamespace(metrics=SimpleNamespace(
            sinks=["wandb"], options={"mlflow": {"experiment": "x"}})))  # before any load
    assert _sink_threads() == []


def test_unknown_sink_is_a_plugin_error() -> None:
    """The installed sinks are named (the core's jsonl; with asyncrl-trackers installed, its
    three too: plugins/asyncrl-trackers/tests/test_trackers.py)."""
    with pytest.raises(PluginError, match=r"metrics\.sinks: no metrics sink named 'wandbb' is "
                       r"installed \(installed: [^)]*\bjsonl\b"):
        load_sinks(["wandbb"], {})


def test_plugins_lists_the_group() -> None:
    assert GROUP in registry.GROUPS
    assert "jsonl" in registry.available(GROUP)
