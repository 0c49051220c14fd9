"""The plugin API: the façades of ``asyncrl.plugin`` are exactly what docs/plugins.md lists
("What a plugin may import"), every listed name imports from its façade, importing them loads
no torch, and the shipped plugins (backends/, plugins/) and the examples on the plugin pages
import from asyncrl nothing else.

A move inside asyncrl that would break a plugin fails here, naming the façade and the name.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"
PAGES = [DOC, ROOT / "docs" / "environments.md", ROOT / "docs" / "datasets.md"]
BLOCK = re.compile(r"^```plugin-api\n(.*?)^```$", re.M | re.S)
FACADES = sorted(
    f"asyncrl.plugin.{p.stem}" for p in (ROOT / "asyncrl" / "plugin").glob("*.py")
    if p.stem != "__init__"
)


def listed() -> dict[str, list[str]]:
    """The ``plugin-api`` block of docs/plugins.md: façade → names."""
    found = BLOCK.findall(DOC.read_text())
    assert len(found) == 1, "docs/plugins.md must hold exactly one ```plugin-api block"
    api: dict[str, list[str]] = {}
    for line in found[0].splitlines():
        module, sep, names = line.partition(":")
        assert sep and module.strip() == module and module.startswith("asyncrl.plugin."), (
            f"docs/plugins.md plugin-api line {line!r}: write 'asyncrl.plugin.x: name, name'"
        )
        assert module not in api, f"docs/plugins.md lists {module} twice"
        api[module] = [n.strip() for n in names.split(",")]
        assert all(n.isidentifier() for n in api[module]), f"a name of {module} is malformed"
        assert len(set(api[module])) == len(api[module]), f"docs/plugins.md repeats a {module} name"
    return api


API = listed()
WHERE = {name: module for module, names in API.items() for name in names}


def test_the_list_holds_the_core_of_the_api() -> None:
    """The parser found the block (a broken fence would leave an empty list passing)."""
    backend = set(API["asyncrl.plugin.backend"])
    assert {"GenerationBackend", "TrainingBackend", "BackendPlugin"} <= backend
    assert "in_thread" in API["asyncrl.plugin.environment"]
    assert sum(len(names) for names in API.values()) >= 60


def test_the_block_lists_exactly_the_facades() -> None:
    assert sorted(API) == FACADES, (
        f"docs/plugins.md lists {sorted(API)}, asyncrl/plugin/ holds {FACADES}: one line per façade"
    )
    assert len(FACADES) <= 7  # a few façades, not the tree again


def test_a_name_is_in_one_facade() -> None:
    seen: dict[str, str] = {}
    twice = []
    for module, names in API.items():
        twice += [f"{n} ({seen[n]}, {module})" for n in names if n in seen]
        seen.update(dict.fromkeys(names, module))
    assert not twice, f"names listed in two façades: {twice}"


@pytest.mark.parametrize("module", FACADES)
def test_each_facade_exports_exactly_its_line(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert len(set(exported)) == len(exported), f"{module}.__all__ repeats a name"
    assert set(exported) == set(API.get(module, ())), (
        f"{module}.__all__ and docs/plugins.md differ: not listed "
        f"{sorted(set(exported) - set(API.get(module, ())))}, not exported "
        f"{sorted(set(API.get(module, ())) - set(exported))}"
    )


@pytest.mark.parametrize("module", FACADES)
def test_every_listed_name_imports(module: str) -> None:
    failed = []
    for name in API.get(module, ()):
        try:  # exactly the statement a plugin writes
            exec(f"from {module} import {name}", {})
        except ImportError as exc:
            failed.append(f"{name}: {exc}")
    assert not failed, f"docs/plugins.md lists names {module} does not have: {failed}"


@pytest.mark.parametrize("module", FACADES)
def test_each_facade_says_what_each_name_is_for(module: str) -> None:
    """Its docstring has a ``- ``name``: ...`` line for every name it exports."""
    doc = importlib.import_module(module).__doc__ or ""
    described = set(re.findall(r"^- ``(\w+)``:", doc, re.M))
    missing = sorted(set(API.get(module, ())) - described)
    assert not missing, f"{module}'s docstring does not say what these are for: {missing}"


def test_importing_the_facades_imports_no_torch() -> None:
    heavy = ("torch", "vllm", "deepspeed", "transformers", "asyncrl_torch", "asyncrl_gateway")
    code = (
        f"import sys\nimport {', '.join(FACADES)}\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imports_in(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` of every absolute import from asyncrl in ``path``
    (``import asyncrl.x`` counts as ``(asyncrl.x, "*")``)."""
    out: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "asyncrl" or node.module.startswith("asyncrl."):
                out |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {(a.name, "*") for a in node.names if a.name.split(".")[0] == "asyncrl"}
    return out


def _unlisted(imports: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{m}: {n}" for m, n in imports if n not in API.get(m, ()))


def test_the_shipped_plugins_import_only_the_facades() -> None:
    """The distributions' packages (not their own tests, which may check against the core)."""
    sources = [
        p for top in ("backends", "plugins") for dist in sorted((ROOT / top).iterdir())
        for pkg in sorted(dist.glob("asyncrl_*")) if pkg.is_dir() and ".egg-info" not in pkg.name
        for p in sorted(pkg.rglob("*.py"))
    ]
    assert len(sources) > 20  # the tree was found
    found = {p: _imports_in(p) for p in sources}
    imports = set().union(*found.values())
    assert ("asyncrl.plugin.backend", "BackendPlugin") in imports
    wrong = sorted(
        f"{p.relative_to(ROOT)}: {bad}" for p, got in found.items() for bad in _unlisted(got)
    )
    assert not wrong, (
        f"plugins import asyncrl names that are not the plugin API: {wrong}; import them from "
        "the asyncrl.plugin façade docs/plugins.md lists them under (or add them to one)"
    )


def test_the_examples_on_the_pages_use_the_facades() -> None:
    imports = {
        (page.name, module, name.strip())
        for page in PAGES
        for module, names in re.findall(
            r"^from (asyncrl(?:\.[\w.]+)?) import ([\w, ]+)$", page.read_text(), re.M
        )
        for name in names.split(",")
    }
    assert ("plugins.md", "asyncrl.plugin.sink", "SinkPlugin") in imports
    wrong = sorted(f"{page}: {m}: {n}" for page, m, n in imports if n not in API.get(m, ()))
    assert not wrong, f"examples import names that are not the plugin API: {wrong}"
