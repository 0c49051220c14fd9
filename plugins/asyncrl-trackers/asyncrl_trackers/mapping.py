"""What experiment trackers show of a ``metrics.jsonl`` record (pure: no tracker imported).

=============== ============================================= ===============================
record kind     tracked as                                    at step
=============== ============================================= ===============================
``train``       scalars ``train/<key>``: every number (bools  ``step``
                as 0/1); dicts, lists, strings, ``None`` and
                absolute clock readings (``t``, ``time``,
                ``start``, ``end``, ``*_start``, ``*_end``) are
                left out
``eval``        scalars ``eval/<key>`` (``accuracy``,         ``version`` (the weights'
                ``seconds``, ``num_prompts``): one curve over  version, comparable with
                every evaluation, whatever its ``label``      ``train`` steps)
``completions`` a table: one row per completion, the columns  ``step``
                the rows' keys in first-seen order
=============== ============================================= ===============================

Other kinds (``checkpoint``, ``resume``, ``ledger``...) stay in ``metrics.jsonl`` only.
Eval labels are ``start``, ``end`` and ``step-<N>``: one curve per label would be a single
point each, so the label is not part of the name.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "Scalars",
    "Table",
    "config_params",
    "config_text",
    "is_clock_reading",
    "markdown_table",
    "scalars",
    "table",
]

_CLOCK_KEYS = frozenset({"t", "time", "start", "end"})


class Scalars(NamedTuple):
    step: int
    values: dict[str, float]
    """Tracker names (``train/reward``) to values, in the record's key order."""


class Table(NamedTuple):
    step: int
    columns: list[str]
    rows: list[list[Any]]
    """One list per row, aligned with ``columns``: strings, numbers, bools or ``None`` (any
    other value as its JSON text)."""


def is_clock_reading(key: str) -> bool:
    """True for the absolute clock readings of a record (``t``, ``time``, ``start``, ``end``,
    ``gen_start``, ``train_end``...): points on the run's timeline, not quantities to plot
    over steps."""
    return key in _CLOCK_KEYS or key.endswith(("_start", "_end"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    return None


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def scalars(record: Mapping[str, Any]) -> Scalars | None:
    """The scalars of a ``train`` or ``eval`` record (see the table above); ``None`` for any
    other kind, or when the record has no integer step (``step`` / ``version``)."""
    kind = record.get("kind")
    if kind == "train":
        prefix, step, skip = "train/", _step(record.get("step")), {"kind", "step"}
    elif kind == "eval":
        prefix, step, skip = "eval/", _step(record.get("version")), {"kind", "version"}
    else:
        return None
    if step is None:
        return None
    values: dict[str, float] = {}
    for key, value in record.items():
        if key in skip or is_clock_reading(key):
            continue
        number = _number(value)
        if number is not None:
            values[prefix + key] = number
    return Scalars(step, values)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, sort_keys=True)


def table(record: Mapping[str, Any]) -> Table | None:
    """The table of a ``completions`` record (``{"kind": "completions", "step": N, "rows":
    [{"prompt": ..., "completion": ..., "reward": ..., "correct": ...}, ...]}``); ``None`` for
    any other kind, a record without an integer ``step`` or without rows. A row missing a
    column has ``None`` there."""
    if record.get("kind") != "completions":
        return None
    step = _step(record.get("step"))
    rows = [r for r in record.get("rows") or () if isinstance(r, Mapping)]
    if step is None or not rows:
        return None
    columns: list[str] = []
    for row in rows:
        columns += [str(k) for k in row if str(k) not in columns]
    return Table(step, columns, [[_cell(row.get(c)) for c in columns] for row in rows])


def _md_cell(value: Any) -> str:
    text = "" if value is None else str(value)
    # HTML-escaped (completions hold tags such as <think> that a renderer would swallow),
    # pipes escaped, line breaks kept visible
    text = html.escape(text, quote=False).replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(tab: Table) -> str:
    """``tab`` as a GitHub-flavoured markdown table (TensorBoard's text tab renders it)."""
    lines = [
        "| " + " | ".join(_md_cell(c) for c in tab.columns) + " |",
        "|" + "---|" * len(tab.columns),
    ]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in tab.rows]
    return "\n".join(lines)


def config_text(config: Mapping[str, Any]) -> str:
    """The resolved config as indented JSON (sorted keys) in a fenced markdown block."""
    return "```json\n" + json.dumps(config, indent=2, sort_keys=True, default=str) + "\n```"


def config_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config flattened to ``section.key`` -> text (for trackers whose parameters are
    flat strings): nested tables are walked; every other value is its JSON text, except
    strings, which are kept as they are. An empty table is ``{}``."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(config_params(value, name + "."))
        elif isinstance(value, str):
            out[name] = value
        else:
            out[name] = json.dumps(value, sort_keys=True, default=str)
    return out
