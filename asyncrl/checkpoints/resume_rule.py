"""The one rule for resuming with changed settings (docs/checkpointing.md, "Resuming with
changed settings").

A checkpoint means: these weights and optimizer state, trained from this model with this
tokenizer and chat template, by this optimizer and loss, on samples of this data drawn in
this order at this temperature, under this staleness policy, by this many trainer ranks. A
resumed run that changes any of it is refused, naming each field (``saved -> current``) and
the fix, unless the user names the field in ``--allow-changed`` (``Controller(...,
allow_changed=...)``). The settings in :data:`HARMLESS` (how the run is executed, observed and
saved) are only logged. **Everything else is strict**: a field added later is refused until
someone judges it harmless and lists it here. A service's section (``[gateway]``) is its
plugin's: the keys it names harmless are its section's ``HARMLESS``, and it is compared only
where the service is switched on (:func:`compare`).

What the config does not say is compared by content (:func:`fingerprints`, saved in each
manifest): the model directory's files (``model.config``, ``model.tokenizer``,
``model.weights``), the chat template's text (``model.chat_template``), the train split
(``environment.data``) and the reward code (``environment.code``: :func:`code_fingerprints`).
So ``model.path`` may move, and ``model.chat_template`` may point elsewhere, as long as what
they hold is the same. A checkpoint saved before the reward code was fingerprinted has no
``environment.code``: it resumes, its code not compared (:attr:`Changes.not_compared`).

File I/O only (no sockets, no torch).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec

from asyncrl.config import CORE_SECTIONS
from asyncrl.config.removed import REMOVED, Removed
from asyncrl.data.chat import ChatTemplate
from asyncrl.env.capabilities import rewards_of
from asyncrl.worker.export import WEIGHT_SUFFIXES

__all__ = [
    "ALL", "CODE", "FINGERPRINT_FIELDS", "HARMLESS", "Changes", "code_fingerprints", "compare",
    "fingerprints",
]  # fmt: skip

ALL = "all"
"""``--allow-changed all``: every change is accepted (and logged)."""

HARMLESS = (
    # how long, where to, how it is logged
    "run.name", "run.output_dir", "run.num_steps", "run.max_num_epochs", "run.log_format",
    # what is written of the trained samples (the files are cut back to the checkpoint's step)
    "run.save_samples",
    # where the model and the data are: what they hold is compared (fingerprints)
    "model.path", "environment.base_dir", "model.allow_moe_mismatch",
    # placement, time limits and capacities: the same computation, elsewhere or faster
    "cluster.rollout_ranks", "cluster.startup_timeout_s", "cluster.call_timeout_s",
    "cluster.shutdown_grace_s", "cluster.trainer_gpus",
    "cluster.rollout_gpus", "pipeline.min_groups_for_streaming_train",
    "pipeline.max_inflight_samples", "pipeline.max_buffered_groups", "trainer.micro_batch_size",
    # moving the same weights to the generators, and checking them
    "refit",
    # evaluation, saving, exporting, failure budgets, metrics
    "eval", "checkpoint", "export", "failures", "metrics",
)  # fmt: skip
"""Settings a resumed run may change freely (each change is logged); every other setting
must match the checkpoint's unless allowed. A prefix covers its whole section. A service's
section names its own (its ``HARMLESS``; :func:`asyncrl.config.service_sections.harmless_keys`).

