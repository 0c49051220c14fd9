"""Process entry point: ``torchrun -m asyncrl.launch`` and ``python -m asyncrl.launch``.

Three forms::

    torchrun --nproc-per-node N -m asyncrl.launch run.toml [--set grpo.prompts_per_step=8 ...]
        [--resume [DIR|latest] [--allow-changed FIELD,...]]
        ranks [0, T) train, ranks [T, T+R) generate (T, R from [cluster]); global rank 0 also
        hosts the controller, and serves its own trainer role inside the controller's task
        group (its compute runs on a worker thread, off the event loop).

    python -m asyncrl.launch run.toml [--set ...]
        the same on one node without typing the process count: checks the config (exit 2 on
        a mistake, before anything starts), then runs torchrun in this process with
        N = T + R and exits with rank 0's exit code, without torchrun's failure report.

    torchrun --standalone --nproc-per-node K -m asyncrl.launch --worker GROUP --control ADDR
        what an embedded Controller spawns: every rank is a worker of GROUP.

With ``failures.rollout_restarts`` (the default), a rollout rank of either launch does not
serve itself: it supervises its worker, a child process it starts again when it dies
(:mod:`asyncrl.procs.supervisor`).

Trainer ranks of a mixed launch get a torch.distributed world of their own, built on
torchrun's store under a private prefix; rollout ranks never join torch.distributed.

Failures and signals (rank 0 speaks for the run; the other ranks write only to their logs):

=============================  ============================================  ==========
what happened                  what rank 0 prints on stderr                  exit code
=============================  ============================================  ==========
success                        eval lines, the metrics path                  0
config mistake, or a plugin    ``asyncrl: error: <field>: ... Fix: ...``     2
that is missing or broken
a worker died / a run error    ``asyncrl: error: <root cause>`` (+ details)  1
SIGTERM / SIGINT               ``asyncrl: stopped by SIGTERM ...``           143 / 130
a checkpoint that cannot be    ``asyncrl: error: checkpoint ...: ... Fix:``  2
resumed (corrupt, another run,
finished)
=============================  ============================================  ==========

SIGUSR1 to rank 0 (the controller) saves a checkpoint at the next step boundary and goes on;
the other ranks ignore it. Under ``python -m asyncrl.launch`` (and ``asyncrl run``) SIGUSR1 to
the launching process does the same: it forwards the signal to rank 0 (torchrun's agent,
which runs in it, would otherwise die of it and take the run down without a checkpoint).

A signal starts the same orderly shutdown as a run that ends (workers told to stop, engines
closed, sockets and shared memory removed). When torchrun sends SIGTERM because another rank
died, the peer watchers name that rank (group, rank, exit code, log) as the root cause.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from asyncrl.obs import log as _log
from asyncrl.obs.startup import process_start_time
from asyncrl.wire.curve import RunKeys
from asyncrl.checkpoints.directory import CheckpointError
from asyncrl.config import Config, load_config, parse_overrides
from asyncrl.errors import (
    AsyncRLError,
    ConfigError,
    PluginError,
    WorkerDiedError,
    WorkerOrphanedError,
    flatten,
)
from asyncrl.procs.process import (
    die_with_parent,
    host_id,
    lost_owner,
    stopped_by_signal,
)
from asyncrl.one_node import publish_rank0_pid, self_launch
from asyncrl.ranks import (
    ControllerAt,
    agent_store,
    env_int,
    node_keys,
    rank_kwargs,
    roles,
    say_failed,
    watch_failed,
    worker_main,
    worker_rank,
)
from asyncrl.procs.space import no_space_in

if TYPE_CHECKING:
    from asyncrl.run.controller import AttachHook

log = structlog.get_logger("asyncrl.launch")

_STORE_KEY = "asyncrl/control"
_PID_KEY = "asyncrl/controller_pid"
_HOST_KEY = "asyncrl/controller_host"
_KEYS_KEY = "asyncrl/run_keys"
"""The run's CURVE keys (``cluster.network = "tcp"`` without ``cluster.keys_file``)."""
_EARLY_SIGUSR1: list[int] = []
"""SIGUSR1s that arrived before the controller could take them (see :func:`main`)."""
_RANK0_FIRST_S = 5.0
"""How long the other ranks wait before exiting on a config mistake, so that rank 0 has said
it before torchrun stops the job (a rank that exited first got rank 0 SIGTERMed unheard)."""
EVENT_LOOP = "auto"
"""The controller's event loop under ``asyncrl run`` / ``asyncrl.launch`` (an embedding program
runs its own): ``auto`` is uvloop where it is installed (a dependency on Linux and macOS),
else asyncio's; ``uvloop`` or ``asyncio`` force one. At 1,000 gateway sessions uvloop took the
loop's lag p50 from 2.2 to 0.8 ms and 10% more calls a second (docs/gateway.md). Once the
config key ``run.event_loop`` (issue 50)."""
_SIGNAL_GRACE_S = 2.0
"""After a stop signal, how long rank 0 waits for a peer watcher to name a dead rank as the
cause (torchrun SIGTERMs rank 0 within its monitor interval of another rank's death)."""


