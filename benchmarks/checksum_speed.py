"""What the checksums of a checkpoint cost on this machine.

    .venv/bin/python benchmarks/checksum_speed.py [--files 4] [--file-mb 256] [--out FILE]

Measured, best of three each:

* ``hashlib`` in memory, 1 MiB updates: SHA-256 (what the manifests use) against the
  standard library's other digests (BLAKE2b is often the faster one in software; with SHA
  extensions in the CPU, SHA-256 is);
* :func:`asyncrl.checkpoints.checksums.seal_tree` (hash + fsync, several files at once, as a save commits)
  and :func:`asyncrl.checkpoints.checksums.verify_tree` (as a resume checks) over ``--files`` files of
  ``--file-mb`` MiB in a temporary directory (page cache warm: the bytes were just written, as
  a checkpoint's are when it commits; a resume after a reboot reads from the disk instead);
* the train split's fingerprint (:mod:`asyncrl.checkpoints.resume_rule`) for 100 000 short prompts.

Results: a table on stdout and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any


def _checksums() -> Any:
    """``asyncrl/checkpoints/checksums.py`` by its path: it needs the standard library alone, so the
    measurement also runs on a host without asyncrl's dependencies."""
    import importlib.util

    path = Path(__file__).parents[1] / "asyncrl" / "checksums.py"
    spec = importlib.util.spec_from_file_location("asyncrl_checksums", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _best(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def in_memory(size: int) -> dict[str, float]:
    data = os.urandom(size)
    view = memoryview(data)
    out = {}
    for name in ("sha256", "blake2b", "sha1", "sha512", "md5", "sha3_256"):

        def run(name: str = name) -> None:
            h = hashlib.new(name)
            for i in range(0, size, 1 << 20):
                h.update(view[i : i + (1 << 20)])

        out[name] = round(size / _best(run) / 1e6)
    return out


def on_files(num: int, mb: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="asyncrl-checksum-") as tmp:
        root = Path(tmp)
        for i in range(num):
            (root / f"__{i}_0.distcp").write_bytes(os.urandom(mb << 20))
        total = num * (mb << 20)
        listed: dict[str, Any] = {}

        checksums = _checksums()

        def seal() -> None:
            listed.update(checksums.seal_tree(root))

        seal_s = _best(seal)
        verify_s = _best(lambda: checksums.verify_tree(root, listed))
        assert checksums.verify_tree(root, listed) == []
    return {"files": num, "bytes": total, "seal_MBps": round(total / seal_s / 1e6),
            "verify_MBps": round(total / verify_s / 1e6)}  # fmt: skip


def data_fingerprint(num: int = 100_000) -> dict[str, Any] | None:
    try:
        from asyncrl.environment import Prompt
        from asyncrl.checkpoints.resume_rule import _data_digest
    except ImportError:  # a host without asyncrl's dependencies
        return None
    prompts = [Prompt(id=f"p{i}", text=f"What is {i} + {i % 97}?", answer=i + i % 97)
               for i in range(num)]  # fmt: skip
    return {"prompts": num, "seconds": round(_best(lambda: _data_digest(prompts)), 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=256)
    parser.add_argument("--out", default="runs/benchmarks/checksum-speed.json")
    args = parser.parse_args()
    report = {
        "host": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                 "sha_ni": "sha_ni" in _flags(),
                 "loadavg_at_start": os.getloadavg()[0]},  # fmt: skip
        "in_memory_MBps": in_memory(256 << 20),
        "tree": on_files(args.files, args.file_mb),
        "data_fingerprint": data_fingerprint(),
    }
    for name, rate in report["in_memory_MBps"].items():
        print(f"{name:10s} {rate:6d} MB/s in memory")
    tree = report["tree"]
    print(f"seal_tree   {tree['seal_MBps']:6d} MB/s ({tree['files']} files, hash + fsync)")
    print(f"verify_tree {tree['verify_MBps']:6d} MB/s")
    data = report["data_fingerprint"]
    if data is not None:
        print(f"data fingerprint: {data['prompts']} prompts in {data['seconds']} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _cpu() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _flags() -> set[str]:
    for line in _cpuinfo():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    raise SystemExit(main())
