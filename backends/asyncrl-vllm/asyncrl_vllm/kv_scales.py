"""Map forwarded KV-cache scale names onto vLLM attention modules (pure logic, no torch).

Trainers name per-layer scales after the checkpoint (``model.layers.3.self_attn.k_scale``),
after vLLM's parameter (``model.layers.3.self_attn.attn.k_scale``) or after a projection
(``model.layers.3.self_attn.k_proj.k_scale``). vLLM's attention module for that layer is
``model.layers.3.self_attn.attn``. :func:`resolve_kv_scales` accepts all of these and refuses
anything it cannot place, so a misnamed scale is an error, not a silent 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["KINDS", "resolve_kv_scales"]

KINDS = ("k", "v", "q")
"""Scale kinds: the dequantisation multipliers of the cached keys, values and the query."""

_OWNER_SUFFIXES = (".attn", ".k_proj", ".v_proj", ".q_proj", ".qkv_proj")


def _layer_key(name: str) -> str:
    """``model.layers.3.self_attn.attn`` -> ``layers.3.self_attn``: the part both spellings
    share, without the ``model.`` prefix some exporters drop."""
    for suffix in _OWNER_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.removeprefix("model.")


def resolve_kv_scales(
    scales: Mapping[str, float], attention_modules: Iterable[str]
) -> dict[str, dict[str, float]]:
    """Group ``scales`` by attention module.

    Args:
        scales: ``{"<layer>.k_scale": 0.02, "<layer>.v_scale": 0.03, ...}``. Values must be
            finite and > 0.
        attention_modules: the engine's attention module names (``model.layers.0.self_attn.attn``).

    Returns:
        ``{module_name: {"k": 0.02, "v": 0.03}}`` (only the kinds given).

    Raises:
        ValueError: a name without a ``k_scale``/``v_scale``/``q_scale`` suffix, a name that
            matches no attention module, two names for the same scale, or a bad value.
    """
    by_key: dict[str, str] = {}
    for module in attention_modules:
        by_key[_layer_key(module)] = module
    out: dict[str, dict[str, float]] = {}
    unknown: list[str] = []
    for name, raw in scales.items():
        base, _, leaf = name.rpartition(".")
        kind = leaf.removesuffix("_scale") if leaf.endswith("_scale") else ""
        if kind not in KINDS or not base:
            raise ValueError(
                f"KV scale {name!r}: the name must end in .k_scale, .v_scale or .q_scale"
            )
        value = float(raw)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV scale {name!r}: must be finite and > 0, got {raw!r}")
        module = by_key.get(_layer_key(base))
        if module is None:
            unknown.append(name)
            continue
        slot = out.setdefault(module, {})
        if kind in slot:
            raise ValueError(f"KV scale {name!r}: {module} already has a {kind} scale")
        slot[kind] = value
    if unknown:
        known = ", ".join(sorted(by_key.values())[:4])
        raise ValueError(
            f"KV scales for unknown attention layers: {', '.join(sorted(unknown))} "
            f"(the engine's attention modules look like: {known}, ...)"
        )
    return out
