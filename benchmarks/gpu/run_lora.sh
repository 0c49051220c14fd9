#!/usr/bin/env bash
# [lora] on the GPU host, after vLLM 0.26 was staged into /tmp/site (shared/gpu/README.md).
# Results under $OUT.
#   bash benchmarks/gpu/run_lora.sh refit [ARGS]   # benchmarks/lora_refit.py (ARGS: its own)
#   bash benchmarks/gpu/run_lora.sh run [ARGS]     # a LoRA run of an 8B-shaped model (Qwen3-8B's
#       layers, the arithmetic task's vocabulary, random weights) with trainer and engine on
#       GPU 0: its first steps, refit times and the GPU's peak memory (ARGS: --set overrides)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
part=${1:-refit}
shift || true
source benchmarks/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "$part" in
  refit)
    timeout ${LIMIT:-560} python3 benchmarks/lora_refit.py --out "$OUT/lora_refit.jsonl" "$@" \
      > "$OUT/lora_refit.log" 2>&1
    echo "lora_refit rc=$?"
    grep -E "lora r|  full|started in|Error|error" "$OUT/lora_refit.log" | cut -c1-260 | tail -30
    ;;
  run)
    model=/tmp/asyncrl-lora-8b
    # the 8B-shaped weights of benchmarks/lora_refit.py (written there first, or here), with
    # the arithmetic task's tokenizer and token ids (its vocabulary fits in the embedding)
    python3 - "$model" <<'EOF' || exit 1
import json, os, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, "benchmarks")
import refit
from asyncrl_arith.model import build_model
out = Path(sys.argv[1])
if not (out / "config.json").is_file():
    weights = refit.write_model("8b", Path("/tmp/asyncrl-refit-bench"), "cuda:0")
    tiny = build_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    out.mkdir(parents=True)
    for f in tiny.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    os.symlink(weights / "model.safetensors", out / "model.safetensors")
    small, big = (json.loads((d / "config.json").read_text()) for d in (tiny, weights))
    big.update({k: small[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in small})
    (out / "config.json").write_text(json.dumps(big))
    print("8B-shaped model ready", flush=True)
EOF
    python3 -m asyncrl check-config examples/lora_8b_one_gpu.toml --config-only \
      --set "model.path=\"$model\"" | tail -2 | tee "$OUT/check.txt"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/memory.csv" &
    smi=$!
    start=$(date +%s)
    timeout ${LIMIT:-420} python3 -m torch.distributed.run --nproc-per-node 2 -m asyncrl.launch \
      examples/lora_8b_one_gpu.toml --set "model.path=\"$model\"" \
      --set 'run.output_dir="/tmp/lora-8b-run"' "$@" > "$OUT/run.log" 2>&1
    rc=$?
    kill $smi
    echo "run rc=$rc wall=$(( $(date +%s) - start ))s; GPU memory peak $(sort -n "$OUT/memory.csv" | tail -1) MiB" | tee -a "$OUT/gpus.txt"
    cp /tmp/lora-8b-run/metrics.jsonl "$OUT/" 2>/dev/null
    cp /tmp/lora-8b-run/logs/rollout-0.log "$OUT/" 2>/dev/null
    grep -E "trainer_backend_started|step_finished|refit_verified|eval_finished|rror" "$OUT/run.log" | cut -c1-260 | tail -14
    grep -o '"add_s[^}]*' "$OUT/rollout-0.log" | tail -3
    ;;
esac