def loop_options(event_loop: str = "") -> dict[str, Any]:
    """``anyio.run``'s ``backend_options`` for ``event_loop`` (default :data:`EVENT_LOOP`)."""
    event_loop = event_loop or EVENT_LOOP
    uvloop = event_loop == "uvloop" or (
        event_loop == "auto" and importlib.util.find_spec("uvloop") is not None
    )
    return {"use_uvloop": uvloop}


def launch_main(
    config_path: str,
    set_args: Sequence[str] = (),
    resume: str | None = None,
    allow_changed: list[str] | None = None,
) -> int:
    """One rank of ``torchrun -m asyncrl.launch CONFIG [--set KEY=VALUE ...]``: 2 (said by
    rank 0 alone) when the overrides, the config or a plugin it names is broken."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    die_with_parent()  # the agent (or `asyncrl run`) killed outright: no rank trains on
    try:
        config = load_config(config_path, parse_overrides(list(set_args)))
        group, group_rank = roles(config, rank, world)
        # loads refit.transport's plugin: read on every rank, before any output goes to a
        # rank's log, so that rank 0 says what is broken (not "rollout rank died")
        rollout_restarts = config.rollout_restarts
    except (ConfigError, PluginError) as exc:
        if rank == 0:  # every rank finds the same mistake: one of them says it
            print(f"asyncrl: error: {exc}", file=sys.stderr, flush=True)
        else:  # and leaves first: torchrun stops the others once one exits
            time.sleep(_RANK0_FIRST_S)
        return 2
    store = agent_store()
    worker_kwargs = rank_kwargs(config, group, group_rank, store)
    if rank != 0:
        return worker_rank(config, worker_kwargs, rollout_restarts,
                           lambda: _controller_in_store(config, store), speaks=rank == 1,
                           failed=lambda message: say_failed(store, rank, message))  # fmt: skip
    _log.configure(config.run.log_format)
    return _run_controller(config, store, worker_kwargs, resume, allow_changed or [])


def _controller_in_store(config: Config, store: Any) -> ControllerAt:
    """Rank 0's controller, as it published itself in torchrun's store (waited for up to
    ``cluster.startup_timeout_s``)."""
    store.set_timeout(datetime.timedelta(seconds=config.cluster.startup_timeout_s))
    control = store.get(_STORE_KEY).decode()
    controller_pid = int(store.get(_PID_KEY).decode())
    if store.get(_HOST_KEY).decode() != host_id():
        # its pid names nothing here; the controller refuses this rank (docs/multi-node.md)
        controller_pid = 0
    return control, controller_pid, _rank_keys(config, store, control)


def _rank_keys(config: Config, store: Any, control: str) -> RunKeys | None:
    """The run's CURVE keys: ``cluster.keys_file``'s, or those rank 0 put in torchrun's
    store (every socket is CURVE, ipc as tcp)."""
    if config.cluster.keys_file:
        return node_keys(config.cluster.keys_file)
    return RunKeys.from_json(store.get(_KEYS_KEY).decode(), "torchrun's store")


def _run_controller(config: Config, store: Any, worker_kwargs: dict[str, Any],
                    resume: str | None = None, allow_changed: list[str] | None = None) -> int:
    """Rank 0: host the controller (and trainer rank 0) until the run ends or a signal."""
    stop = _StopSignal()
    attach = _attacher(store, worker_kwargs, publish_keys=not config.cluster.keys_file,
                       world=env_int("WORLD_SIZE"), startup_s=config.cluster.startup_timeout_s)
    try:
        # the launch: this rank's parent, torchrun's agent (asyncrl run's own process)
        launched = process_start_time(os.getppid())
        summary = anyio.run(_host, config, attach, resume, allow_changed or (), stop, launched,
                            backend_options=loop_options())
    except BaseException as exc:  # noqa: BLE001 - every way out gets its one line
        error = _asyncrl_error(exc)
        if error is None:
            raise
        if not (stop.signal is not None and _stopped_by_signal(error)):
            return _report_failure(config, error)
        summary = None  # a rank that left because of the same signal: not a failure
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving in order: see _StopSignal
    return _report_end(config, summary, stop.signal)


class _StopSignal:
    """The SIGTERM or SIGINT that stopped rank 0's run, if one did."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    async def watch(self, run_scope: anyio.CancelScope) -> None:
        """At the first SIGTERM or SIGINT, keep it and cancel ``run_scope`` after
        ``_SIGNAL_GRACE_S``, so that a peer watcher can name a dead rank as the cause first.

        Cancellation: when the run ends first, it stops waiting; SIGTERM is ignored from then.
        """
        try:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for sig in signals:
                    self.signal = sig
                    break
        finally:
            # the receiver is gone, and leaving it restored SIGTERM's default action: a
            # SIGTERM now must not cut the shutdown short, nor kill this rank before it prints
            # the run's one line (torchrun sends one as soon as another rank exits, e.g. a
            # rollout worker whose engine died). A second Ctrl-C still interrupts it.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.warning("run_signalled", signal=sig.name)
        await anyio.sleep(_SIGNAL_GRACE_S)
        run_scope.cancel()


