#!/usr/bin/env bash
# On the GPU host (no vLLM needed; carry .whl-trainer): the trainer's memory peak against the
# model's shape and the micro-batch, the measurements a memory plan is fitted to. For each
# Qwen2.5 shape given, an FSDP2 step (bf16 compute, float32 master weights, AdamW) of 8
# sequences of SEQ_LEN tokens (256 of prompt) at micro-batches of 1 and 4 sequences: the
# difference is the activations of 3 sequences, the rest what does not grow with the batch.
#   bash benchmarks/gpu/run_memory.sh full 0.5b,1.5b,3b     # full fine-tuning
#   bash benchmarks/gpu/run_memory.sh lora 3b,7b            # rank-32 adapters
#   CKPT=1 bash benchmarks/gpu/run_memory.sh full 1.5b      # with activation checkpointing
# Rows go to $OUT/memory.jsonl (benchmarks/trainer.py's, with peak and reserved GiB).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh  # the carried wheels, the checkout's plugins on the path
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
kind=$1; shapes=$2; seq_len=${SEQ_LEN:-1024}
lora=0; [ "$kind" = lora ] && lora=32
for shape in ${shapes//,/ }; do
  for mb in 1 4; do
    timeout ${LIMIT:-300} python3 benchmarks/trainer.py --cases fsdp2 --shape "$shape" \
      --lora "$lora" --seqs 8 --seq-len "$seq_len" --prompt-len 256 --micro-batch-size "$mb" \
      --steps 2 --warmup 1 ${CKPT:+--checkpointing} --out "$OUT/memory.jsonl" 2>&1 | grep -E "GPU |failed|Error" | cut -c1-300
  done
  rm -rf "/tmp/asyncrl-bench-qwen2-$shape-all"  # the next shape needs the disk
done
