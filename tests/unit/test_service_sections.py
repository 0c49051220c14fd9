"""A service owns its section of the run config: the top-level table of its entry point's
name, converted by the loader to the service's ``section`` struct (its paths resolved, its
``problems()`` gathered with the core's), kept in ``config.services`` and written back as the
same table by ``to_dict``. A table that is neither the core's nor an installed service's is
refused naming the fix, and a section that breaks the contract is refused as the service
loads. A made-up third-party service (``notes``) stands for any; the gateway for the
first-party one."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import msgspec
import pytest

from asyncrl import registry, services
from asyncrl.config import service_sections
from asyncrl.config import CORE_SECTIONS, Config, from_dict, load_config, to_dict
from asyncrl.errors import ConfigError, PluginError
from asyncrl.plugin.service import Removed

# model_dir: the fixture in conftest.py

BASE = '[model]\npath = "model"\n[environment]\nname = "arithmetic"\n'

THIRD_PARTY = '''
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import msgspec

from asyncrl.plugin.service import Removed, Section, became_constant, fail

FLUSH_EVERY = 64


class NotesConfig(Section):
    HARMLESS: ClassVar[tuple[str, ...]] = ("log_dir",)
    REMOVED: ClassVar[dict[str, Removed]] = {
        "flush_s": Removed(5.0, "notes.every_s, each note flushed as it is written",
                           "set every_s alone"),
        "flush_every": became_constant("notes_service.FLUSH_EVERY", 64),
    }

    enabled: bool = False
    log_dir: str = ""
    every_s: float = 1.0

    def problems(self):
        if self.every_s > 0:
            return []
        return [fail("notes.every_s", f"must be > 0, got {self.every_s}", "set seconds")]

    def resolve_paths(self, base_dir: Path) -> NotesConfig:
        return msgspec.structs.replace(self, log_dir=str(base_dir / (self.log_dir or "notes")))


class NoSwitch(Section):
    every_s: float = 1.0

    def problems(self):
        return []


class Notes:
    section = NotesConfig

    async def check(self, config, environment, tokenizer): ...

    def build(self, config, environment, tokenizer): ...


class Broken(Notes):
    section = NoSwitch


SERVICE, BROKEN = Notes(), Broken()
'''


@pytest.fixture
def notes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``notes`` (and ``broken``, whose section has no ``enabled``) installed as the only
    services, from a module of their own."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes_service.py").write_text(THIRD_PARTY)
    monkeypatch.syspath_prepend(str(src))
    _only_services(monkeypatch, [EntryPoint("notes", "notes_service:SERVICE", services.GROUP),
                                 EntryPoint("broken", "notes_service:BROKEN", services.GROUP)])
    yield
    sys.modules.pop("notes_service", None)


def _only_services(monkeypatch: pytest.MonkeyPatch, installed: list[EntryPoint]) -> None:
    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda group: installed
                        if group == services.GROUP else real(group=group))  # fmt: skip


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(BASE + body)
    return path


def test_a_service_s_table_becomes_its_section(tmp_path: Path, model_dir: Path, notes: None) -> None:
    sys.modules.pop("notes_service", None)
    assert load_config(write(tmp_path, "")).services == {}
    assert "notes_service" not in sys.modules  # no table: the service is not imported

    cfg = load_config(write(tmp_path, '[notes]\nenabled = true\nlog_dir = "logs"\n'))
    section = cfg.services["notes"]
    assert type(section).__name__ == "NotesConfig" and section.enabled
    assert section.log_dir == str(tmp_path / "logs")  # its own resolve_paths, from the file's dir
    assert services.enabled_services(cfg) == ["notes"]
    assert service_sections.harmless_keys(cfg) == ["notes.log_dir"]
    off = load_config(write(tmp_path, "[notes]\nevery_s = 2.0\n"))
    assert off.services["notes"].every_s == 2.0 and services.enabled_services(off) == []
    assert services.enabled_services(load_config(write(tmp_path, "[notes]\n"),
                                                 {"notes.enabled": True})) == ["notes"]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[notes]\nevry_s = 2.0\n", "notes.evry_s: unknown key. Fix: did you mean 'every_s'? "
         "remove or rename it (keys of [notes]: enabled, log_dir, every_s)"),
        ("[notes]\nevery_s = 'often'\n", "notes.every_s: expected float, got str. Fix:"),
        ("[notes]\nevery_s = 0.0\n", "notes.every_s: must be > 0, got 0.0. Fix: set seconds."),
        ("notes = 3\n", "notes: is 3, not a table. Fix: write the service's settings as a "
         "[notes] table."),
    ],
)
def test_a_section_s_mistakes_are_named_under_its_table(
    tmp_path: Path, model_dir: Path, notes: None, body: str, message: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(body + BASE if body.startswith("notes =") else BASE + body)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert message in str(refused.value)


def test_an_unknown_table_names_the_sections_and_the_installed_services(
    tmp_path: Path, model_dir: Path, notes: None
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, "[notse]\nenabled = true\n"))
    assert str(refused.value).endswith(
        "run.toml: notse: is neither a section of the config nor an installed service's. Fix: "
        f"did you mean 'notes'? rename or remove it (sections: {', '.join(CORE_SECTIONS)}; "
        "installed services: broken, notes)."
    )
    assert "gateway" not in CORE_SECTIONS and "services" not in CORE_SECTIONS
    with pytest.raises(ConfigError, match=r"^services: is neither a section of the config"):
        from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "arithmetic"},
                   "services": {"notes": {"enabled": True}}})  # fmt: skip


def test_the_gateway_not_installed_says_how_to_install_it(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``[gateway]`` table (or ``--set gateway.enabled=true``) without the plugin: the
    install command, as a missing first-party plugin's error gives it."""
    _only_services(monkeypatch, [])
    hint = ("gateway: is the section of the service 'gateway', which is not installed. Fix: "
            "install it with: pip install -e plugins/asyncrl-gateway (or remove the [gateway] "
            "table).")  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, "[gateway]\nenabled = true\n"))
    assert str(refused.value).endswith(hint)
    with pytest.raises(ConfigError) as overridden:
        load_config(write(tmp_path, ""), {"gateway.enabled": True})
    assert str(overridden.value).endswith(hint)
    # the gateway's section names its removed keys, so without it a table setting one is
    # refused as any [gateway] is
    with pytest.raises(ConfigError) as removed:
        load_config(write(tmp_path, "[gateway]\nmax_tools = 8\n"))
    assert str(removed.value).endswith(hint)


