"""The plugin API: every name docs/plugins.md lists ("What a plugin may import") imports from
the module it is listed under, and nothing a plugin imports from asyncrl is missing from the
list: the shipped plugins' imports (backends/, plugins/) and the examples on that page.

A move inside asyncrl that would break a plugin fails here, naming the module and the name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"
BLOCK = re.compile(r"^```plugin-api\n(.*?)^```$", re.M | re.S)


def listed() -> dict[str, list[str]]:
    """The ``plugin-api`` block of docs/plugins.md: module → names."""
    found = BLOCK.findall(DOC.read_text())
    assert len(found) == 1, "docs/plugins.md must hold exactly one ```plugin-api block"
    api: dict[str, list[str]] = {}
    for line in found[0].splitlines():
        module, sep, names = line.partition(":")
        assert sep and module.strip() == module and module.startswith("asyncrl"), (
            f"docs/plugins.md plugin-api line {line!r}: write 'asyncrl.module: name, name'"
        )
        assert module not in api, f"docs/plugins.md lists {module} twice"
        api[module] = [n.strip() for n in names.split(",")]
        assert all(n.isidentifier() for n in api[module]), f"a name of {module} is malformed"
    return api


API = listed()


def test_the_list_holds_the_core_of_the_api() -> None:
    """The parser found the block (a broken fence would leave an empty list passing)."""
    assert {"GenerationBackend", "TrainingBackend", "BackendPlugin"} <= set(API["asyncrl.backend"])
    assert "in_thread" in API["asyncrl.data.deadlines"]
    assert sum(len(names) for names in API.values()) >= 60


@pytest.mark.parametrize("module", sorted(API))
def test_every_listed_name_imports(module: str) -> None:
    failed = []
    for name in API[module]:
        try:  # exactly the statement a plugin writes
            exec(f"from {module} import {name}", {})
        except ImportError as exc:
            failed.append(f"{name}: {exc}")
    assert not failed, f"docs/plugins.md lists names {module} does not have: {failed}"


def _imports_in(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` of every absolute import from asyncrl in ``path``
    (``import asyncrl.x`` counts as ``(asyncrl.x, "*")``)."""
    out: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "asyncrl" or node.module.startswith("asyncrl."):
                out |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {(a.name, "*") for a in node.names if a.name.startswith("asyncrl.")}
    return out


def _unlisted(imports: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{m}: {n}" for m, n in imports if n not in API.get(m, ()))


def test_the_shipped_plugins_import_only_listed_names() -> None:
    sources = [
        p for top in ("backends", "plugins") for p in sorted((ROOT / top).rglob("*.py"))
        if ".egg-info" not in str(p)
    ]
    assert len(sources) > 20  # the tree was found
    imports = set().union(*(_imports_in(p) for p in sources))
    assert ("asyncrl.backend", "BackendPlugin") in imports
    assert not _unlisted(imports), (
        f"plugins import asyncrl names docs/plugins.md does not list: {_unlisted(imports)}; "
        "list them in its plugin-api block (or import something that is listed)"
    )


def test_the_examples_on_the_page_use_listed_names() -> None:
    text = DOC.read_text()
    imports = {
        (module, name.strip())
        for module, names in re.findall(r"^from (asyncrl[\w.]*) import ([\w, ]+)$", text, re.M)
        for name in names.split(",")
    }
    assert ("asyncrl.sinks", "SinkPlugin") in imports
    assert not _unlisted(imports), f"docs/plugins.md examples import unlisted {_unlisted(imports)}"
