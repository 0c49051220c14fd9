"""Turn GSM8K (or any dataset in its shape) into the JSONL files ``run.toml`` reads:

    pip install datasets
    python examples/gsm8k_qwen/prepare.py data/gsm8k            # downloads openai/gsm8k
    python examples/gsm8k_qwen/prepare.py data/gsm8k --from DIR # a save_to_disk copy instead

Each line is ``{"question": ..., "answer": "<the final number>", "solution": ...}``: GSM8K's
answers end with ``#### <number>``; the number alone is what the reward compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def final_number(solution: str) -> str:
    """``"... #### 1,234"`` -> ``"1234"``."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--from", dest="source", default=None,
                        help="a datasets.save_to_disk directory instead of the Hub")
    args = parser.parse_args()
    import datasets

    data = (datasets.load_from_disk(args.source) if args.source
            else datasets.load_dataset("openai/gsm8k", "main"))
    args.out.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.jsonl"), ("test", "test.jsonl")):
        with open(args.out / name, "w", encoding="utf-8") as f:
            for row in data[split]:
                f.write(json.dumps({"question": row["question"],
                                    "answer": final_number(row["answer"]),
                                    "solution": row["answer"]}) + "\n")
        print(args.out / name, len(data[split]))


if __name__ == "__main__":
    main()