def test_a_removed_key_of_the_gateway_names_its_constant(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("asyncrl_gateway")
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, "[gateway]\nenabled = true\nmax_tools = 8\n"
                          "model_name = 'm'\n"))  # fmt: skip
    assert str(refused.value).splitlines()[1:] == [
        "gateway.model_name: removed: the model directory's name, in /v1/models and in every "
        "response (a request may name any model, so an agent that hard-codes one works as it "
        "is). Fix: remove it from the config (docs/configuration.md lists the keys)."]
    assert str(refused.value).splitlines()[0].endswith(
        "gateway.max_tools: removed: the constant asyncrl_gateway.server.MAX_TOOLS = 128 (a "
        "defence against broken or hostile clients, not a decision of a run). Fix: remove it "
        "from the config (docs/configuration.md lists the keys).")


def test_a_removed_key_of_a_service_s_section_is_refused_naming_what_replaced_it(
    tmp_path: Path, model_dir: Path, notes: None
) -> None:
    """The keys a section names in its ``REMOVED`` are refused as the core's removed keys
    are: each one set (in the file or by ``--set``), what replaced it and the fix, in one
    error, before the table is converted (not as an unknown key)."""
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, "[run]\nname = 'r'\n[notes]\nflush_every = 8\n"
                          "flush_s = 1.0\n"), {"notes.every_s": 0.0})  # fmt: skip
    lines = str(refused.value).splitlines()
    assert lines[0].endswith("run.toml: notes.flush_s: removed: notes.every_s, each note "
                             "flushed as it is written (set every_s alone). Fix: remove it from "
                             "the config (docs/configuration.md lists the keys).")  # fmt: skip
    assert lines[1:] == ["notes.flush_every: removed: the constant notes_service.FLUSH_EVERY = "
                         "64. Fix: remove it from the config (docs/configuration.md lists the "
                         "keys)."]  # fmt: skip
    assert "unknown key" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"notes.flush_s: removed: notes.every_s"):
        load_config(write(tmp_path, "[notes]\nenabled = true\n"), {"notes.flush_s": 2.0})
    import notes_service  # the constant it names holds its default, as the core's are checked

    entry = service_sections.load_section("notes", "notes").removed["flush_every"]
    assert getattr(notes_service, entry.constant.rpartition(".")[2]) == entry.default


class _SavingTrainers:
    """A control plane whose trainers save nothing."""

    async def call_each(self, workers: list, requests: list, *, timeout_s: float) -> list:
        return [None] * len(workers)


