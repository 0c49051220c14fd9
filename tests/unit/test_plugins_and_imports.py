"""Entry-point registry behaviour and the torch-free core."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import asyncrl
from asyncrl import registry
from asyncrl.errors import PluginError


def test_import_asyncrl_does_not_import_torch_or_engines() -> None:
    code = (
        "import sys, asyncrl, asyncrl.run.controller, asyncrl.run.loops, asyncrl.worker.runtime, asyncrl.launch;"
        # what a training backend's check_config loads in the controller
        "import asyncrl.policy.packing, asyncrl_torch, asyncrl_torch.options, asyncrl_fsdp,"
        " asyncrl_deepspeed, asyncrl_fsdp.options, asyncrl_deepspeed.options;"
        "asyncrl.registry.load('asyncrl.training_backends', 'deepspeed');"
        "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


CORE = Path(asyncrl.__file__).parent

LAZY_TORCH = {
    "ranks.py": "torchrun's rendezvous store (a rank's handshake with rank 0), in the rank itself",
    "one_node.py": "torchrun's own runner, which `asyncrl run` calls for one node",
    "transfers/shm.py": "a zero-copy byte view of a torch tensor a torch trainer hands it",
    "worker/export.py": "the bytes of a torch trainer's tensor, copied to the host",
}
"""The core's only mentions of torch: each inside the function that needs it, never at import."""


def test_every_core_module_imports_without_torch_or_an_optional_part() -> None:
    """The core is every module under asyncrl/: importing all of them loads no torch, no
    engine and none of the optional distributions (the torch side, the gateway, its server)."""
    modules = sorted(
        "asyncrl." + ".".join(p.relative_to(CORE).with_suffix("").parts).removesuffix(".__init__")
        for p in CORE.rglob("*.py") if p.name != "__main__.py"
    )
    assert len(modules) > 100  # the tree was found
    heavy = ("torch", "vllm", "deepspeed", "transformers", "asyncrl_torch", "asyncrl_gateway",
             "starlette", "uvicorn")
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_torch_is_named_only_where_listed() -> None:
    """A new ``import torch`` in the core belongs in asyncrl-torch (backends/asyncrl-torch)."""
    pattern = re.compile(r"^\s*(import torch|from torch[\w.]* import)", re.M)
    found = {str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if pattern.search(p.read_text())}
    assert found == set(LAZY_TORCH), f"torch imported in the core at {sorted(found - set(LAZY_TORCH))}"
    for name in LAZY_TORCH:  # never at module level
        top = [line for line in (CORE / name).read_text().splitlines()
               if line.startswith(("import torch", "from torch"))]
        assert not top, f"{name} imports torch at module level: {top}"


def test_a_worker_imports_no_controller() -> None:
    """A worker process (``python -m asyncrl.launch --worker``, the rollout supervisor, a
    torchrun rank) imports asyncrl; the controller's modules are for rank 0 and an embedding
    application alone, imported when ``asyncrl.Controller`` is first asked for."""
    code = (
        "import sys, asyncrl, asyncrl.launch, asyncrl.worker.runtime;"
        "print(sorted(m for m in sys.modules if m.startswith(('asyncrl.run.controller',"
        " 'asyncrl.run.loops', 'asyncrl_gateway'))));"
        "from asyncrl import Controller; print(Controller.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "asyncrl.run.controller"]


def test_public_exports() -> None:
    for name in asyncrl.__all__:
        assert hasattr(asyncrl, name), name


def test_first_party_plugins_are_registered() -> None:
    assert "vllm" in registry.available("asyncrl.generation_backends")
    assert {"fsdp2", "deepspeed"} <= set(registry.available("asyncrl.training_backends"))
    assert "arithmetic" in registry.available("asyncrl.environments")
    samplers = registry.available("asyncrl.samplers")
    assert {"in_order", "gated", "oversampled", "ready_first", "dynamic"} <= set(samplers)
    from asyncrl.policy.samplers import SamplerPlugin

    for name in samplers:  # every registered sampler loads and names its own struct's tag
        plugin = registry.load("asyncrl.samplers", name)
        assert isinstance(plugin, SamplerPlugin)
        assert plugin.config.__struct_config__.tag == name


def test_missing_plugin_names_install_hint() -> None:
    with pytest.raises(PluginError, match=r"no training backend named 'nope'.*installed: .*fsdp2"):
        registry.load("asyncrl.training_backends", "nope")
    with pytest.raises(PluginError, match="unknown plugin group"):
        registry.available("asyncrl.nothing")


def fake_eps(monkeypatch: pytest.MonkeyPatch, eps: list[EntryPoint]) -> None:
    monkeypatch.setattr(registry, "entry_points", lambda group: [e for e in eps if e.group == group])


def test_duplicate_names_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("x", "os:getcwd", g), EntryPoint("x", "os:getpid", g)])
    with pytest.raises(PluginError, match="registered twice"):
        registry.load(g, "x")


def test_import_failure_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("broken", "no_such_module_xyz:f", g)])
    with pytest.raises(PluginError, match="failed to import.*ModuleNotFoundError"):
        registry.load(g, "broken")


def test_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("a", "os:getcwd", g), EntryPoint("b", "os:getpid", g)])
    monkeypatch.setenv("ASYNCRL_PLUGINS", "asyncrl.environments:a")
    assert list(registry.available(g)) == ["a"]
    import os

    assert registry.load(g, "a") is os.getcwd


def test_require_names_the_config_field() -> None:
    assert registry.require("asyncrl.training_backends", "fsdp2", "trainer.backend").name == "fsdp2"
    with pytest.raises(PluginError, match=r"generator.backend: no generation backend named 'vlm'"):
        registry.require("asyncrl.generation_backends", "vlm", "generator.backend")


class _BrokenService:
    """A service whose ``build`` is ``async def`` and whose ``check`` is misspelt."""

    async def chek(self, config: object, environment: object, tokenizer: object) -> None: ...

    async def build(self, config: object, environment: object, tokenizer: object) -> None: ...


def test_a_service_is_checked_once_as_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway, as installed, keeps the service contract; one that does not is refused
    naming the plugin, each method and why, in the controller's words (not a worker's)."""
    from asyncrl import services

    assert callable(services.load_service("gateway", "gateway.enabled").build)
    monkeypatch.setattr(services.registry, "load", lambda group, name, field: _BrokenService())
    with pytest.raises(PluginError) as refused:
        services.load_service("broken", "broken.enabled")
    text = str(refused.value)
    assert "service 'broken' (asyncrl.services" in text
    assert "no method 'check' (did you mean 'chek'?)" in text
    assert "'build' must be a plain method, not `async def` (the controller calls it as it " \
           "builds the run's loops)" in text
    assert "trainer" not in text and "worker" not in text
