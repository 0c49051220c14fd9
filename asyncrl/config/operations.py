"""``[eval]``, ``[checkpoint]``, ``[export]``, ``[failures]`` and ``[metrics]``: what a run
measures, keeps and writes, and what it tolerates.

Each section's checks sit with it; :func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncrl.config.section import Section, fail, not_negative
from asyncrl.errors import ConfigError

__all__ = ["CheckpointConfig", "EvalConfig", "ExportConfig", "FailuresConfig", "MetricsConfig"]


class EvalConfig(Section):
    num_prompts: int = 0
    """Held-out prompts scored greedily (0 = no evaluation)."""
    at_start: bool = True
    """Evaluate the starting policy before the first step."""
    at_end: bool = True
    """Evaluate the final policy after the last refit."""
    every_steps: int = 0
    """Also evaluate every this many steps, on the same engines while training goes on (the
    next refit waits for it); the best result goes to ``<checkpoint.dir>/best.json``."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[eval]``."""
        out = not_negative({"eval.every_steps": self.every_steps})
        if self.num_prompts < 0:
            out.append(fail("eval.num_prompts", "must be >= 0", "use 0 to disable evaluation"))
        return out


class CheckpointConfig(Section):
    dir: str = ""
    """Where checkpoints go (``""``: ``<run.output_dir>/checkpoints``; relative to the config
    file). Every rank must see it (one host, or a shared file system)."""
    every_steps: int = 0
    """Save after every this many optimizer steps (0: only at the end and on demand): the
    trainer's and the controller's whole state (docs/checkpointing.md). Generation goes on."""
    at_end: bool = True
    """Save after the last step (to export it, or to resume with a larger run.num_steps)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints, and the best one (``best.json``); older ones
    are deleted once a save succeeded."""
    save_model: bool = True
    """Also write the policy as a Hugging Face directory (``model/``, ``model.dtype`` bytes a
    parameter) into each checkpoint: ``asyncrl export`` needs no trainer."""
    max_failures: int = 3
    """Failed periodic saves in a row that stop the run (an I/O error, a trainer that cannot
    write): the run goes on after fewer, and the ``max_failures``-th stops it (0 and 1: the
    first), as does a failed final save, or a full disk at once. A failed save leaves the
    previous checkpoint as it was."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[checkpoint]``."""
        out = not_negative({
            "checkpoint.every_steps": self.every_steps,
            "checkpoint.max_failures": self.max_failures,
        })  # fmt: skip
        if self.keep_last < 1:
            out.append(fail("checkpoint.keep_last", "must be >= 1", "keep at least 1"))
        return out


class ExportConfig(Section):
    dir: str = ""
    """Where exported models go (``""``: ``<run.output_dir>/hf``): ``final/``, ``step-<N>/``."""
    at_end: bool = True
    """Export the final policy."""
    every_steps: int = 0
    """Also export every this many optimizer steps (0: never)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[export]``."""
        return not_negative({"export.every_steps": self.every_steps})