@pytest.mark.anyio
async def test_a_checkpoint_holding_a_service_s_removed_key_resumes(
    tmp_path: Path, model_dir: Path, notes: None
) -> None:
    """A checkpoint whose stored ``[notes]`` (on) holds keys its section names removed
    resumes with them dropped: a stored value other than the entry's default is listed with
    the harmless changes, naming what replaced it; the section's other keys are still
    compared."""
    import hashlib
    import json

    from asyncrl.checkpoints import directory as ckpt
    from asyncrl.checkpoints.resume_rule import compare
    from asyncrl.checkpoints.saving import Checkpointer, open_resume
    from asyncrl.environment import Prompt

    prompts = [Prompt(id=f"p{i}", text=f"{i} + 1 =", answer=i + 1) for i in range(3)]
    cfg = load_config(write(tmp_path, f"[run]\noutput_dir = '{tmp_path / 'out'}'\n"
                            "[checkpoint]\nsave_model = false\n[notes]\nenabled = true\n"))
    saver = Checkpointer(cfg, control=_SavingTrainers(), trainers=["trainer:0"], metrics=None,
                         train_prompts=prompts)  # type: ignore[arg-type]
    state = ckpt.ControllerState(step=1, finished=False, groups=[], scheduler={
        "ledger": {"trained": [[0, 1]], "num_repeated": 0}, "redispatch": []})  # fmt: skip
    path = await saver.save(state, finished=False)
    assert path is not None
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["config"]["notes"] |= {"flush_s": 1.0, "flush_every": 64}
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    resume = open_resume(cfg, "latest", train_prompts=prompts)
    assert resume is not None and resume.state.step == 1
    assert (resume.changes.refused, resume.changes.allowed) == ([], [])
    assert resume.changes.harmless == [
        "notes.flush_s: 1.0 -> 5.0 (removed: notes.every_s, each note flushed as it is "
        "written)"]
    # without the section's REMOVED, the stored keys would be changes of an enabled section
    saved = {"config": manifest["config"]}
    assert compare(saved, {"config": to_dict(cfg)}).refused == [
        "notes.flush_every: 64 -> '(unset)'", "notes.flush_s: 1.0 -> '(unset)'"]
    # the rest of the section is compared as before
    manifest["config"]["notes"]["every_s"] = 3.0
    moved = compare({"config": manifest["config"]}, {"config": to_dict(cfg)},
                    removed=service_sections.removed_keys(cfg))  # fmt: skip
    assert moved.refused == ["notes.every_s: 3.0 -> 1.0"]


