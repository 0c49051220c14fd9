"""Write docs/configuration.md from the field docstrings of the section structs in asyncrl/config/
(one module per theme; and, for the built-in samplers' ``[pipeline.sampler]`` knobs,
asyncrl/policy/samplers.py), then those of the first-party services' sections, each from its
plugin (:data:`SERVICES`), under a heading of its own.

    .venv/bin/python scripts/gen_config_docs.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "asyncrl/config"
SECTIONS = {  # in the page's order
    "RunConfig": "run", "ModelConfig": "model", "ClusterConfig": "cluster", "GRPOConfig": "grpo",
    "LossConfig": "loss", "PipelineConfig": "pipeline",
    "RefitConfig": "refit", "TrainerConfig": "trainer", "LoraConfig": "lora",
    "GeneratorConfig": "generator",
    "EnvironmentConfig": "environment", "EvalConfig": "eval",
    "CheckpointConfig": "checkpoint", "ExportConfig": "export", "FailuresConfig": "failures",
    "MetricsConfig": "metrics", "EpisodeConfig": "episode",
}
SERVICES = {  # a first-party service's table: its plugin's distribution, module and struct
    "gateway": ("plugins/asyncrl-gateway", "asyncrl_gateway/config.py", "GatewayConfig",
                "the OpenAI-compatible gateway (docs/gateway.md)"),
}


SAMPLERS = {
    "InOrderConfig": "in_order", "GatedConfig": "gated", "OversampledConfig": "oversampled",
    "ReadyFirstConfig": "ready_first",
}


def _default(value: ast.expr | None) -> str:
    """A field's default as written, or what a ``msgspec.field(default_factory=lambda: X)``
    makes (``X``)."""
    if value is None:
        return "(required)"
    if isinstance(value, ast.Call):
        for kw in value.keywords:
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                return ast.unparse(kw.value.body)
    return ast.unparse(value)


def fields(cls: ast.ClassDef) -> list[tuple[str, str, str]]:
    out, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if ast.unparse(node.annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue  # a class attribute (a section's HARMLESS), not a key
            default = _default(node.value)
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                doc = " ".join(str(nxt.value.value).split())
            out.append((node.target.id, default, doc))
    return out


def section_classes() -> dict[str, ast.ClassDef]:
    """Every section struct of asyncrl/config/, by class name.

    Raises:
        SystemExit: a section of :data:`SECTIONS` is in no module, or in two.
    """
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(CONFIG.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in SECTIONS:
                if node.name in found:
                    raise SystemExit(f"{node.name} is defined twice under {CONFIG}")
                found[node.name] = node
    missing = sorted(set(SECTIONS) - set(found))
    if missing:
        raise SystemExit(f"no module under {CONFIG} defines {', '.join(missing)}")
    return found


def render() -> str:
    """The reference page as it should read for the current asyncrl/config/ modules."""
    classes = section_classes()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the section structs in `asyncrl/config/` (and the first-party services' "
        "sections from their plugins) by `scripts/gen_config_docs.py`.",
        "Unknown keys are errors; relative paths resolve against the config file's directory.",
        "Backend and environment `options` tables are validated by the plugin (see "
        "docs/backends/).",
        "`[jobs.<name>]` tables make a run of jobs, each its settings over the run's in the "
        "sections below a job may set (docs/jobs.md).",
        "",
    ]
    for name, section in SECTIONS.items():
        lines += [f"## `[{section}]`", ""]
        lines += table(classes[name])
        if name == "PipelineConfig":
            lines += sampler_sections()
    return "\n".join(lines + service_sections())


def service_sections() -> list[str]:
    """The services' sections: a service's plugin owns its table (docs/plugins.md, "A
    service's section"); the first-party ones are listed here, each under its plugin's name."""
    lines = [
        "## Services' sections",
        "",
        "A service (an `asyncrl.services` plugin) owns the top-level table of its name: the "
        "plugin defines and checks its keys, and documents them. A table that is neither a "
        "section above nor an installed service's is an error. The first-party services' "
        "sections follow, generated from their plugins.",
        "",
    ]
    for section, (dist, module, cls, what) in SERVICES.items():
        path = ROOT / dist / module
        [node] = [n for n in ast.parse(path.read_text()).body
                  if isinstance(n, ast.ClassDef) and n.name == cls]  # fmt: skip
        lines += [f"### `[{section}]`: the `{Path(dist).name}` plugin's section", "",
                  f"The section of {what}, defined in `{dist}/{module}` (`{cls}`); without "
                  f"the plugin installed the table is refused with the command that installs "
                  "it.", ""]  # fmt: skip
        lines += table(node)
    return lines


def table(node: ast.ClassDef) -> list[str]:
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for name, default, doc in fields(node):
        lines.append(f"| `{name}` | `{default}` | {doc} |")
    return lines + [""]


def sampler_sections() -> list[str]:
    """One table per built-in sampler (docs/modes.md says which mode each one is)."""
    tree = ast.parse((ROOT / "asyncrl/policy/samplers.py").read_text())
    lines: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in SAMPLERS:
            doc = " ".join((ast.get_docstring(node) or "").split())
            heading = f'### `[pipeline.sampler]` with `name = "{SAMPLERS[node.name]}"`'
            lines += [heading, "", doc, ""]
            lines += table(node)
    return lines


def main() -> None:
    (ROOT / "docs/configuration.md").write_text(render())


if __name__ == "__main__":
    main()