A key that was removed (:data:`asyncrl.config.removed.REMOVED`: the tuning constants of issue
50; a service's section names its own, its ``REMOVED``) is not compared: a checkpoint that
stored one resumes, the key dropped; where its stored value differs from the one the code now
uses, the difference is listed with the harmless ones (logged), naming what replaced the
key."""

CODE = "environment.code"
"""The reward code's fingerprints (:func:`code_fingerprints`), by the name ``--allow-changed``
takes."""
_CODE_KEY = "code"

FINGERPRINT_FIELDS = (
    "model.config", "model.tokenizer", "model.chat_template", "model.weights", "environment.data",
    CODE,
)  # fmt: skip
"""What is compared by content, by the names ``--allow-changed`` takes."""

_TOKENIZER_NAMES = frozenset({
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
})  # fmt: skip
_TEMPLATE_FILES = frozenset({"chat_template.jinja", "chat_template.json"})
_WEIGHT_SAMPLE = 1 << 20


# --------------------------------------------------------------------------- fingerprints
def fingerprints(
    model_path: str,
    chat_template: str,
    train_prompts: Sequence[Any],
    code: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What the config does not say about a run, by content: ``{"model": {"config",
    "tokenizer", "weights": {file: digest}, "chat_template": digest}, "environment":
    {"data": digest, "code": code}}`` (``code``: :func:`code_fingerprints`, taken when the run
    started; ``None`` leaves it out, and a resume then does not compare it). Blocking (reads
    the model directory's small files whole, each weight file's size and first and last MiB,
    and every train prompt): run it in a worker thread."""
    files = _model_files(model_path)
    environment: dict[str, Any] = {"data": _data_digest(train_prompts)}
    if code is not None:
        environment[_CODE_KEY] = dict(code)
    return {
        "model": {**files, "chat_template": _template_digest(model_path, chat_template)},
        "environment": environment,
    }


_ENVIRONMENT_METHODS = ("score", "score_async", "run_episode")
_OWN_DIR = Path(__file__).resolve().parents[1]
"""asyncrl's own package directory: its files are not fingerprinted as reward code."""


def code_fingerprints(
    environment: Any, modules: Iterable[str] = (), *, name: str = "environment"
) -> dict[str, str]:
    """The code that scores a run, by content: ``{what: "<file> sha256 <hex>; ..."}``, for

    * each reward function of the environment (its ``rewards``,
      :class:`~asyncrl.environment.HasRewards`, as the ``dataset`` environment loads them from
      its ``rewards`` option; ``name``: the environment's in a message if they are of the wrong
      kind), keyed by its ``function`` string
      (``"my_rewards:exact"``, ``"rewards/math.py:exact"``): the file of the module that
      string names (imported by path or by import path) and, when the function is defined in
      another module (imported into it), that module's file too;
    * each module that makes the environment, keyed by the module's name: ``modules`` (the
      environment factory's module, as its entry point names it) and the modules defining
      the environment's class and its ``score``, ``score_async`` and ``run_episode``.

    What is hashed: the bytes of each whole source file (``inspect.getsourcefile``, else the
    module's ``__file__``), not the function's own lines, because a reward calls the helpers
    and constants of its module, and an edit to those changes the reward as much as one to
    the function; so an edit to a comment in that file counts as a change too (``--allow-
    changed environment.code`` accepts it). What those files import from other files is not
    followed. asyncrl's own files are left out (the built-in ``dataset`` environment's): they
    change with its version, which a resume does not compare either. Blocking (reads the
    files); call it when the run starts, just after the code was imported, so that an edit
    made while the run trains shows at the next resume."""
    out: dict[str, str] = {}
    for reward in rewards_of(environment, name):
        files = [reward.module_file, _source_file(reward.fn)]
        digest = _files_digest(files)
        if digest:
            out[reward.origin] = digest
    owners: list[tuple[str, str | None]] = []
    for name in modules:
        module = sys.modules.get(name)
        owners.append((name, getattr(module, "__file__", None)))
    cls = type(environment)
    owners.append((cls.__module__, _source_file(cls)))
    for method in _ENVIRONMENT_METHODS:
        fn = getattr(cls, method, None)
        if fn is not None:
            owners.append((getattr(fn, "__module__", None) or cls.__module__, _source_file(fn)))
    for name, file in owners:
        if name not in out and (digest := _files_digest([file])):
            out[name] = digest
    return out


def _source_file(obj: Any) -> str | None:
    """The file defining ``obj`` (a function, a method, a class; a callable instance: its
    class; a ``functools.partial``: its function), or ``None`` (a built-in)."""
    for candidate in (obj, type(obj)):
        try:
            candidate = inspect.unwrap(candidate)
            while isinstance(candidate, functools.partial):
                candidate = candidate.func
            return inspect.getsourcefile(candidate) or inspect.getfile(candidate)
        except (TypeError, ValueError):  # a built-in, or a __wrapped__ loop
            continue
    return None


def _files_digest(files: Iterable[str | None]) -> str:
    """``"<name> sha256 <hex>; ..."`` for each distinct file outside asyncrl (``""``: none).
    A file that cannot be read any more is named so (compared as such: it differs from any
    digest)."""
    parts: list[str] = []
    seen: set[Path] = set()
    for file in files:
        if not file:
            continue
        path = Path(file).resolve()
        if path in seen or path.is_relative_to(_OWN_DIR):
            continue
        seen.add(path)
        try:
            parts.append(f"{path.name} sha256 {_digest(str(path))}")
        except OSError as exc:
            parts.append(f"{path.name} unreadable ({exc.strerror or exc})")
    return "; ".join(parts)


def _model_files(model_path: str) -> dict[str, dict[str, str]]:
    """The top-level files of the model directory by kind (what ``from_pretrained``, the
    tokenizer and an export read): configs and code, tokenizer, weights. Chat template files
    are left to :func:`_template_digest`; documentation and hidden files are not compared."""
    groups: dict[str, dict[str, str]] = {"config": {}, "tokenizer": {}, "weights": {}}
    try:
        names = sorted(os.listdir(model_path))
    except OSError:
        return groups
    for name in names:
        path = os.path.join(model_path, name)
        if not os.path.isfile(path) or _ignored(name) or name in _TEMPLATE_FILES:
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            groups["weights"][name] = _sampled_digest(path)
        elif name.endswith(".index.json"):
            groups["weights"][name] = _digest(path)
        elif name == "tokenizer_config.json":  # its chat_template is compared as the template
            groups["tokenizer"][name] = _json_digest(path, drop="chat_template")
        elif name.startswith("tokenizer") or name in _TOKENIZER_NAMES or name.endswith(
            (".model", ".tiktoken")
        ):
            groups["tokenizer"][name] = _digest(path)
        else:
            groups["config"][name] = _digest(path)
    return groups


def _ignored(name: str) -> bool:
    upper = name.upper()
    return name.startswith(".") or name.endswith(".md") or upper.startswith(
        ("README", "LICENSE", "NOTICE", "USE_POLICY")
    )


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _json_digest(path: str, *, drop: str) -> str:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return _digest(path)
    if isinstance(data, dict):
        data.pop(drop, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _sampled_digest(path: str) -> str:
    """A weight file by its size and the SHA-256 of its first and last MiB (a safetensors
    file's header, with every tensor's name, dtype and shape, is at its start): constant
    cost, where hashing a 15 GB model whole would take ~9 s at 1.7 GB/s on every start. The
    checkpoint's trainer state replaces these weights on resume, so only *which* model it is
    matters here, not every byte."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_WEIGHT_SAMPLE))
        if size > 2 * _WEIGHT_SAMPLE:
            f.seek(size - _WEIGHT_SAMPLE)
        h.update(f.read(_WEIGHT_SAMPLE))
    return f"{size} bytes, sha256 of the first and last MiB {h.hexdigest()}"


def _template_digest(model_path: str, setting: str) -> str | None:
    template = ChatTemplate.from_model(model_path, setting)
    if template is None:
        return None
    return hashlib.sha256(template.source.encode()).hexdigest()


def _data_digest(prompts: Sequence[Any]) -> str:
    """The train split: its size and the SHA-256 of every prompt (id, text or messages,
    answer) in order."""
    h = hashlib.sha256()
    encoder = msgspec.json.Encoder(enc_hook=_plain, order="deterministic")
    it = iter(prompts)
    while chunk := list(itertools.islice(it, 4096)):
        h.update(encoder.encode(chunk))
    return f"{len(prompts)} prompts, sha256 {h.hexdigest()}"


def _plain(obj: Any) -> Any:
    """What msgspec cannot encode by itself, as something stable across processes (never
    an object's address)."""
    if hasattr(obj, "tolist"):  # a numpy array or scalar
        return obj.tolist()
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        return list(obj)
    if hasattr(obj, "__dict__"):
        return {"__type__": type(obj).__qualname__, **vars(obj)}
    return _ADDRESS.sub("", repr(obj))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# --------------------------------------------------------------------------- the rule
@dataclass
class Changes:
    """How a resumed run's settings differ from its checkpoint's, each as
    ``field: saved -> current``."""

    refused: list[str] = field(default_factory=list)
    """Strict settings that differ and were not allowed."""
    allowed: list[str] = field(default_factory=list)
    """Strict settings that differ, accepted by ``--allow-changed``."""
    harmless: list[str] = field(default_factory=list)
    """Settings in :data:`HARMLESS` (or a service's harmless keys) that differ."""
    names: list[str] = field(default_factory=list)
    """For the refusal's fix: what ``--allow-changed`` would need."""
    unknown: list[str] = field(default_factory=list)
    """Names given to ``--allow-changed`` that match no setting."""
    not_compared: list[str] = field(default_factory=list)
    """What could not be compared, and why (a checkpoint saved before the reward code was
    fingerprinted)."""


def compare(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    allow: Iterable[str] = (),
    harmless: Iterable[str] = (),
    removed: Mapping[str, Removed] = MappingProxyType({}),
) -> Changes:
    """Apply the rule to two ``{"config": ..., "fingerprints": ...}``: the checkpoint's and
    this run's. ``allow``: fields or sections (``loss``, ``grpo.temperature``,
    ``model.tokenizer``) whose changes are accepted, or ``all``. ``harmless``: the keys of
    this run's services' sections that are harmless as :data:`HARMLESS`'s are
    (:func:`asyncrl.config.service_sections.harmless_keys`). ``removed``: the keys they name
    removed, dropped as :data:`~asyncrl.config.removed.REMOVED`'s are
    (:func:`asyncrl.config.service_sections.removed_keys`).

    A service's section (a top-level table that is not the core's) means something only
    where the service runs: switched on at both sides, each of its keys is compared; on at
    one side only, its ``enabled`` alone (a table absent counts as off: the settings of a
    service that is off do nothing); on at neither, nothing. So a checkpoint of an older
    asyncrl, which stored a ``[gateway]`` switched off for every run, resumes in a run
    without the gateway installed. (A section compared key by key is that of a service on in
    this run, so loaded: its own ``removed`` keys are known.)"""
    allow = [a.strip() for a in allow if a.strip()]
    old, new = _compared(saved), _compared(current)
    named = {*old, *new}  # every setting either side has, a service's that is off included
    _services_compared(saved, current, old, new)
    harmless = (*HARMLESS, *harmless)
    changes = Changes()
    changes.harmless += _drop_removed({**REMOVED, **removed}, old, new)
    known = (ALL, *FINGERPRINT_FIELDS)  # a content name is known even when it has no leaf
    changes.unknown = [
        name for name in allow if name not in known and not any(_covers(name, k) for k in named)
    ]  # fmt: skip
    why = _code_not_compared(saved, current)
    if why:  # nothing to compare one side's code with: neither a change nor the same
        for leaves in (old, new):
            for key in [k for k in leaves if _covers(CODE, k)]:
                del leaves[key]
        changes.not_compared.append(f"{CODE}: {why}")
    fingerprinted = set(_leaves(saved.get("fingerprints") or {})) | set(
        _leaves(current.get("fingerprints") or {})
    )
    # the config's settings first, then what was compared by content
    for key in sorted(set(old) | set(new), key=lambda k: (k in fingerprinted, k)):
        was, now = old.get(key, "(unset)"), new.get(key, "(unset)")
        if was == now:
            continue
        line = f"{key}: {_show(was)} -> {_show(now)}"
        if any(_covers(h, key) for h in harmless):
            changes.harmless.append(line)
        elif ALL in allow or any(_covers(name, key) for name in allow):
            changes.allowed.append(line)
        else:
            changes.refused.append(line)
            name = next((f for f in FINGERPRINT_FIELDS if _covers(f, key)), key)
            if name not in changes.names:
                changes.names.append(name)
    setting = (_setting(saved), _setting(current))
    if setting[0] != setting[1] and old.get("model.chat_template") == new.get(
        "model.chat_template"
    ):
        changes.harmless.append(f"model.chat_template: {setting[0]!r} -> {setting[1]!r} "
                                "(the same template text)")  # fmt: skip
    return changes


def _code_not_compared(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """Why the reward code cannot be compared (``""``: it can)."""
    has = [_CODE_KEY in ((side.get("fingerprints") or {}).get("environment") or {})
           for side in (saved, current)]  # fmt: skip
    if not has[1]:  # an embedding caller that gave no code fingerprints
        return "this run's reward code was not fingerprinted, so it is not compared"
    if not has[0]:
        return ("the checkpoint holds no fingerprint of the reward code (an asyncrl from before "
                "they were saved wrote it), so an edited reward function or environment "
                "module cannot be noticed on this resume; the checkpoints this run saves "
                "record it")
    return ""


def _drop_removed(removed: Mapping[str, Removed], *sides: dict[str, Any]) -> list[str]:
    """Remove the keys that are no longer settings (``removed``: the core's and this run's
    services', :mod:`asyncrl.config.removed`) from the compared leaves of each side; returns
    ``key: stored -> now (removed: ...)`` for each one a side stored with another value than
    the code now uses."""
    lines: list[str] = []
    for leaves in sides:
        for key in [k for k in leaves if k in removed]:
            stored, now = leaves.pop(key), removed[key].default
            if stored != now:
                lines.append(f"{key}: {_show(stored)} -> {_show(now)} (removed: "
                             f"{removed[key].now})")  # fmt: skip
    return lines


def _services_compared(
    saved: Mapping[str, Any], current: Mapping[str, Any], *leaves: dict[str, Any]
) -> None:
    """Keep in ``leaves`` (the checkpoint's compared leaves, this run's) what :func:`compare`
    compares of each service's section: all of it where the service is on at both sides,
    its ``enabled`` (``False`` where the table is absent) where it is on at one, nothing
    where it is on at neither."""
    configs = [side.get("config") or {} for side in (saved, current)]
    for name in sorted({*configs[0], *configs[1]} - set(CORE_SECTIONS)):
        on = [_enabled(config.get(name)) for config in configs]
        if all(on):
            continue
        for side, enabled in zip(leaves, on, strict=True):
            for key in [k for k in side if _covers(name, k)]:
                del side[key]
            if any(on):
                side[f"{name}.enabled"] = enabled


def _enabled(table: Any) -> bool:
    return isinstance(table, Mapping) and table.get("enabled") is True


def _covers(name: str, key: str) -> bool:
    return key == name or key.startswith(name + ".")


def _compared(side: Mapping[str, Any]) -> dict[str, Any]:
    """The leaves compared: the config's (but the chat template's setting, whose text is
    compared instead) and the fingerprints'."""
    leaves = _leaves(side.get("config") or {})
    leaves.pop("model.chat_template", None)
    for key, value in _leaves(side.get("fingerprints") or {}).items():
        leaves[key] = value
    return leaves


def _setting(side: Mapping[str, Any]) -> Any:
    return (side.get("config") or {}).get("model", {}).get("chat_template")


def _show(value: Any) -> str:
    """A value for a message: digests shortened to their first 12 hex digits."""
    if not isinstance(value, str):
        return repr(value)
    if _DIGEST.fullmatch(value):
        return f"sha256 {value[:12]}..."
    return repr(_DIGEST.sub(lambda m: m.group()[:12] + "...", value))


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every value that is not a table; an empty table has none (so
    ``{}`` -> ``{"lr": 1e-4}`` is the one change ``trainer.options.lr``)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}