class FailuresConfig(Section):
    generation_retries: int = 3
    """Times a group whose generation failed in the engine is dispatched again (same prompt,
    same step) after a back-off; then it is dropped. A request its own data makes unservable
    (``RequestError``: a prompt longer than the context...) is dropped at once."""
    retry_backoff_s: float = 1.0
    """Wait before the first retry of a group; doubled for each further one."""
    max_failed_groups: int = 16
    """Groups dropped for good that the run tolerates; one more stops it with the last error.
    A dropped group's step gets a fresh prompt; the ledger counts it as ``failed``."""
    on_reward_error: Literal["fail_run", "drop_group"] = "fail_run"
    """``score()`` raised, returned a non-finite reward or ran past ``reward_timeout_s``:
    ``fail_run`` stops the run naming the prompt, the completion and the error; ``drop_group``
    logs them and drops the group."""
    reward_timeout_s: float = 60.0
    """Deadline of each reward call: an environment's ``score()`` (per completion) or
    ``score_async()``, and so each reward function of the ``dataset`` environment. A call past
    it fails its group under ``on_reward_error``, naming the function, the prompt and the
    deadline; an async call is cancelled, a sync one's thread abandoned (it cannot be stopped;
    at most 16 such threads may still be running, then the run stops)."""
    train_step_retries: int = 1
    """Times a step whose train call raised on a trainer rank (out of memory in one
    micro-batch...; the trainer drops the step's gradients) is trained again from the same
    groups; then the run stops. A trainer that died or hung is not retried."""
    max_nonfinite_steps: int = 0
    """Steps whose loss or gradient norm is not finite (NaN or infinite) that the run skips:
    the trainer never applies such a step (the weights stay as they were) and its groups are
    used up. One more stops the run, naming the likely cause (the step's rewards and
    advantages, or the weights). ``0``: the first stops it. Counted from the start of the
    process (a resumed run counts afresh)."""
    rollout_restarts: int = 3
    """Times in a run a rollout worker that died (its process, or its engine) is started
    again in place: its groups go to the other workers meanwhile (or wait for it), and it is
    refitted before it gets new ones. One more death stops the run. ``0``: the first death
    stops it. On another node its rank restarts it there; one found silent (its node gone or
    cut off) is restarted only if its new process connects within ``heartbeat_timeout_s``
    more. With ``refit.transport = "nccl"`` a death in the middle of a refit fails that
    refit for every generator (one broadcast group): it is done again without the dead one."""
    heartbeat_interval_s: float = 5.0
    """Every worker is sent a health probe this often; its event loop answers it at once,
    whatever call it is serving."""
    heartbeat_timeout_s: float = 60.0
    """A worker that answers no probe for this long while its process lives (stopped,
    deadlocked, its loop blocked) is hung: it is named (group, rank, last answer, log file)
    and handled as a death, so a rollout worker is restarted under ``rollout_restarts`` and a
    trainer stops the run. Each worker likewise stops once it heard nothing from the
    controller for ``heartbeat_interval_s`` + this long (stopped, its loop blocked, its host
    gone), time its own loop did not run not counted. ``0``: no heartbeat."""
    collective_timeout_s: float | None = None
    """A trainer rank whose torch collective waits longer than this (a rank stuck in its
    compute or gone, ranks out of step) fails the call with a ``CollectiveTimeoutError``, and
    the run stops naming the rank: its event loop still answers the heartbeat, so nothing
    else would see it before ``cluster.call_timeout_s``. Set on the trainer's process group
    once the backend started (loading the model may keep ranks apart longer). ``None``: the
    heartbeat's timeout (``0``: torch's defaults, 10 min on NCCL, 30 min on gloo). Raise it
    when ranks legitimately wait long on each other (checkpoints written to a slow shared
    file system)."""

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
        if timeout and not 0 < self.heartbeat_interval_s < timeout:
            out.append(fail(
                "failures.heartbeat_interval_s",
                f"must be > 0 and below heartbeat_timeout_s ({timeout})",
                "use e.g. 5 (a few probes fit in the timeout)",
            ))  # fmt: skip
        if not 0 <= timeout < float("inf"):
            out.append(fail("failures.heartbeat_timeout_s", "must be >= 0 and finite",
                            "use e.g. 60, or 0 to turn the heartbeat off"))  # fmt: skip
        collective = self.collective_timeout_s
        if collective is not None and not 0 <= collective < float("inf"):
            out.append(fail("failures.collective_timeout_s", "must be >= 0 and finite",
                            "use e.g. 60, or leave it out (the heartbeat's timeout)"))  # fmt: skip
        counts = (
            "generation_retries", "max_failed_groups", "train_step_retries", "retry_backoff_s",
            "rollout_restarts", "max_nonfinite_steps",
        )  # fmt: skip
        return out + not_negative({f"failures.{k}": getattr(self, k) for k in counts})


class MetricsConfig(Section):
    sinks: list[str] = msgspec.field(default_factory=lambda: ["jsonl"])
    """Where step, evaluation and completion records go (entry point group
    ``asyncrl.metrics_sinks``): ``jsonl`` (``<run.output_dir>/metrics.jsonl``, always written:
    ``asyncrl plot`` and ``--resume`` read it), ``tensorboard``, ``wandb``, ``mlflow``, or a
    plugin's name; several at once. Each gets the run's resolved config first."""
    options: dict[str, dict[str, Any]] = {}
    """Per-sink options, by sink name (``[metrics.options.wandb] project = "x"``), validated
    by the sink before any process starts."""
    progress: Literal["auto", "on", "off"] = "auto"
    """A one-line progress bar (step, reward, accuracy, staleness, tokens/s, ETA) on stderr:
    ``auto`` shows it only on an interactive terminal, so logs stay clean."""
    completions_every: int = 10
    """Every this many steps, a few of the step's completions with their rewards are printed
    and sent to the sinks as a table (``completions`` records). 0: never."""
    completions_count: int = 3
    """Completions shown each time (one per group, the first groups of the step)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[metrics]`` (each sink checks its own options)."""
        out: list[ConfigError] = []
        if self.completions_every < 0:
            out.append(fail("metrics.completions_every", "must be >= 0", "use 0 to show none"))
        if self.completions_every and self.completions_count < 1:
            out.append(
                fail(
                    "metrics.completions_count",
                    "must be >= 1 when metrics.completions_every is set, got "
                    f"{self.completions_count}",
                    "use e.g. 3, or set metrics.completions_every = 0",
                )
            )
        return out
