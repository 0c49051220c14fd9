"""Write the arithmetic demo's problems as JSONL files, one ``{"question", "answer"}`` per line:

    python examples/jsonl_arith/make_data.py runs/jsonl-arith/data

``train.jsonl`` and ``eval.jsonl`` hold the ``arithmetic`` environment's train and eval splits
for seed 0 and its default options: the same problems the tiny model's warm start left out of
its training (so the held-out accuracy means the same as in the demo). Any JSONL of your own
works the same way with ``environment.name = "dataset"``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl_arith.env import make_environment


def main(out: str) -> None:
    env = make_environment({}, seed=0)
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        with open(dest / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for p in env.dataset(split):
                f.write(json.dumps({"question": p.text, "answer": p.answer}) + "\n")
    print(dest)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/jsonl-arith/data")
