"""Config keys that existed once, and what replaced them: a config that still sets one gets a
:class:`~asyncrl.errors.ConfigError` that says so (:func:`refuse_removed`, run by the loader
before the typed struct is built), and a checkpoint whose stored config holds one still resumes
(:mod:`asyncrl.checkpoints.resume_rule` drops it, comparing its value with :attr:`Removed.default`).

Issue 50 cut the reference (docs/configuration.md) to the keys a user decides with: the
tuning constants became module constants next to the code that uses them, each with the
measurement or reason that chose its value. The constants are named here as text (importing
their modules would pull the controller or the torch side into the config);
tests/unit/test_config.py checks each against its module.

:data:`REMOVED` holds the core's sections' keys alone. A service's section names its own
removed keys (its ``REMOVED``, :class:`asyncrl.config.service_sections.NamesRemoved`, of the
same :class:`Removed` entries): the loader refuses them and the resume rule drops them the same
way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as fail

__all__ = [
    "REMOVED", "Removed", "became_constant", "message", "refuse_removed", "removed_in",
    "without_removed",
]  # fmt: skip


@dataclass(frozen=True)
class Removed:
    """One removed key."""

    default: Any
    """Its default when it was a key, which the code has used since (a checkpoint that
    stored another value resumes with this one, logged)."""
    now: str
    """What replaced it: the constant (``module.NAME``), or what the code does instead."""
    why: str = ""
    """Why it is no longer a key, or what to do instead (when ``now`` does not say)."""
    constant: str = ""
    """The constant's dotted path, when it is one whose value is :attr:`default` (checked by
    the tests)."""


def became_constant(path: str, default: Any, why: str = "") -> Removed:
    """A key that became the module constant ``path`` (``module.NAME``), whose value is its
    last ``default``: what replaced it says so, and the tests check the constant holds it."""
    return Removed(default, f"the constant {path} = {default!r}", why, constant=path)


_TUNING = "a tuning constant nobody needed to change"

REMOVED: dict[str, Removed] = {
    # -- before issue 50
    "refit.verify_tolerance_fp8_kv": Removed(
        0.2,
        "refit verification measures the two sides' disagreement before the first update, "
        "the FP8 KV cache's included, and judges refits by it (docs/refit.md)",
        "the margin is asyncrl.policy.verify.NOISE_FACTOR",
    ),
    # -- issue 50: [run]
    "run.stall_warning_s": became_constant("asyncrl.obs.watchdog.STALL_WARNING_S", 10.0, _TUNING),
    "run.gc_freeze": became_constant("asyncrl.obs.collector.GC_FREEZE", True, _TUNING),
    "run.gc_young_interval_s": became_constant(
        "asyncrl.obs.collector.GC_YOUNG_INTERVAL_S", 0.05, _TUNING
    ),
    "run.gc_full_interval_s": became_constant(
        "asyncrl.obs.collector.GC_FULL_INTERVAL_S", 60.0, _TUNING
    ),
    "run.samples_file_mb": became_constant(
        "asyncrl.obs.sample_export.SAMPLES_FILE_MB", 256.0, _TUNING
    ),
    "run.event_loop": became_constant(
        "asyncrl.launch.EVENT_LOOP", "auto", "uvloop where it is installed, else asyncio's"
    ),
    # -- [cluster]
    "cluster.torchrun": Removed(
        "torchrun",
        "the constant asyncrl.procs.spawn.TORCHRUN: this interpreter's "
        "`python -m torch.distributed.run`, what the default meant",
        "worker groups run with the controller's own Python whatever PATH says",
    ),
    # -- [grpo]
    "grpo.dynamic_sampling_min_std": became_constant(
        "asyncrl.config.modes.DYNAMIC_SAMPLING_MIN_STD", 0.0,
        "dynamic sampling drops the groups whose rewards are all equal, as DAPO does",
    ),
    "grpo.dynamic_sampling_max_drops": Removed(
        0,
        "4 x grpo.prompts_per_step, what 0 meant "
        "(asyncrl.config.modes.DYNAMIC_SAMPLING_DROPS_PER_PROMPT = 4)",
        _TUNING,
    ),
    # -- [refit]
    "refit.staging_buffers": became_constant("asyncrl.transfers.STAGING_BUFFERS", 2, _TUNING),
    "refit.drain_timeout_s": became_constant(
        "asyncrl.config.engines.DRAIN_TIMEOUT_S", 60.0, _TUNING
    ),
    "refit.verify_noise_factor": became_constant(
        "asyncrl.policy.verify.NOISE_FACTOR", 3.0, _TUNING
    ),
    "refit.verify_noise_floor": became_constant(
        "asyncrl.policy.verify.NOISE_FLOOR", 0.001, _TUNING
    ),
    "refit.verify_max_noise": became_constant(
        "asyncrl.policy.verify.MAX_NOISE", 0.5,
        "to skip the check for a model whose two sides disagree more, set "
        "refit.verify_every_steps = 0",
    ),
    "refit.verify_tolerance": became_constant("asyncrl.policy.verify.TOLERANCE", None, _TUNING),
    "refit.verify_num_sequences": became_constant(
        "asyncrl.policy.verify.PROBE_SEQUENCES", 16, _TUNING
    ),
    "refit.kv_calibration_sequences": became_constant(
        "asyncrl.run.refit.KV_CALIBRATION_SEQUENCES", 64, _TUNING
    ),
    "refit.kv_calibration_percentile": became_constant(
        "asyncrl.run.refit.KV_CALIBRATION_PERCENTILE", 99.9, _TUNING
    ),
    "refit.kv_calibration_margin": became_constant(
        "asyncrl.run.refit.KV_CALIBRATION_MARGIN", 1.05, _TUNING
    ),
    "refit.verify_first_steps": became_constant(
        "asyncrl.policy.verify.VERIFY_FIRST_STEPS", 3,
        "refit.verify_every_steps = 0 turns verification off, the first refits' included",
    ),
    "refit.kv_calibrate_q": Removed(
        False,
        "query scales are calibrated exactly when a generator reports the capability "
        "kv_quantized_query (vLLM's FlashAttention 3 with an FP8 KV cache does)",
        "an engine that quantizes the query without reporting it is its plugin's bug: report it",
    ),
    # -- [checkpoint], [failures], [metrics], [episode]
    "checkpoint.max_failures": became_constant(
        "asyncrl.checkpoints.saving.MAX_SAVE_FAILURES", 3, _TUNING
    ),
    "failures.retry_backoff_s": became_constant(
        "asyncrl.policy.failures.RETRY_BACKOFF_S", 1.0, _TUNING
    ),
    "failures.train_step_retries": became_constant(
        "asyncrl.policy.failures.TRAIN_STEP_RETRIES", 1, _TUNING
    ),
    "failures.heartbeat_interval_s": Removed(
        5.0,
        "derived from failures.heartbeat_timeout_s: a twelfth of it, 5 s at most "
        "(asyncrl.config.operations.PROBES_PER_TIMEOUT = 12, HEARTBEAT_INTERVAL_S = 5.0)",
        "set heartbeat_timeout_s alone",
        constant="asyncrl.config.operations.HEARTBEAT_INTERVAL_S",
    ),
    "metrics.completions_count": became_constant(
        "asyncrl.obs.console.COMPLETIONS_SHOWN", 3, _TUNING
    ),
    "metrics.progress": Removed(
        "auto", "the progress bar shows on an interactive terminal only (what 'auto' did)",
        "plain logs stay free of it",
    ),
    "episode.max_concurrent_tools": became_constant(
        "asyncrl.run.episodes.TOOL_CONCURRENCY", 64, _TUNING
    ),
    "episode.on_template_mismatch": Removed(
        "split",
        "an episode the chat template does not re-render is always split into several "
        "samples, and the split logged: an episode_split warning naming the turn and the "
        "first difference (the first asyncrl.run.episodes.SPLITS_LOGGED = 10 of a run)",
        "that log says why a template does not re-render what was recorded, what 'refuse' was for",
    ),
}  # fmt: skip
"""Every removed key (``section.key``) and what replaced it."""


def message(key: str, entry: Removed | None = None) -> str:
    """What an error says of removed ``key`` (``section.key``; ``entry`` its :class:`Removed`,
    :data:`REMOVED`'s by default): ``<key>: removed: ... Fix: ...``."""
    entry = REMOVED[key] if entry is None else entry
    why = f" ({entry.why})" if entry.why else ""
    fix = "remove it from the config (docs/configuration.md lists the keys)"
    return str(fail(key, f"removed: {entry.now}{why}", fix))


def removed_in(data: Mapping[str, Any], removed: Mapping[str, Removed] = REMOVED) -> list[str]:
    """The keys of ``removed`` (``section.key``: :data:`REMOVED`, or a service's) that
    ``data`` (a config as plain tables, e.g. parsed TOML) sets, in the order of ``removed``."""
    found = []
    for key in removed:
        section, _, name = key.partition(".")
        table = data.get(section)
        if isinstance(table, Mapping) and name in table:
            found.append(key)
    return found


def refuse_removed(data: Mapping[str, Any], removed: Mapping[str, Removed] = REMOVED) -> None:
    """Raise when ``data`` sets a key of ``removed`` (:data:`REMOVED` by default; the loader
    passes the services' sections' as well).

    Raises:
        ConfigError: naming each removed key it sets, what replaced it and the fix.
    """
    found = removed_in(data, removed)
    if found:
        raise ConfigError("\n".join(message(key, removed[key]) for key in found))


def without_removed(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config as plain tables) without the removed keys it sets: a config a run of
    an older asyncrl recorded, read by this one (``asyncrl plot``)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for key in removed_in(data):
        section, _, name = key.partition(".")
        del out[section][name]
    return out