def _attacher(
    store: Any, worker_kwargs: dict[str, Any], *, publish_keys: bool, world: int,
    startup_s: float,
) -> AttachHook:
    """Rank 0's attach hook: publish the controller's pid, its keys (unless every rank
    reads them from ``cluster.keys_file``) and its address in torchrun's store, where
    the other ranks wait for them, and serve trainer rank 0 in the controller's tasks; while
    the ``world`` ranks start (``startup_s``), stop the run as soon as one says in the store
    that it could not (``ranks.watch_failed``)."""
    from asyncrl.run.controller import Addresses
    from asyncrl.worker.runtime import serve

    async def attach(addresses: Addresses, tg: Any) -> None:
        store.set(_PID_KEY, str(os.getpid()))  # before the address other ranks wait for
        store.set(_HOST_KEY, host_id())
        if addresses.keys is not None and publish_keys:
            store.set(_KEYS_KEY, addresses.keys.to_json())
        store.set(_STORE_KEY, addresses.control)
        tg.start_soon(
            lambda: serve(control_address=addresses.control, log_path="(rank 0 console)",
                          keys=addresses.keys, **worker_kwargs),
            name="rank0-worker",
        )
        tg.start_soon(watch_failed, store, world, startup_s, name="failed-ranks")

    return attach


async def _host(
    config: Config, attach: AttachHook, resume: str | None, allow_changed: Sequence[str],
    stop: _StopSignal, launched: float | None,
) -> Any:
    """Run the controller to the run's end beside the watch of stop signals: the summary, or
    ``None`` when a signal stopped it (the controller then shut down in order). Raises what
    the controller raises; :func:`_run_controller` turns it into the run's one line."""
    from asyncrl.run.controller import Controller

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop.watch, tg.cancel_scope, name="signals")
        async with Controller(
            config, attach=attach, resume=resume, allow_changed=allow_changed,
            launched_at=launched,
        ) as ctl:
            async with anyio.create_task_group() as run_tg:
                run_tg.start_soon(_checkpoint_on_sigusr1, ctl, name="sigusr1")
                summary = await ctl.train()
                run_tg.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    return summary if stop.signal is None else None


def _report_failure(config: Config, error: AsyncRLError) -> int:
    """Rank 0's one line on a failed run, and its exit code: 2 for a mistake in the config or
    the installation (nothing was started), else 1 (and where ``--resume`` goes on from)."""
    print(f"asyncrl: error: {_one_line(error, config)}", file=sys.stderr, flush=True)
    if isinstance(error, (ConfigError, PluginError, CheckpointError)):
        return 2
    _print_resume_hint(config)
    return 1


def _report_end(config: Config, summary: Any, stopped_by: signal.Signals | None) -> int:
    """Rank 0's last words on a run that ended (``summary``) or was stopped by the signal
    ``stopped_by`` (``summary`` is ``None``): what it printed, and its exit code."""
    if summary is None:
        assert stopped_by is not None  # a run without a summary was stopped by a signal
        owner = lost_owner()
        why = f"because its launcher (pid {owner}) exited" if owner else f"by {stopped_by.name}"
        metrics = os.path.join(config.run.output_dir, "metrics.jsonl")
        print(f"asyncrl: stopped {why}: the run was shut down in order (metrics so far: "
              f"{metrics})", file=sys.stderr, flush=True)
        _print_resume_hint(config)
        return 128 + int(stopped_by)
    for e in summary.evals:
        print(f"eval {e['label']}: accuracy {e['accuracy']:.3f} on {e['num_prompts']} prompts")
    for job in summary.jobs:  # a run of jobs: how each ended (docs/jobs.md)
        ended = f"{job['state']} at step {job['step']} of {job['num_steps']}"
        why = f": {job['error']}" if job["error"] else ""
        print(f"job {job['job']}: {ended}{why} ({job['output_dir']})")
    if summary.rejected_frames:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(summary.rejected_frames.items()))
        print(f"rejected frames: {refused} (see the frame_rejected log lines)")
    if summary.refused_peers:
        print(f"refused connections: {summary.refused_peers} without the run's keys (see the "
              "peer_refused log lines)")
    print(f"metrics: {summary.metrics_path}")
    failed = [job["job"] for job in summary.jobs if job["state"] == "failed"]
    if failed:
        print(f"asyncrl: {len(failed)} of {len(summary.jobs)} jobs failed: {', '.join(failed)} "
              "(each job's error above; the others ran to their end)", file=sys.stderr,
              flush=True)  # fmt: skip
        return 1
    return 0


