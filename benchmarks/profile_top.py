"""Where a process's time went, from py-spy's raw output (``py-spy record --format raw``:
one line per distinct stack, ``frame;frame;... count``): the functions that were on the stack
(inclusive) and at its top (self), as shares of all samples.

Usage: ``python benchmarks/profile_top.py run.txt [--role engine-core] [--top 40]
[--match scheduler,logprob]`` (``--role``: one process's stacks, see :data:`ROLES`;
``--match``: also list every function whose frame contains one of these words). For a whole
run with its subprocesses: ``py-spy record --subprocesses --format raw -o run.txt -- python
...`` (benchmarks/gpu/profile_generation.sh).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: a function counts once per stack,
    whichever of its lines was running."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].rsplit(':', 1)[0]})" if where else name


ROLES = {
    "engine-core": "EngineCoreProc.",  # vLLM's engine core (scheduler; the model too with one GPU)
    "worker": "WorkerProc.",  # a worker process of vLLM's multiprocess executor
}
"""``--role``: a stack is that process's when one of its frames contains the marker;
``front`` is the launched process itself (vLLM's front end, the client)."""


def role_of(frames: list[str]) -> str:
    for role, marker in ROLES.items():
        if any(marker in f for f in frames):
            return role
    return "front" if sum(f.startswith("process ") for f in frames) <= 1 else "other"


def tally(
    path: Path, role: str = ""
) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Samples, and per function the samples with it on the stack and at its top, of the
    stacks of ``role`` (all when empty). ``py-spy --subprocesses`` puts each process as a
    frame (``process <pid>:"<cmdline>"``) above its stack; those frames are left out."""
    total, inclusive, top = 0, collections.Counter[str](), collections.Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if role and role_of(frames) != role:
            continue
        n = int(count)
        names = [frame_name(f) for f in frames if not f.startswith("process ")]
        if not names:
            continue
        total += n
        top[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    return total, inclusive, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--match", default="")
    parser.add_argument("--role", choices=["", *ROLES, "front", "other"], default="")
    args = parser.parse_args()
    total, inclusive, top = tally(args.raw, args.role)
    if not total:
        raise SystemExit(f"{args.raw}: no samples{f' of {args.role}' if args.role else ''}")
    print(f"{total} samples{f' of {args.role}' if args.role else ''}")
    print("-- on the stack (inclusive)")
    for name, n in inclusive.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {name}")
    print("-- at the top (self)")
    for name, n in top.most_common(args.top // 2):
        print(f"{100 * n / total:5.1f}%  {name}")
    words = [w for w in args.match.split(",") if w]
    if words:
        print(f"-- frames containing {', '.join(words)}")
        for name, n in inclusive.most_common():
            if any(w.lower() in name.lower() for w in words):
                print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
