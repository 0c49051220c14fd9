"""``asyncrl run CONFIG`` and ``python -m asyncrl.launch CONFIG`` outside torchrun: one node,
torchrun's launcher run in this process with one rank per trainer and rollout rank
(:func:`self_launch`), and SIGUSR1 passed on to global rank 0 (a checkpoint on demand), whose
pid rank 0 publishes for it (:func:`publish_rank0_pid`, first thing in every rank's
:func:`asyncrl.launch.main`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config import load_config, parse_overrides
from asyncrl.errors import ConfigError, PluginError
from asyncrl.procs.process import PARENT_ENV
from asyncrl.procs.scratch import scratch_dir
from asyncrl.run.runlock import check_free

__all__ = ["RANK0_PID_ENV", "publish_rank0_pid", "self_launch"]

RANK0_PID_ENV = "ASYNCRL_RANK0_PID_FILE"
"""Set by :func:`self_launch` for its ranks: where global rank 0 writes its pid, so that the
launching process can forward SIGUSR1 to it."""


def self_launch(
    config_path: str,
    set_args: list[str],
    resume: str | None = None,
    allow_changed: list[str] | None = None,
) -> int:
    """``python -m asyncrl.launch CONFIG`` outside torchrun: check the config, then run
    torchrun's launcher in this process with one rank per trainer and rollout rank.

    Returns rank 0's exit code (128 + N for a rank stopped by signal N), 2 for a mistake in
    the config or a plugin it names (said before any process starts). While the run goes,
    SIGUSR1 to this process is forwarded to rank 0 (a checkpoint at the next step boundary).
    """
    try:
        config = load_config(config_path, parse_overrides(set_args))
        _ = config.rollout_restarts  # loads refit.transport's plugin: a broken one → exit 2
        check_free(config)  # a live run's directory: refused before any process starts
    except (ConfigError, PluginError) as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 2
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from asyncrl.procs.spawn import torchrun_log_args

    # rank 0 reports the outcome; torchrun's own warnings would only repeat it
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    nproc = config.cluster.trainer_ranks + config.cluster.rollout_ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[PARENT_ENV] = str(os.getpid())  # a rank orphaned while it starts stops at once
    try:  # torchrun's per-attempt directories: in one that goes with the run (or, when
        # this process is killed, with the next run's sweep)
        with scratch_dir() as scratch:
            pid_file = os.path.join(scratch, "rank0.pid")
            os.environ[RANK0_PID_ENV] = pid_file
            before = signal.signal(signal.SIGUSR1, _forward_to_rank0(pid_file))
            try:
                argv = _torchrun_argv(nproc, config_path, set_args, resume, allow_changed)
                run(get_args_parser().parse_args([*torchrun_log_args(scratch), *argv]))
            finally:
                signal.signal(signal.SIGUSR1, before)
                os.environ.pop(RANK0_PID_ENV, None)
    except ChildFailedError as exc:
        failure = exc.failures.get(0) or exc.get_first_failure()[1]
        code = failure.exitcode
        return code if code > 0 else 128 - code
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def _torchrun_argv(
    nproc: int, config_path: str, set_args: list[str], resume: str | None,
    allow_changed: list[str] | None,
) -> list[str]:
    """torchrun's arguments (but ``--log-dir``) for a one-node launch of ``nproc`` ranks."""
    argv = ["--standalone", f"--nproc-per-node={nproc}", "-m", "asyncrl.launch", config_path]
    for item in set_args:
        argv += ["--set", item]
    if resume is not None:
        argv += ["--resume", resume]
    for item in allow_changed or []:
        argv += ["--allow-changed", item]
    return argv


def _forward_to_rank0(pid_file: str) -> Callable[[int, Any], None]:
    """The launching process's SIGUSR1 handler: send the signal on to global rank 0, whose pid
    it wrote to ``pid_file`` when it started (:func:`publish_rank0_pid`). torchrun's agent
    runs in this process and handles only TERM, INT, HUP and QUIT: SIGUSR1's default action
    would kill it, and the run with it, with no checkpoint."""

    def forward(signum: int, frame: Any) -> None:
        try:
            pid = int(Path(pid_file).read_text())
            os.kill(pid, signal.SIGUSR1)
        except (OSError, ValueError):  # rank 0 has not started yet, or is gone
            os.write(2, b"asyncrl: SIGUSR1 not passed on: rank 0 is not running (it has not "
                        b"started yet: send it again once the run goes)\n")

    return forward


def publish_rank0_pid() -> None:
    """Global rank 0 of a :func:`self_launch`: write this process's pid where the launching
    process reads it to forward SIGUSR1 (atomically: it never reads half a pid)."""
    path = os.environ.pop(RANK0_PID_ENV, None)  # not for this rank's own children
    if path is None or os.environ.get("RANK") != "0":
        return
    tmp = f"{path}.tmp"
    Path(tmp).write_text(str(os.getpid()))
    os.replace(tmp, path)
