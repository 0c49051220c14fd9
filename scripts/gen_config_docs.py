"""Write docs/configuration.md from the field docstrings of the section structs in asyncrl/config/
(one module per theme; and, for the built-in samplers' ``[pipeline.sampler]`` knobs,
asyncrl/policy/samplers.py).

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
    "RefitConfig": "refit", "TrainerConfig": "trainer", "GeneratorConfig": "generator",
    "EnvironmentConfig": "environment", "EvalConfig": "eval",
    "CheckpointConfig": "checkpoint", "ExportConfig": "export", "FailuresConfig": "failures",
    "MetricsConfig": "metrics", "EpisodeConfig": "episode", "GatewayConfig": "gateway",
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
        "Generated from the section structs in `asyncrl/config/` by `scripts/gen_config_docs.py`.",
        "Unknown keys are errors; relative paths resolve against the config file's directory.",
        "Backend and environment `options` tables are validated by the plugin (see "
        "docs/backends/).",
        "",
    ]
    for name, section in SECTIONS.items():
        lines += [f"## `[{section}]`", ""]
        lines += table(classes[name])
        if name == "PipelineConfig":
            lines += sampler_sections()
    return "\n".join(lines)


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
