"""``asyncrl.launch`` without torchrun: what a rank says about a broken config or plugin, and
what the one-node front door (``asyncrl run`` / ``python -m asyncrl.launch``) hands torchrun
(a ``--log-dir`` that goes with the run, rank 0's exit code, SIGUSR1 passed on to rank 0).
torchrun itself is replaced by a fake; ``tests/integration/test_launch_torchrun.py`` runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl import launch, one_node, ranks
from asyncrl.errors import PluginError, WorkerDiedError, WorkerOrphanedError
from asyncrl.procs.process import PARENT_ENV

# model_dir: the fixture in conftest.py


@pytest.fixture
def config_file(tmp_path: Path, model_dir: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(
        f'[model]\npath = "{model_dir}"\n[environment]\nname = "arithmetic"\n'
        f'[run]\noutput_dir = "{tmp_path / "out"}"\n'
    )
    return path


@pytest.fixture
def launching(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a launch changes in this process's environment is put back after the test; no
    owner watch is started (it would stop pytest with its parent)."""
    for name in (PARENT_ENV, one_node.RANK0_PID_ENV, "RANK", "WORLD_SIZE"):
        # set, then deleted: monkeypatch records the variable either way and puts it back
        # as it was (a bare delenv of an unset one records nothing, and what self_launch
        # then sets would outlive the test: later spawned workers took pytest for their
        # launcher and stopped at once)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setattr(launch, "die_with_parent", lambda **kw: None)
    monkeypatch.setattr(launch, "_RANK0_FIRST_S", 0.0)


def _broken_transfer(monkeypatch: pytest.MonkeyPatch) -> str:
    message = "weight transfer 'shm' (asyncrl.weight_transfers) failed to import: boom"

    def load_transfer(name: str) -> Any:
        raise PluginError(message)

    monkeypatch.setattr("asyncrl.config.root.load_transfer", load_transfer)
    return message


def _duplicate_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    message = "two plugins named 'shm' in asyncrl.weight_transfers. Fix: uninstall one"

    def available(group: str) -> Any:
        raise PluginError(message)

    monkeypatch.setattr("asyncrl.registry.available", available)
    return message


