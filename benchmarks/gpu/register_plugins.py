"""Make this checkout's distributions visible to importlib.metadata without pip.

For hosts where the packages cannot be pip-installed (no network, no build backend): writes a
minimal ``<name>-<version>.dist-info`` (METADATA + entry_points.txt) for every pyproject.toml
of the repo into TARGET, and prints the PYTHONPATH entries that make the code importable.

    python benchmarks/gpu/register_plugins.py /tmp/site
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def register(tree: Path, target: Path) -> list[str]:
    """Write the dist-infos of ``tree``'s projects into ``target``; return the folders to put
    on ``PYTHONPATH`` (each project's root, where its package lives)."""
    target.mkdir(parents=True, exist_ok=True)
    paths = []
    for pyproject in [tree / "pyproject.toml", *sorted(tree.glob("backends/*/pyproject.toml")),
                      *sorted(tree.glob("plugins/*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        name, version = project["name"], project["version"]
        info = target / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, eps in project.get("entry-points", {}).items():
            lines.append(f"[{group}]")
            lines += [f"{k} = {v}" for k, v in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        paths.append(str(pyproject.parent))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the folder to write the dist-infos into (e.g. /tmp/site)")
    print(":".join(register(ROOT, Path(parser.parse_args().target))))


if __name__ == "__main__":
    main()
