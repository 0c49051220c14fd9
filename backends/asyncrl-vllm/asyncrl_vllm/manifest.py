"""Check a refit's manifest against the checkpoint the engine was started from (no vLLM, no
torch: the controller-side check and unit tests import it without them).

The engine's own parameters are fused and renamed (``qkv_proj``, ``gate_up_proj``), so the
reference is the checkpoint itself: the names and shapes in the safetensors headers of
``model.path``. A refit must carry every checkpoint tensor, in the engine's dtype, with the
checkpoint's shape; a tied ``lm_head.weight`` may be left out (vLLM ties it itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.plugin.backend import read_safetensors_header

__all__ = ["bucket_entries", "checkpoint_shapes", "expected_problems", "manifest_problems"]

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Checkpoint tensors vLLM drops on load (nothing to refit)."""


def checkpoint_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """``{name: shape}`` of every tensor in the ``*.safetensors`` files of ``model_dir``,
    read from their headers (no tensor data is read).

    Raises:
        FileNotFoundError: the directory has no safetensors file.
        ValueError: a file is not safetensors (too short, a malformed header).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors file to check refits against")
    shapes: dict[str, list[int]] = {}
    for path in files:
        header, _ = read_safetensors_header(path)
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = [int(d) for d in info["shape"]]
    return shapes


def bucket_entries(bucket: Any) -> list[list[Any]]:
    """A bucket's entries as the worker extension takes them: ``[name, dtype, shape, offset,
    nbytes]`` each, plain lists (msgpack)."""
    return [[e.name, e.dtype, list(e.shape), int(e.offset), int(e.nbytes)] for e in bucket.entries]


def manifest_problems(
    manifest: Sequence[Any], shapes: dict[str, list[int]], *, dtype: str, tied: bool
) -> list[str]:
    """Everything wrong with ``manifest`` (entries with ``name``, ``dtype``, ``shape``) for an
    engine started from a checkpoint with ``shapes`` that serves ``dtype``; empty if it fits.
    At most a few problems of each kind are listed, with counts."""
    expected = {n: s for n, s in shapes.items() if not n.endswith(IGNORED_SUFFIXES)}
    optional = {"lm_head.weight"} if tied else set()
    return expected_problems(manifest, expected, dtype=dtype, optional=optional,
                             foreign="not in the engine's model")  # fmt: skip


def expected_problems(
    manifest: Sequence[Any], expected: dict[str, list[int]], *, dtype: str,
    optional: set[str] = frozenset(), foreign: str,  # type: ignore[assignment]
) -> list[str]:  # fmt: skip
    """What differs between ``manifest`` and the tensors ``expected`` (name: shape), each in
    ``dtype``: names not expected (listed as ``foreign``), wrong shapes, wrong dtypes, and
    expected names missing (but those in ``optional``). At most three of each kind are
    listed, with a count of the rest."""
    unknown, wrong_shape, wrong_dtype = [], [], []
    for e in manifest:
        want = expected.get(e.name)
        if want is None:
            unknown.append(e.name)
        elif list(e.shape) != want:
            wrong_shape.append(f"{e.name} {list(e.shape)} (engine: {want})")
        if e.dtype != dtype:
            wrong_dtype.append(f"{e.name} {e.dtype}")
    missing = sorted(set(expected) - {e.name for e in manifest} - optional)
    problems: list[str] = []
    for what, items in ((foreign, unknown), ("wrong shape", wrong_shape),
                        (f"not {dtype} (the engine's dtype)", wrong_dtype),
                        ("missing from the refit", missing)):  # fmt: skip
        if items:
            more = f" and {len(items) - 3} more" if len(items) > 3 else ""
            problems.append(f"{what}: {', '.join(items[:3])}{more}")
    return problems
