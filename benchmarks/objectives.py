"""The CPU demo under each policy-optimization setting: what it learns and what it costs.

    .venv/bin/python benchmarks/objectives.py                        # ~3 min on 2 cores
    .venv/bin/python benchmarks/objectives.py --only kl_mini_decoupled --steps 30
    .venv/bin/python benchmarks/objectives.py --machine 2core         # keep the figures

Each setting runs ``examples/tiny_arith.toml`` (one FSDP2 rank, one vLLM CPU rank, tiny
Qwen2, 2-digit addition) for ``--steps`` steps from the same model and seed, through the
real controller (``asyncrl run``). The table gives the evaluation accuracy before and after
(200 held-out prompts), the mean training reward of the first and last five steps, the
median step time and trainer time, the median time of each logprob refresh per step, the KL
to the reference over the last five steps, and the trainer/generator mismatch (mean k3 per
token). Per-step curves go to the results file (``benchmarks/results_file.py`` says where).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from results_file import ROOT, write_results  # noqa: E402

SETTINGS: dict[str, list[str]] = {
    "baseline": [],
    "kl_mini_decoupled": ["loss.kl_coef=0.05", "loss.kl_estimator=k3", "grpo.mini_steps=2",
                          "loss.proximal_policy=current"],  # fmt: skip
    "kl_in_reward": ["loss.kl_coef=0.05", "loss.kl_in=reward", "loss.kl_estimator=k1"],
    "epochs2_gspo": ["grpo.update_epochs=2", "loss.ratio_level=sequence",
                     "loss.proximal_policy=current"],  # fmt: skip
}


def run(name: str, sets: list[str], steps: int, model: Path, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "asyncrl", "run", str(ROOT / "examples" / "tiny_arith.toml"),
               "--set", f"model.path={model}", "--set", f"run.output_dir={out}",
               "--set", f"run.num_steps={steps}", "--set", "run.log_format=json"]  # fmt: skip
    for item in sets:
        command += ["--set", item]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps_ if key in r]
        return statistics.median(values) if values else None

    last = steps_[-5:]
    return {
        "setting": name, "overrides": sets,
        "eval_start": evals[0]["accuracy"], "eval_end": evals[-1]["accuracy"],
        "reward_first5": statistics.mean(r["reward"] for r in steps_[:5]),
        "reward_last5": statistics.mean(r["reward"] for r in last),
        "step_s_median": statistics.median(b["time"] - a["time"] for a, b in zip(steps_, steps_[1:])),
        "train_s_median": median("train_s"),
        "refresh_proximal_s_median": median("refresh_proximal_s"),
        "refresh_reference_s_median": median("refresh_reference_s"),
        "kl_ref_last5": statistics.mean(r["kl_ref"] for r in last) if "kl_ref" in last[0] else None,
        "mismatch_k3_median": median("mismatch_k3"),
        "curve": [{k: r.get(k) for k in ("step", "reward", "kl_ref", "mismatch_k3",
                                          "logprob_diff_max", "refresh_proximal_s",
                                          "refresh_reference_s", "train_s")}
                  for r in steps_],
    }  # fmt: skip


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", nargs="*", choices=sorted(SETTINGS), default=None)
    parser.add_argument("--machine", default="", help="keep the results as benchmarks/results/objectives-<machine>.json")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-m", "asyncrl_arith.make_model", str(model)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for name in args.only or list(SETTINGS):
            results.append(run(name, SETTINGS[name], args.steps, model, Path(tmp) / name))
            print(f"{name}: done", flush=True)
    cols = ["setting", "eval_start", "eval_end", "reward_first5", "reward_last5", "step_s_median",
            "train_s_median", "refresh_proximal_s_median", "refresh_reference_s_median",
            "kl_ref_last5", "mismatch_k3_median"]  # fmt: skip
    print("\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(fmt(r[c]) for c in cols) + " |")
    write_results({"steps": args.steps, "results": results}, "objectives", args.out, args.machine)


if __name__ == "__main__":
    main()