@pytest.mark.parametrize("breakage", [_broken_transfer, _duplicate_plugin])
def test_a_broken_plugin_is_said_once_by_rank_0_with_exit_2(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch, capsys: Any,
    breakage: Any,
) -> None:
    """A plugin the config names that fails (a transfer that does not import: read through
    ``rollout_restarts``; a name registered twice: read by the config's checks) is a mistake
    in the installation: exit 2 on every rank, its line on rank 0's stderr only, and rank 1
    (a rollout rank, which would else supervise its worker) leaves without output."""
    message = breakage(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch.launch_main(str(config_file)) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert launch.launch_main(str(config_file)) == 2
    assert capsys.readouterr().err == f"asyncrl: error: {message}\n"


def test_a_bad_override_is_said_by_rank_0(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch.launch_main(str(config_file), ["grpo.prompts_per_step"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert launch.launch_main(str(config_file), ["grpo.prompts_per_step"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: error: ") and "grpo.prompts_per_step" in err


def test_the_front_door_refuses_a_broken_plugin_before_torchrun(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    message = _broken_transfer(monkeypatch)
    monkeypatch.setattr("torch.distributed.run.run", lambda args: pytest.fail("torchrun ran"))
    assert launch.self_launch(str(config_file), []) == 2
    assert capsys.readouterr().err == f"asyncrl: error: {message}\n"


def test_the_front_door_gives_torchrun_a_log_dir_that_goes_with_the_run(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def run(args: Any) -> None:
        assert os.path.isdir(args.log_dir)  # torchrun's per-attempt folders go there
        # owned by this process: a later run's sweep leaves it while this one lives
        assert Path(args.log_dir, "owner").read_text().split(" ")[0] == str(os.getpid())
        seen.append(args)

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch.self_launch(str(config_file), ["grpo.prompts_per_step=4"]) == 0
    (args,) = seen
    assert args.nproc_per_node == "2" and args.standalone
    assert args.training_script_args == [str(config_file), "--set", "grpo.prompts_per_step=4"]
    assert not os.path.exists(args.log_dir)  # removed with the run


def test_the_front_door_exits_with_rank_0s_signal_and_cleans_up(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    dirs: list[str] = []

    def run(args: Any) -> None:
        dirs.append(args.log_dir)
        failure = ProcessFailure(local_rank=0, pid=12345, exitcode=-15, error_file="<N/A>")
        raise ChildFailedError("asyncrl.launch", {0: failure})

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch.self_launch(str(config_file), []) == 128 + 15
    assert dirs and not os.path.exists(dirs[0])


def test_a_worker_that_stopped_because_its_owner_was_killed_is_no_stop_signal() -> None:
    """torchrun SIGTERMs rank 0 once a rank (a rollout supervisor) is killed, and the
    supervisor's worker stops with 143 on its owner watch: rank 0 reports that death as the
    run's cause, not "stopped by SIGTERM"; a worker that got the stop signal itself is a
    stop."""
    plain = WorkerDiedError("rollout", 0, 143, "/x/rollout-0.log")
    orphan = WorkerOrphanedError("rollout", 0, 143, "/x/rollout-0.log", owner="supervisor",
                                 owner_pid=7, owner_status=-signal.SIGKILL)  # fmt: skip
    assert launch._stopped_by_signal(plain)
    assert not launch._stopped_by_signal(orphan)


RANK0 = """
import signal, sys
signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(42))
from asyncrl.one_node import publish_rank0_pid
publish_rank0_pid()  # what rank 0's main() does first
print("ready", flush=True)
signal.pause()
"""


def test_sigusr1_to_the_front_door_goes_to_rank_0(
    config_file: Path, launching: None, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    """torchrun's agent runs in the launching process and would die of SIGUSR1 (its default
    action): the launch passes it on to rank 0, which wrote its pid where the launch reads
    it; one that comes before rank 0 started is said on stderr, and kills nothing."""
    codes: list[int] = []
    before = signal.getsignal(signal.SIGUSR1)

    def run(args: Any) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)  # rank 0 has not started: said, not passed on
        rank0 = subprocess.Popen(
            [sys.executable, "-c", RANK0], env={**os.environ, "RANK": "0"},
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert rank0.stdout is not None and rank0.stdout.readline() == "ready\n"
            os.kill(os.getpid(), signal.SIGUSR1)
            codes.append(rank0.wait(timeout=30))
        finally:
            rank0.kill()
            rank0.communicate()

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch.self_launch(str(config_file), []) == 0
    assert codes == [42]  # rank 0 got the SIGUSR1
    assert "SIGUSR1 not passed on: rank 0 is not running" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) == before  # the launch put its handler back


@pytest.mark.parametrize(("nodes", "world", "fix"), [
    (None, 3, "Fix: run torchrun with --nproc-per-node 4, or change [cluster]"),
    ("2", 16, "Fix: --nnodes x --nproc-per-node must be 4: with 2 nodes, --nproc-per-node 2,"),
    ("3", 6, "Fix: --nnodes x --nproc-per-node must be 4, which 3 nodes cannot share evenly,"),
])  # fmt: skip
def test_a_world_that_does_not_match_the_cluster_says_the_fix_for_its_node_count(
    monkeypatch: pytest.MonkeyPatch, nodes: str | None, world: int, fix: str
) -> None:
    from types import SimpleNamespace

    from asyncrl.errors import ConfigError

    config: Any = SimpleNamespace(cluster=SimpleNamespace(trainer_ranks=2, rollout_ranks=2))
    if nodes is None:
        monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)  # what torchrun's agent sets: its nodes
    with pytest.raises(ConfigError) as err:
        ranks.roles(config, 0, world)
    assert f"torchrun started {world} processes but cluster.trainer_ranks + " in str(err.value)
    assert fix in str(err.value)
    assert ranks.roles(config, 3, 4) == ("rollout", 1)


def test_a_worker_rank_that_could_not_start_is_said_to_rank_0_through_the_store() -> None:
    """Through a real TCPStore: nothing said, rank 0's watch ends with its window; ranks 2
    and 3 say why they could not start, and the watch raises with both, by rank."""
    import anyio
    import torch.distributed as dist

    from asyncrl.errors import WorkerStartupError

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)

    async def main() -> None:
        with anyio.fail_after(5):
            await ranks.watch_failed(store, 4, 0.3)  # nobody failed: returns at its window
        ranks.say_failed(store, 3, "cluster.keys_file on 'b': loose")
        ranks.say_failed(store, 2, "cluster.keys_file on 'a': missing")
        with anyio.fail_after(5), pytest.raises(WorkerStartupError) as info:
            await ranks.watch_failed(store, 4, 60)
        assert str(info.value) == (
            "a worker rank could not start; global rank 2: cluster.keys_file on 'a': "
            "missing; global rank 3: cluster.keys_file on 'b': loose"
        )

    anyio.run(main)
    ranks.say_failed(object(), 1, "no store")  # best effort: never raises


def test_rank_0_stops_watching_for_failed_ranks_when_the_store_is_gone() -> None:
    """torchrun's agent serves the store; killed (kill -9 of the launcher), the store's calls
    raise at once. The watch returns instead of failing the run with that error: the owner
    watch stops the run in order and says why (tests/integration/test_orphans.py)."""
    import gc

    import anyio
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, use_libuv=True)
    del server
    gc.collect()

    async def main() -> None:
        with anyio.fail_after(5):
            await ranks.watch_failed(client, 4, 60)

    anyio.run(main)