async def _checkpoint_on_sigusr1(ctl: Any) -> None:
    """Each SIGUSR1 asks for a checkpoint at the next step boundary (the run goes on),
    including one that arrived while the run was starting (looked at once the receiver is
    installed, so none falls between the two)."""
    with anyio.open_signal_receiver(signal.SIGUSR1) as signals:
        if _EARLY_SIGUSR1:
            _EARLY_SIGUSR1.clear()
            log.info("checkpoint_requested", by="SIGUSR1 (during start-up)")
            ctl.request_checkpoint()
        async for _ in signals:
            log.info("checkpoint_requested", by="SIGUSR1")
            ctl.request_checkpoint()


def _print_resume_hint(config: Config) -> None:
    """After a run that did not finish: where ``--resume`` goes on from, if anywhere."""
    from asyncrl.checkpoints.directory import latest

    found = latest(config.checkpoint.dir)
    if found is not None:
        print(f"asyncrl: the newest checkpoint is {found}: add --resume to go on from it",
              file=sys.stderr, flush=True)


def _stopped_by_signal(error: AsyncRLError) -> bool:
    """A worker that exited because it got the stop signal too (a Ctrl-C reaches every rank);
    not one that stopped because its owner was killed (the signal this rank got is torchrun's
    answer to that death: the death is the cause)."""
    return (
        isinstance(error, WorkerDiedError)
        and not isinstance(error, WorkerOrphanedError)
        and stopped_by_signal(error.exit_code)
    )


def _asyncrl_error(exc: BaseException) -> AsyncRLError | None:
    """The first asyncrl error inside ``exc`` (possibly an exception group), if there is one;
    else a full file system (a bare ENOSPC) as a ``NoSpaceError``."""
    found = next((e for e in flatten(exc) if isinstance(e, AsyncRLError)), None)
    return found if found is not None else no_space_in([exc])


def _one_line(error: AsyncRLError, config: Config) -> str:
    """The error's first line; the whole text (remote tracebacks...) goes to a file."""
    text = str(error)
    first, _, rest = text.partition("\n")
    if not rest.strip():
        return first
    path = Path(config.run.output_dir) / "logs" / "error.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    except OSError:
        return first
    return f"{first} (details: {path})"


def add_resume_args(parser: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--allow-changed``, as ``asyncrl run`` and ``python -m asyncrl.launch``
    both take them (here, not in :mod:`asyncrl.cli`: the ranks parse them, and ``cli`` already
    imports this module; the other way round the two would import each other)."""
    parser.add_argument("--resume", nargs="?", const="latest", metavar="DIR|latest",
                        help="go on from a checkpoint: a checkpoint directory, a directory of "
                        "them, or 'latest' (the default: the newest in checkpoint.dir)")
    parser.add_argument("--allow-changed", action="append", default=[], metavar="FIELD,...",
                        help="with --resume: accept these changes of settings that change what "
                        "the checkpoint means (fields or sections: loss.clip_eps_low, loss, "
                        "grpo.temperature, model.tokenizer; or 'all'); other changes are refused "
                        "with their names (docs/checkpointing.md)")


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncrl.launch``: one of the three forms of the module docstring."""
    # SIGUSR1 asks rank 0 for a checkpoint; one that arrives while a rank is starting must
    # neither kill it (the default action) nor be lost (rank 0 acts on it once it runs)
    signal.signal(signal.SIGUSR1, lambda signum, frame: _EARLY_SIGUSR1.append(signum))
    publish_rank0_pid()
    parser = argparse.ArgumentParser(prog="python -m asyncrl.launch")
    parser.add_argument("config", nargs="?", help="run config (TOML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_resume_args(parser)
    parser.add_argument("--worker", choices=["trainer", "rollout"], help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    parser.add_argument("--max-restarts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--controller-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(
            args.worker, args.control, args.log_dir, max_restarts=args.max_restarts,
            rank=args.rank, world=args.world_size, controller_pid=args.controller_pid,
        )
    if not args.config:
        parser.error("a config file is required")
    if "RANK" not in os.environ:
        return self_launch(args.config, args.set, args.resume, args.allow_changed)
    return launch_main(args.config, args.set, args.resume, args.allow_changed)


if __name__ == "__main__":
    sys.exit(main())