def test_to_dict_writes_the_gateway_back_as_its_table(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("asyncrl_gateway")
    from asyncrl_gateway.config import GatewayConfig, gateway_config

    cfg = load_config(write(tmp_path, '[gateway]\nenabled = true\nagent = ["python", "a.py"]\n'
                            'agent_dir = "agents"\n[grpo]\nprompts_per_step = 4\n'))  # fmt: skip
    assert gateway_config(cfg) == GatewayConfig(enabled=True, agent=["python", "a.py"],
                                                agent_dir=str(tmp_path / "agents"))  # fmt: skip
    data = to_dict(cfg)
    assert "services" not in data and data["gateway"]["enabled"] is True
    assert data["gateway"]["agent_dir"] == str(tmp_path / "agents")
    again = from_dict(data, base_dir="/elsewhere")  # its paths are absolute by now
    assert again == cfg and gateway_config(again) == gateway_config(cfg)
    # a worker gets the core's sections alone, and converts them without the plugin
    core = to_dict(cfg, services=False)
    assert "gateway" not in core and set(core) == set(CORE_SECTIONS)
    assert msgspec.convert(core, Config).services == {}
    assert gateway_config(msgspec.convert(core, Config)) == GatewayConfig()  # off


def test_a_config_without_the_gateway_table_does_not_import_it(
    tmp_path: Path, model_dir: Path
) -> None:
    pytest.importorskip("asyncrl_gateway")
    path = write(tmp_path, "")
    code = ("import sys; from asyncrl.config import load_config; from asyncrl.services import "
            f"enabled_services; cfg = load_config({str(path)!r}); "
            "print(enabled_services(cfg), 'asyncrl_gateway' in sys.modules); "
            f"cfg = load_config({str(path)!r}, {{'gateway.enabled': True}}); "
            "print(enabled_services(cfg), 'asyncrl_gateway' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[] False", "['gateway'] True"]


def test_a_section_without_enabled_is_refused_naming_the_plugin(
    tmp_path: Path, model_dir: Path, notes: None
) -> None:
    with pytest.raises(PluginError) as refused:
        services.load_service("broken", "broken.enabled")
    assert str(refused.value) == (
        "service 'broken' (asyncrl.services: notes_service.Broken): its section "
        "notes_service.NoSwitch has no field `enabled`. Fix: give it the field `enabled: bool "
        "= False` ([broken] enabled = true switches the service on; a run without the table "
        "must not have it)"
    )
    with pytest.raises(PluginError, match=r"service 'broken' .*NoSwitch has no field `enabled`"):
        load_config(write(tmp_path, "[broken]\nevery_s = 2.0\n"))


class _Plain:
    def problems(self) -> list[ConfigError]:
        return []


class _Switch(msgspec.Struct, kw_only=True, frozen=True):
    """Not a Section: unknown keys would pass silently."""

    enabled: bool = False


def _section(**members: object) -> type:
    from asyncrl.config.section import Section

    return type("Custom", (Section,), {"__annotations__": {"enabled": bool}, "enabled": False,
                                        "__module__": "custom", **members})  # fmt: skip


async def _async_problems(self: object) -> list[ConfigError]:
    return []


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        (None, "has no config section: its `section` is None. Fix: set the class attribute "
         "`section`"),
        (_Plain, "has no config section: its `section` is <class"),
        (_Switch, "has no config section"),
        (_section(), "does not implement ServiceSection: no method 'problems'. Fix: define it "
         "as asyncrl.config.service_sections.ServiceSection says"),
        (_section(problems=_async_problems), "'problems' must be a plain method, not `async "
         "def` (the loader calls it as it reads the config)"),
        (_section(problems=_Plain.problems, HARMLESS=("port",)), "its section's HARMLESS is "
         "('port',), not a tuple of its keys. Fix: list the field names of Custom a resumed "
         "run may change (keys: enabled)"),
        (_section(problems=_Plain.problems, resolve_paths="here"), "'resolve_paths' is not "
         "callable"),
        (_section(problems=_Plain.problems, REMOVED={"enabled": Removed(False, "always on")}),
         "its section's REMOVED is {'enabled': Removed(default=False, now='always on', why='', "
         "constant='')}, not a mapping of keys it no longer has to what replaced them. Fix: map "
         "each former key's name (no field of Custom, without the section's name) to an "
         "asyncrl.plugin.service.Removed"),
        (_section(problems=_Plain.problems, REMOVED={"port": 8080}), "its section's REMOVED is "
         "{'port': 8080}, not a mapping"),
        (_section(problems=_Plain.problems, REMOVED={"custom.port": Removed(0, "gone")}),
         "its section's REMOVED is {'custom.port': "),
        (_section(problems=_Plain.problems, REMOVED=("port",)), "its section's REMOVED is "
         "('port',), not a mapping"),
    ],
)
def test_a_section_that_breaks_the_contract_is_refused_as_it_loads(
    monkeypatch: pytest.MonkeyPatch, section: type | None, problem: str
) -> None:
    class Service:
        async def check(self, config: object, environment: object, tokenizer: object) -> None: ...

        def build(self, config: object, environment: object, tokenizer: object) -> None: ...

    Service.section = section  # type: ignore[attr-defined]
    monkeypatch.setattr(services.registry, "load", lambda group, name, field: Service())
    with pytest.raises(PluginError) as refused:
        service_sections.load_section("custom", "custom")
    text = str(refused.value)
    assert text.startswith("service 'custom' (asyncrl.services: ") and problem in text, text


def test_a_well_formed_section_loads_with_what_it_declares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def resolve(self: object, base_dir: Path) -> object:
        return self

    removed = {"port": Removed(0, "a free port, always")}
    custom = _section(problems=_Plain.problems, HARMLESS=("enabled",), resolve_paths=resolve,
                      REMOVED=removed)  # fmt: skip
    bare = _section(problems=_Plain.problems)
    for section, harmless, resolves, gone in ((custom, ("enabled",), resolve, removed),
                                              (bare, (), None, {})):  # fmt: skip
        service = type("Service", (), {"section": section, "check": _async_check,
                                       "build": lambda self, c, e, t: None})()  # fmt: skip
        monkeypatch.setattr(services.registry, "load", lambda group, name, field: service)
        spec = service_sections.load_section("custom", "custom")
        assert (spec.type, spec.harmless, spec.resolve_paths) == (section, harmless, resolves)
        assert spec.removed == gone


async def _async_check(self: object, config: object, environment: object, tok: object) -> None:
    return None
