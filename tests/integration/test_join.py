"""An embedded controller whose workers are started elsewhere (``asyncrl.join``): the
controller in this process with ``attach=join_file(PATH)``, the workers a torchrun group of
their own started before it (they wait for the join file). Over ipc and over tcp with the
run's keys in the join file: the same rewards as the controller spawning its workers, every
refit verified, the join file removed at the end, nothing left."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl import Controller  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.join import join_file  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import read_metrics, session_processes, to_toml  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_stray_processes")

SECTIONS = {"run": {"num_steps": 3, "seed": 0}, "refit": {"verify_every_steps": 1}}


def _workers(tmp: Path, join: Path, config: Config, data: dict) -> subprocess.Popen[str]:
    path = tmp / "workers.toml"
    path.write_text(to_toml(data))
    world = config.cluster.trainer_ranks + config.cluster.rollout_ranks
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(world), *torchrun_log_args(str(tmp / "torchrun")), "-m", "asyncrl.join", str(join),
         str(path)],
        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _rewards(config: Config) -> list[float]:
    return [r["reward"] for r in read_metrics(config) if r["kind"] == "train"]


@pytest.mark.asyncio
@pytest.mark.parametrize("network", ["ipc", "tcp"])
async def test_workers_started_first_join_the_embedded_controller(
    tmp_path: Path, make_config: Callable[..., Config], network: str
) -> None:
    from integration_support import config_dict

    sections = {**SECTIONS, "cluster": {"network": network}}
    config = make_config("joined", **sections)
    join = tmp_path / "join.json"
    data = config_dict(Path(config.model.path), Path(config.run.output_dir), **sections)
    workers = _workers(tmp_path, join, config, data)  # before the controller: they wait
    try:
        time.sleep(1.0)
        async with Controller(config, attach=join_file(join)) as ctl:
            assert join.stat().st_mode & 0o777 == 0o600
            await ctl.train()
        out = workers.communicate(timeout=60)[0]
    finally:
        if workers.poll() is None:
            workers.kill()
            workers.communicate()
    assert workers.returncode == 0, out[-3000:]
    assert not join.exists()
    assert session_processes(workers.pid) == []
    records = read_metrics(config)
    verified = [(r["worker"], r["version"]) for r in records if r["kind"] == "refit_verify"]
    assert verified == [("rollout:0", v) for v in (1, 2, 3)]
    # the same run with the workers spawned by the controller: the same rewards
    spawned = make_config("spawned", **sections)
    async with Controller(spawned) as ctl:
        await ctl.train()
    assert _rewards(config) == _rewards(spawned)
