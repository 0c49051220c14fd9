"""msgspec validation errors as ``<field>: <problem>. Fix: <fix>.`` (did-you-mean for unknown
keys, the allowed values of a ``Literal`` or a tagged union's tag)."""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec

__all__ = ["explain"]

_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_MISSING = re.compile(r"Object missing required field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`$")


def _struct_at(root: type, path: str) -> Any:
    """The struct type at dotted ``path`` below ``root`` (``None`` if it is not a struct)."""
    node: Any = msgspec.inspect.type_info(root)
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f for f in getattr(node, "fields", ())}
        if part not in fields:
            return None
        node = fields[part].type
        if isinstance(node, msgspec.inspect.UnionType):  # e.g. a tagged union of samplers
            structs = [t for t in node.types if isinstance(t, msgspec.inspect.StructType)]
            node = structs[0] if len(structs) == 1 else None
        if not isinstance(node, msgspec.inspect.StructType):
            return None
    return node


def _allowed_values(root: type, field: str) -> list[Any]:
    """The values a ``Literal`` field (or a tagged union's tag) admits, else ``[]``."""
    parent, _, name = field.rpartition(".")
    node = _struct_at(root, parent)
    if node is None:
        # a tagged union's tag: the tags of its members
        grand, _, last = parent.rpartition(".")
        outer = _struct_at(root, grand)
        for f in getattr(outer, "fields", ()):
            if f.name == last and isinstance(f.type, msgspec.inspect.UnionType):
                return [t.tag for t in f.type.types if getattr(t, "tag", None) is not None]
        return []
    for f in node.fields:
        if f.name == name and isinstance(f.type, msgspec.inspect.LiteralType):
            return list(f.type.values)
    if name == getattr(node, "tag_field", None):
        return [node.tag]
    return []


def explain(exc: msgspec.ValidationError, root: type, prefix: str = "") -> str:
    """msgspec's validation message as ``<field>: <problem>. Fix: <fix>.`` (fields of a
    plugin's options struct are named under ``prefix``, e.g. ``generator.options``)."""
    message = _explain(str(exc), root, prefix)
    return f"{prefix}.{message}" if prefix else message


def _explain(text: str, root: type, prefix: str = "") -> str:
    if m := _UNKNOWN.match(text):
        key, section = m.group(1), m.group(2) or ""
        field = f"{section}.{key}" if section else key
        node = _struct_at(root, section)
        known = [f.name for f in node.fields] if node is not None else []
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        table = ".".join(p for p in (prefix, section) if p)
        where = f"[{table}]" if table else "the top level"
        listing = f" (keys of {where}: {', '.join(known)})" if known else ""
        return f"{field}: unknown key. Fix: {hint}remove or rename it{listing}"
    if m := _MISSING.match(text):
        key, section = m.group(1), m.group(2) or ""
        field = f"{section}.{key}" if section else key
        example = {
            "model": '[model] path = "path/to/hf-model"',
            "path": 'path = "..."',
            "environment": '[environment] name = "arithmetic"',
            "name": 'name = "..."',
        }
        return (
            f"{field}: required but missing. Fix: add it, e.g. {example.get(key, key + ' = ...')}"
        )
    if m := _AT.match(text):
        problem, field = m.group(1), m.group(2)
        problem = problem.replace("`", "")
        if problem.startswith("Expected"):
            fix = 'write a value of that type (TOML: 3 is an int, 3.0 a float, "x" a string)'
        elif problem.startswith("Invalid"):
            allowed = _allowed_values(root, field)
            fix = (
                f"use one of: {', '.join(map(repr, allowed))}"
                if allowed
                else ("use one of the values docs/configuration.md lists for it")
            )
        else:
            fix = "see docs/configuration.md"
        return f"{field}: {problem.lower()[:1] + problem[1:]}. Fix: {fix}"
    return f"invalid configuration: {text}. Fix: see docs/configuration.md"


