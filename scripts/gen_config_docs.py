"""Write docs/configuration.md from the field docstrings in asyncrl/config.py.

    .venv/bin/python scripts/gen_config_docs.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {
    "RunConfig": "run", "ModelConfig": "model", "ClusterConfig": "cluster", "GRPOConfig": "grpo",
    "LossConfig": "loss", "PipelineConfig": "pipeline", "InOrderSamplerConfig": "pipeline.sampler",
    "RefitConfig": "refit", "TrainerConfig": "trainer", "GeneratorConfig": "generator",
    "EnvironmentConfig": "environment", "EvalConfig": "eval",
}


def fields(cls: ast.ClassDef) -> list[tuple[str, str, str]]:
    out, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default = ast.unparse(node.value) if node.value is not None else "(required)"
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                doc = " ".join(str(nxt.value.value).split())
            out.append((node.target.id, default, doc))
    return out


def render() -> str:
    """The reference page as it should read for the current asyncrl/config.py."""
    tree = ast.parse((ROOT / "asyncrl/config.py").read_text())
    lines = [
        "# Configuration reference",
        "",
        "Generated from `asyncrl/config.py` by `scripts/gen_config_docs.py`. Unknown keys are",
        "errors; relative paths resolve against the config file's directory. Backend and",
        "environment `options` tables are validated by the plugin (see docs/backends/).",
        "",
    ]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in SECTIONS:
            lines += [f"## `[{SECTIONS[node.name]}]`", ""]
            if node.name == "InOrderSamplerConfig":
                lines += ['`name = "in_order"` selects this sampler.', ""]
            lines += ["| key | default | meaning |", "| --- | --- | --- |"]
            for name, default, doc in fields(node):
                lines.append(f"| `{name}` | `{default}` | {doc} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    (ROOT / "docs/configuration.md").write_text(render())


if __name__ == "__main__":
    main()
