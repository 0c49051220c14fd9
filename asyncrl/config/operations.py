"""``[eval]``, ``[checkpoint]``, ``[export]``, ``[failures]`` and ``[metrics]``: what a run
measures, keeps and writes, and what it tolerates.

Each section's checks sit with it; :func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncrl.config.section import Section, fail, not_negative
from asyncrl.errors import ConfigError

__all__ = [
    "HEARTBEAT_INTERVAL_S", "PROBES_PER_TIMEOUT", "CheckpointConfig", "EvalConfig", "ExportConfig",
    "FailuresConfig", "MetricsConfig",
]  # fmt: skip

# The heartbeat's probe interval (docs/failures.md, "Hung workers"): the config key
# ``failures.heartbeat_interval_s`` until issue 50, now derived from ``heartbeat_timeout_s``
# (:attr:`FailuresConfig.heartbeat_interval_s`), so a shorter timeout needs no second setting.
HEARTBEAT_INTERVAL_S = 5.0
"""The longest time between two probes of a worker: its default when it was a key. A probe
is one small ``Health`` message per worker, answered by its event loop at once, so 5 s costs
nothing; a hung worker is found at most this long after ``heartbeat_timeout_s``, and a worker
takes a silent controller for gone after this plus the timeout (65 s by default)."""
PROBES_PER_TIMEOUT = 12
"""Probes that fit in ``heartbeat_timeout_s`` at least: the defaults' 60 s / 5 s. A shorter
timeout probes more often, so a hang is still found within a twelfth of the timeout after it,
and a worker takes a silent controller for gone within a twelfth past the timeout too (the
tests' 3 s timeout: probes every 0.25 s, a controller named after 3.25 s of silence)."""


class EvalConfig(Section):
    num_prompts: int = 0
    """Held-out prompts scored greedily (0 = no evaluation). Set it to measure held-out
    accuracy."""
    at_start: bool = True
    """Evaluate the starting policy before the first step. Turn it off to skip the first
    evaluation (a quick test; a resumed run skips it anyway)."""
    at_end: bool = True
    """Evaluate the final policy after the last refit. Turn it off when the last evaluation is
    not needed."""
    every_steps: int = 0
    """Also evaluate every this many steps, on the same engines while training goes on (the
    next refit waits for it); the best result goes to ``<checkpoint.dir>/best.json``. Set it to
    follow held-out accuracy during a long run."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[eval]``."""
        out = not_negative({"eval.every_steps": self.every_steps})
        if self.num_prompts < 0:
            out.append(fail("eval.num_prompts", "must be >= 0", "use 0 to disable evaluation"))
        return out


class CheckpointConfig(Section):
    dir: str = ""
    """Where checkpoints go (``""``: ``<run.output_dir>/checkpoints``; relative to the config
    file). Every rank must see it (one host, or a shared file system). Set it to a file system
    with room for a few checkpoints."""
    every_steps: int = 0
    """Save after every this many optimizer steps (0: only at the end and on demand): the
    trainer's and the controller's whole state (docs/checkpointing.md). Generation goes on. Set
    it for any run longer than you can afford to lose."""
    at_end: bool = True
    """Save after the last step (to export it, or to resume with a larger run.num_steps). Turn
    it off for throwaway runs."""
    keep_last: int = 2
    """Keep this many most recent checkpoints, and the best one (``best.json``); older ones
    are deleted once a save succeeded. Raise it to keep more history; lower it when disk is
    short."""
    save_model: bool = True
    """Also write the policy as a Hugging Face directory (``model/``, ``model.dtype`` bytes a
    parameter) into each checkpoint: ``asyncrl export`` needs no trainer. Turn it off to save
    disk and time when you will not export from the checkpoints."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[checkpoint]``."""
        out = not_negative({"checkpoint.every_steps": self.every_steps})
        if self.keep_last < 1:
            out.append(fail("checkpoint.keep_last", "must be >= 1", "keep at least 1"))
        return out


class ExportConfig(Section):
    dir: str = ""
    """Where exported models go (``""``: ``<run.output_dir>/hf``): ``final/``, ``step-<N>/``.
    Set it where the trained models should go."""
    at_end: bool = True
    """Export the final policy. Turn it off when the checkpoint is enough."""
    every_steps: int = 0
    """Also export every this many optimizer steps (0: never). Set it to keep servable snapshots
    during a run."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[export]``."""
        return not_negative({"export.every_steps": self.every_steps})


class FailuresConfig(Section):
    generation_retries: int = 3
    """Times a group whose generation failed in the engine is dispatched again (same prompt,
    same step) after a back-off; then it is dropped. A request its own data makes unservable
    (``RequestError``: a prompt longer than the context...) is dropped at once. Raise it for
    flaky engines; 0 drops a failed group at once."""
    max_failed_groups: int = 16
    """Groups dropped for good that the run tolerates; one more stops it with the last error.
    A dropped group's step gets a fresh prompt; the ledger counts it as ``failed``. Raise it
    when failures are expected (flaky tools or agents, hostile gateway clients)."""
    on_reward_error: Literal["fail_run", "drop_group"] = "fail_run"
    """``score()`` raised, returned a non-finite reward or ran past ``reward_timeout_s``:
    ``fail_run`` stops the run naming the prompt, the completion and the error; ``drop_group``
    logs them and drops the group. Set ``drop_group`` when the reward code may fail on some
    completions and that is acceptable."""
    reward_timeout_s: float = 60.0
    """Deadline of each reward call: an environment's ``score()`` (per completion) or
    ``score_async()``, and so each reward function of the ``dataset`` environment. A call past
    it fails its group under ``on_reward_error``, naming the function, the prompt and the
    deadline; an async call is cancelled, a sync one's thread abandoned (it cannot be stopped;
    at most 16 such threads may still be running, then the run stops). Raise it for reward code
    that legitimately takes longer (executing tests, calling a judge model)."""
    max_nonfinite_steps: int = 0
    """Steps whose loss or gradient norm is not finite (NaN or infinite) that the run skips:
    the trainer never applies such a step (the weights stay as they were) and its groups are
    used up. One more stops the run, naming the likely cause (the step's rewards and
    advantages, or the weights). ``0``: the first stops it. Counted from the start of the
    process (a resumed run counts afresh). Raise it to survive a rare NaN step while its cause
    is investigated."""
    rollout_restarts: int = 3
    """Times in a run a rollout worker that died (its process, or its engine) is started
    again in place: its groups go to the other workers meanwhile (or wait for it), and it is
    refitted before it gets new ones. One more death stops the run. ``0``: the first death
    stops it. On another node its rank restarts it there; one found silent (its node gone or
    cut off) is restarted only if its new process connects within ``heartbeat_timeout_s``
    more. With ``refit.transport = "nccl"`` a death in the middle of a refit fails that
    refit for every generator (one broadcast group): it is done again without the dead one.
    Lower it (0) to stop at the first death; raise it for long runs on unreliable engines."""
    heartbeat_timeout_s: float = 60.0
    """Every worker is sent a health probe every twelfth of this, 5 s at most (its event loop
    answers it at once, whatever call it is serving); a worker that answers no probe for this
    long while its process lives (stopped, deadlocked, its loop blocked) is hung: it is named
    (group, rank, last answer, log file) and handled as a death, so a rollout worker is
    restarted under ``rollout_restarts`` and a trainer stops the run. Each worker likewise stops
    once it heard nothing from the controller for the probe interval + this long (stopped, its
    loop blocked, its host gone), time its own loop did not run not counted. ``0``: no
    heartbeat. Raise it when workers' event loops may be legitimately busy for longer; lower it
    to notice hangs sooner."""
    collective_timeout_s: float | None = None
    """A trainer rank whose torch collective waits longer than this (a rank stuck in its
    compute or gone, ranks out of step) fails the call with a ``CollectiveTimeoutError``, and
    the run stops naming the rank: its event loop still answers the heartbeat, so nothing
    else would see it before ``cluster.call_timeout_s``. Set on the trainer's process group
    once the backend started (loading the model may keep ranks apart longer). ``None``: the
    heartbeat's timeout (``0``: torch's defaults, 10 min on NCCL, 30 min on gloo). Raise it
    when ranks legitimately wait long on each other (checkpoints written to a slow shared
    file system)."""

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between two probes of a worker: ``heartbeat_timeout_s`` /
        :data:`PROBES_PER_TIMEOUT`, :data:`HEARTBEAT_INTERVAL_S` at most (5 s by default).
        Derived, not a key: the controller and every worker compute it from the same
        timeout."""
        return min(HEARTBEAT_INTERVAL_S, self.heartbeat_timeout_s / PROBES_PER_TIMEOUT)

    def collective_timeout(self) -> float:
        """The trainer's collective timeout in seconds; ``0``: torch's default."""
        if self.collective_timeout_s is None:
            return self.heartbeat_timeout_s
        return self.collective_timeout_s

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[failures]``."""
        out: list[ConfigError] = []
        if not 0 < self.reward_timeout_s < float("inf"):
            out.append(fail("failures.reward_timeout_s", "must be > 0 and finite", "use e.g. 60"))
        timeout = self.heartbeat_timeout_s
        if not 0 <= timeout < float("inf"):
            out.append(fail("failures.heartbeat_timeout_s", "must be >= 0 and finite",
                            "use e.g. 60, or 0 to turn the heartbeat off"))  # fmt: skip
        collective = self.collective_timeout_s
        if collective is not None and not 0 <= collective < float("inf"):
            out.append(fail("failures.collective_timeout_s", "must be >= 0 and finite",
                            "use e.g. 60, or leave it out (the heartbeat's timeout)"))  # fmt: skip
        counts = (
            "generation_retries", "max_failed_groups", "rollout_restarts", "max_nonfinite_steps",
        )  # fmt: skip
        return out + not_negative({f"failures.{k}": getattr(self, k) for k in counts})


class MetricsConfig(Section):
    sinks: list[str] = msgspec.field(default_factory=lambda: ["jsonl"])
    """Where step, evaluation and completion records go (entry point group
    ``asyncrl.metrics_sinks``): ``jsonl`` (``<run.output_dir>/metrics.jsonl``, always written:
    ``asyncrl plot`` and ``--resume`` read it), ``tensorboard``, ``wandb``, ``mlflow``, or a
    plugin's name; several at once. Each gets the run's resolved config first. Add
    ``tensorboard``, ``wandb`` or ``mlflow`` to follow the run there."""
    options: dict[str, dict[str, Any]] = {}
    """Per-sink options, by sink name (``[metrics.options.wandb] project = "x"``), validated
    by the sink before any process starts. Set each sink's project, run name and so on there."""
    completions_every: int = 10
    """Every this many steps, three of the step's completions (one per group) with their
    rewards are printed and sent to the sinks as a table (``completions`` records); the
    progress bar beside them shows on an interactive terminal only. Lower it to watch a new
    task's outputs closely; 0: never."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[metrics]`` (each sink checks its own options)."""
        out: list[ConfigError] = []
        if self.completions_every < 0:
            out.append(fail("metrics.completions_every", "must be >= 0", "use 0 to show none"))
        return out
