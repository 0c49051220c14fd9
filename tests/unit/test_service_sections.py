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

# model_dir: the fixture in conftest.py

BASE = '[model]\npath = "model"\n[environment]\nname = "arithmetic"\n'

THIRD_PARTY = '''
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import msgspec

from asyncrl.plugin.service import Section, fail


class NotesConfig(Section):
    HARMLESS: ClassVar[tuple[str, ...]] = ("log_dir",)

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
    # a removed key of the gateway is named as removed first, installed or not
    with pytest.raises(ConfigError, match=r"gateway.max_tools: removed: the constant "
                       r"asyncrl_gateway.server.MAX_TOOLS = 128"):  # fmt: skip
        load_config(write(tmp_path, "[gateway]\nmax_tools = 8\n"))


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

    custom = _section(problems=_Plain.problems, HARMLESS=("enabled",), resolve_paths=resolve)
    bare = _section(problems=_Plain.problems)
    for section, harmless, resolves in ((custom, ("enabled",), resolve), (bare, (), None)):
        service = type("Service", (), {"section": section, "check": _async_check,
                                       "build": lambda self, c, e, t: None})()  # fmt: skip
        monkeypatch.setattr(services.registry, "load", lambda group, name, field: service)
        spec = service_sections.load_section("custom", "custom")
        assert (spec.type, spec.harmless, spec.resolve_paths) == (section, harmless, resolves)


async def _async_check(self: object, config: object, environment: object, tok: object) -> None:
    return None
