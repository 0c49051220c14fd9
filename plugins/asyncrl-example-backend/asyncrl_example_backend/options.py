"""The backend's options: ``[generator.options]`` and ``[trainer.options]``.

asyncrl keeps plugin options as an opaque table; the plugin converts it to its own struct,
rejecting unknown fields, and raises :class:`~asyncrl.plugin.common.ConfigError` naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from asyncrl.plugin.common import ConfigError, explain

__all__ = ["GeneratorOptions", "TrainerOptions", "mark_phase", "parse_options"]


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class GeneratorOptions(_Options):
    """``[generator.options]`` of the ``bigram`` generation backend."""

    token_delay_s: float = 0.0
    """Testing knob: the engine's step, in seconds: every sample in flight makes one token a
    step (as an LLM engine's decode step), to make generation slow enough that tests can
    observe overlap, refit during generation and cancellation."""
    fail_at_start: bool = False
    """Testing knob: raise in ``start()``, to test start-up failure handling."""
    crash_after_groups: int = 0
    """Testing knob: SIGKILL this worker's own process once it has finished this many
    prompt groups (eval groups included); 0 never does. Tests a worker dying mid-run."""
    close_delay_s: float = 0.0
    """Testing knob: sleep this long in ``close()``, as an engine that is slow to shut down
    (vLLM takes 5-10 s on a small CPU host)."""
    load_delay_s: float = 0.0
    """Testing knob: sleep this long in every ``load_weight_bucket``, to make refits slow
    enough that tests can strike during one."""
    phase_marker_dir: str = ""
    """Testing knob: create ``<dir>/rollout-<rank>.<phase>`` when the first ``generate``
    (phase ``generate``) and the first refit (``refit``) begin."""
    stale_from_version: int = 0
    """Testing knob: from this weight version on, acknowledge every refit but keep serving
    the weights it had (a generator that silently misses an update, as a stale kernel cache
    would); 0 never does. Tests refit verification."""
    fail_groups: list[str] = []
    """Testing knob: ``generate()`` of these group ids emits sample 0, then raises a
    ``RuntimeError`` (an engine failure), the first ``fail_times`` times on this engine."""
    fail_times: int = 1
    """Testing knob: see ``fail_groups`` (a large number: the group always fails)."""
    request_error_token: int = -1
    """Testing knob: ``generate()`` of a prompt holding this token id raises
    ``asyncrl.plugin.backend.RequestError`` (the request's own data is at fault); -1 never does."""
    max_concurrent_samples: int = 0
    """Samples this engine generates at once (its batch slots, as vLLM's ``max_num_seqs``);
    the others wait for a free slot. 0 = no limit."""
    length_median: float = 0.0
    """Workload knob: when > 0, each sample's length is drawn from a log-normal distribution
    with this median (tokens, at least 1, at most ``max_tokens``) and EOS is ignored until
    then. With ``token_delay_s`` a sample takes the time its length implies."""
    length_sigma: float = 1.0
    """Workload knob: the log-normal's sigma; 1.0 puts the 99th percentile at about 10x the
    median (exp(2.326 * sigma))."""


class TrainerOptions(_Options):
    """``[trainer.options]`` of the ``bigram`` training backend."""

    lr: float = 0.5
    """Learning rate (constant)."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """``sgd`` (no momentum): the update is ``-lr * g``, easy to check by hand. ``adam``:
    bias-corrected Adam with ``betas`` and ``eps``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    max_grad_norm: float = 1.0
    """Clip the gradient's 2-norm to this value (as torch's ``clip_grad_norm_``); 0 disables
    clipping. The reported ``grad_norm`` is the norm before clipping."""
    step_delay_s: float = 0.0
    """Testing knob: sleep this long in every ``finish_step``, to make training slow enough
    that tests can observe generation overlapping it."""
    sequence_delay_s: float = 0.0
    """Workload knob: sleep this long per sequence of every ``train_chunk`` (training time
    proportional to the data, as a real trainer's)."""
    phase_marker_dir: str = ""
    """Testing knob: create ``<dir>/trainer-<rank>.<phase>`` when the first step (phase
    ``train``) and the first weight export (``refit``) begin."""
    fail_at_start: bool = False
    """Testing knob: raise in ``start()``, to test start-up failure handling."""
    fail_chunk_at_step: int = -1
    """Testing knob: ``train_chunk`` of this step raises a ``RuntimeError`` (as an out of
    memory would) the first ``fail_chunk_times`` times; -1 never does."""
    fail_chunk_times: int = 1
    """Testing knob: see ``fail_chunk_at_step``."""
    nan_grad_at_steps: list[int] = []
    """Testing knob: the gradient of these steps is NaN, as an overflow in a backward pass
    would make it; ``finish_step`` then reports a NaN grad norm and, as every trainer must,
    leaves the weights as they were."""
    batch_record_dir: str = ""
    """Testing knob: append every batch ``train_chunk`` trains to
    ``<dir>/trainer-<rank>.jsonl``, one JSON line per chunk as this rank got it (``step``,
    ``tokens``, ``seq_lens``, ``prompt_lens``, ``loss_mask``, ``behaviour_logprobs``,
    ``advantages``): the trainer's side, for tests that compare the run's record of what it
    trained (``run.save_samples``) with what it did."""


O = TypeVar("O", bound=_Options)


def parse_options(raw: dict[str, Any], cls: type[O], table: str) -> O:
    """Convert ``raw`` (the config's options table named ``table``) into ``cls``.

    Raises:
        ConfigError: an unknown field, a wrong type or an out-of-range value, named as
            ``<table>.<field>``.
    """
    try:
        opts = msgspec.convert(dict(raw), cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, cls, table) + " (bigram backend)") from None
    for name in (
        "token_delay_s", "step_delay_s", "crash_after_groups", "max_grad_norm",
        "stale_from_version", "load_delay_s", "close_delay_s", "max_concurrent_samples",
        "length_median", "sequence_delay_s", "fail_times", "fail_chunk_times",
    ):
        value = getattr(opts, name, 0)
        if value < 0:
            raise ConfigError(f"{table}.{name}: must be >= 0, got {value}")
    if isinstance(opts, TrainerOptions):
        if not opts.lr > 0:
            raise ConfigError(f"{table}.lr: must be > 0, got {opts.lr}")
        if not all(0 <= b < 1 for b in opts.betas):
            raise ConfigError(f"{table}.betas: both must lie in [0, 1), got {list(opts.betas)}")
    if isinstance(opts, GeneratorOptions) and not opts.length_sigma > 0:
        raise ConfigError(f"{table}.length_sigma: must be > 0, got {opts.length_sigma}")
    return opts


def mark_phase(directory: str, ctx: Any, phase: str) -> None:
    """Testing knob (``phase_marker_dir``): create ``<directory>/<group>-<rank>.<phase>``, holding
    this process's pid, the first time a phase begins, so a fault test can strike in it."""
    if directory:
        path = Path(directory) / f"{ctx.group}-{ctx.rank}.{phase}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(os.getpid()))
