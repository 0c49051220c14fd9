"""Helpers of the integration tests (imported by conftest.py and the tests).

Kept out of conftest.py so tests can import them by name: ``from integration_support import ...``
(the test directories are not packages).
"""

from __future__ import annotations

import copy
import getpass
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil

from asyncrl.config import Config
from asyncrl.run.controller import Controller
from asyncrl.procs.space import shm_dir
from asyncrl.procs.spawn import torchrun_log_args


# --------------------------------------------------------------------------- the model dir
from asyncrl_example_backend.model import write_model_dir  # noqa: E402,F401  (re-exported)


# --------------------------------------------------------------------------- configs
BASE: dict[str, Any] = {
    "environment": {"name": "repeat-digit"},
    "run": {"num_steps": 3, "seed": 0},
    "cluster": {
        "trainer_ranks": 1,
        "rollout_ranks": 1,
        "startup_timeout_s": 60.0,
        "call_timeout_s": 60.0,
        "shutdown_grace_s": 3.0,
    },
    "grpo": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 16},
    "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}},
    "refit": {"bucket_size_mb": 1, "timeout_s": 30.0},
    "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
    "generator": {"backend": "bigram"},
    "eval": {"num_prompts": 4},
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge (``over`` wins); inputs are not modified. A table whose ``name``
    changes (e.g. another sampler) is replaced, not merged: its keys belong to the old name."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("name", old.get("name")) == old.get("name"):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_dict(model_dir: Path, output_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    data = merge(BASE, sections)
    data["model"] = {"path": str(model_dir)}
    data["run"]["output_dir"] = str(output_dir)
    return data


def read_metrics(config: Config) -> list[dict[str, Any]]:
    path = Path(config.run.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Just enough TOML for the run configs of these tests (tables, scalars, inline arrays)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    for key, value in tables.items():
        lines.append(to_toml(value, f"{prefix}.{key}" if prefix else key))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the front door
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in a rank's environment: ``python -m asyncrl.launch`` with ``RANK`` set
takes itself for a rank, so a user's shell has none of these."""


def launch(config: Path, *extra: str) -> subprocess.Popen:
    """``python -m asyncrl.launch CONFIG [extra]`` as a user starts it from a shell (none of
    torchrun's variables, whatever this process has), in a session of its own, its output one
    text stream."""
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch", str(config), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def controller_pid(launched: subprocess.Popen) -> int:
    """Global rank 0 (the controller) among a launch's descendants: torchrun starts it in a
    session of its own, so a signal to the launch's group does not reach it."""
    for p in psutil.Process(launched.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == "0":
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError("the launch has no rank-0 process")


# --------------------------------------------------------------------------- leftovers
def run_processes(run_id: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``run_id`` (every spawned agent and rank
    does, through ``--control ipc:///tmp/asyncrl-<user>/<run_id>/control.sock``), whoever
    their parent is now."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(run_id in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


_TEST_START = [0.0]


def mark_test_start() -> None:
    """Only processes created from now on count as this test's leftovers: an earlier test in
    the same session may legitimately keep a child (multiprocessing's resource tracker, which
    lives as long as the test process once an in-process engine used shared memory)."""
    _TEST_START[0] = time.time()


def live_children() -> list[psutil.Process]:
    """Descendants of this (test) process started by the current test that are still running
    (zombies excluded)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() >= _TEST_START[0] - 1:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pids: Iterable[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_nothing_left(ctl: Controller, worker_pids: Iterable[int] = ()) -> None:
    """No descendant of this test process, no worker the controller saw, no process of the
    run, no socket directory and no shared-memory directory remain."""
    addr = ctl.addresses
    assert addr is not None, "the controller never bound its sockets"
    assert live_children() == [], f"child processes left behind: {live_children()}"
    assert alive(worker_pids) == [], f"worker processes left behind: {alive(worker_pids)}"
    assert run_processes(addr.run_id) == [], "processes of the run left behind"
    assert addr.run_dir == os.path.join("/tmp", f"asyncrl-{getpass.getuser()}", addr.run_id)
    assert not os.path.exists(addr.run_dir), f"socket dir left behind: {addr.run_dir}"
    assert not os.path.exists(shm_dir(addr.run_id)), f"shm dir left behind: {shm_dir(addr.run_id)}"


def worker_pids(ctl: Controller) -> dict[str, int]:
    """``{"group:rank": pid}`` of the connected workers (call inside the ``async with``)."""
    return ctl.status().workers


def free_port() -> int:
    """A TCP port nobody listens on right now (for torchrun's --master-port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun_driver(driver: Path, args: list[str], ranks: int, timeout_s: float = 240.0) -> None:
    """``torchrun --standalone --nproc-per-node RANKS DRIVER ARGS...`` on the CPU (one thread a
    rank), in a session of its own: a hung collective is killed with the whole process group,
    and ranks torchrun may have put in sessions of their own too. Fails the test, with the
    output's tail, if it times out or exits non-zero."""
    import pytest

    with tempfile.TemporaryDirectory(prefix="asyncrl-torchrun-") as scratch:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            *torchrun_log_args(scratch), "--nproc-per-node", str(ranks), str(driver), *args,
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            ranks_left = psutil.Process(proc.pid).children(recursive=True)
            os.killpg(proc.pid, signal.SIGKILL)
            for rank in ranks_left:
                rank.kill()
            output, _ = proc.communicate()
            pytest.fail(f"{driver.name} timed out (ranks out of lockstep?):\n{output[-6000:]}")
    assert proc.returncode == 0, f"{driver.name} failed:\n{output[-8000:]}"


def session_processes(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return found


def run_files(run_id: str) -> list[str]:
    """The run's socket directory and shared-memory directory, where they still exist."""
    paths = [os.path.join("/tmp", f"asyncrl-{getpass.getuser()}", run_id), shm_dir(run_id)]
    return [p for p in paths if os.path.exists(p)]


# --------------------------------------------------------------------------- TensorBoard files
# An independent reader of TensorBoard's event files (TFRecord framing with masked CRC-32C),
# written from the format, for the end-to-end run (the trackers' own tests keep a copy:
# plugins/asyncrl-trackers/tests/test_trackers.py).
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


def read_tensorboard(directory: str | Path) -> tuple[dict[str, list[tuple[int, float]]],
                                                     dict[str, list[tuple[int, str]]]]:
    """Every scalar and text summary in ``directory``'s event files, by tag: (step, value)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for data in tfrecords(str(path)):
            event = Event.FromString(data)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
                elif value.tensor.string_val:
                    texts.setdefault(value.tag, []).append(
                        (event.step, value.tensor.string_val[0].decode())
                    )
    return scalars, texts


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new (spawned) Python process, its result or its exception back
    here: for engines that keep process-wide state (DeepSpeed cannot be started twice in
    one process). ``fn`` must be importable (a module-level function)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@asynccontextmanager
async def training(ctl: Controller) -> AsyncIterator[list[Any]]:
    """``ctl.train()`` in a task while the body acts on the run (kills a worker, sends
    frames...); the list it yields holds the run's summary once the body and the run are
    done."""
    result: list[Any] = []

    async def train() -> None:
        result.append(await ctl.train())

    async with anyio.create_task_group() as tg:
        tg.start_soon(train)
        yield result
