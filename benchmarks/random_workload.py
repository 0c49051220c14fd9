"""The random model and the data that ``generation.py`` and ``modes.py`` (its ``vllm-long``
part) run on: a Qwen2-shaped checkpoint with random bf16 weights whose tokenizer maps the word
``t<i>`` to token ``i`` (a prompt's text and its token ids are the same thing both ways),
optionally with an EOS row that gives samples a chosen mean length and a long tail; random
prompts as the ``dataset`` environment's JSONL with a cheap reward; and the config sections
and engine options every run there shares."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

EOS = 2

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "tiny": (128, 2, 4, 2, 256, 512, True),
}


def write_model(
    size: str, out: Path, mean_len: float | None = None, max_len: int = 1024, prompt_len: int = 64
) -> Path:
    """A random bf16 Qwen2 checkpoint of ``size`` with the ``t<i>`` word-level tokenizer
    (kept across runs in ``out``). With ``mean_len``, EOS is made likely enough that samples
    of at most ``max_len`` tokens after ``prompt_len``-token prompts end after about
    ``mean_len`` tokens on average, with a long tail (:func:`eos_for_mean_length`). Its
    context (``max_position_embeddings``, vLLM's ``max_model_len``) is 4,096 tokens, or a
    prompt and ``max_len`` if longer."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (out / "tokenizer.json").is_file():
        return out
    h, n, heads, kv, inter, vocab, tied = SHAPES[size]
    config = transformers.Qwen2Config(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=max(4096, prompt_len + max_len), bos_token_id=1,
        eos_token_id=EOS, torch_dtype="bfloat16",
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in transformers.Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    state = {
        k: torch.ones(s, dtype=torch.bfloat16) if k.endswith("norm.weight")
        else (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
        for k, s in shapes.items()
    }  # fmt: skip
    if mean_len:
        model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        state[head][EOS] = eos_for_mean_length(
            model, mean_len, vocab, max_len, prompt_len
        ).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


def eos_for_mean_length(
    model: Any, mean_len: float, vocab: int, max_len: int, prompt_len: int, seqs: int = 16
) -> Any:
    """The output row of EOS (``c * v``, ``v`` a random unit vector) under which a sample of
    at most ``max_len`` tokens after a ``prompt_len``-token prompt has mean length
    ``mean_len``.

    The EOS logit is then ``c * (h . v)``: large at the few positions whose final hidden state
    leans on ``v`` and small elsewhere, and the other tokens keep the random model's
    near-uniform distribution, so a sampled continuation looks like random tokens. ``h . v``
    also carries an offset per sequence (the prompt's share of the context), so samples
    differ in how soon they are likely to stop: most end early, a few run long or reach
    ``max_len``: a long tail. Matching the mean *hazard* to ``1 / mean_len`` ignores that
    spread and gave a mean of 627 tokens for ``mean_len`` 150 with ``max_len`` 1024 (the
    H200 run of 2026-12-05); so ``c`` is found by bisection on the mean over ``seqs`` random
    sequences of each one's expected length, the sum over response positions of the
    probability that no EOS came before (float32 on the CPU, one sequence at a time)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    zs, rests = [], []
    v = torch.randn(model.config.hidden_size, generator=gen)
    v /= v.norm()
    with torch.no_grad():
        for _ in range(seqs):
            ids = torch.randint(3, vocab, (1, prompt_len + max_len - 1), generator=gen)
            hidden = model.model(input_ids=ids).last_hidden_state[0, prompt_len - 1 :]
            logits = model.lm_head(hidden)
            logits[:, EOS] = -torch.inf
            rests.append(torch.logsumexp(logits, dim=-1).double())  # every other token
            zs.append((hidden @ v).double())
    z, rest = torch.stack(zs), torch.stack(rests)  # (seqs, max_len): response positions

    def mean_length(c: float) -> float:
        hazard = torch.sigmoid(c * z - rest)  # exp(cz) / (exp(cz) + exp(rest))
        alive = torch.cumprod(1 - hazard, dim=1)  # no EOS up to and including each token
        before = torch.cat([torch.ones(seqs, 1, dtype=alive.dtype), alive[:, :-1]], dim=1)
        return before.sum(dim=1).mean().item()

    low, high = 0.0, 1e4  # mean_length falls from about max_len at c=0 as c grows
    for _ in range(100):
        c = (low + high) / 2
        low, high = (c, high) if mean_length(c) > mean_len else (low, c)
    return c * v


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(count)]


def write_dataset(prompts: list[list[int]], work: Path) -> tuple[Path, Path]:
    """The prompts as the ``dataset`` environment's JSONL, and a reward file (a completion's
    distinct-token fraction: cheap, but it decodes and reads every sample)."""
    data = work / "prompts.jsonl"
    with data.open("w") as f:
        for i, ids in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i}", "text": " ".join(f"t{t}" for t in ids)}) + "\n")
    rewards = work / "rewards.py"
    rewards.write_text(
        "def distinct(completion: str) -> float:\n"
        "    words = completion.split()\n"
        "    return len(set(words)) / max(1, len(words))\n"
    )
    return data, rewards


def cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def engine_options(gpu_memory_utilization: float, cpu_bind: str = "1") -> dict[str, Any]:
    """``generator.options`` of every engine here (the asyncrl names; modes.py's too): a
    share of the GPU, or on the CPU build 1 GiB of KV cache, the engine's OpenMP threads on
    ``cpu_bind`` and no compilation."""
    if cuda():
        return {"gpu_memory_utilization": gpu_memory_utilization}
    return {"cpu_kvcache_space_gib": 1, "cpu_omp_threads_bind": cpu_bind,
            "enforce_eager": True}  # fmt: skip


def run_sections(model: Path, data: Path, rewards: Path) -> dict[str, Any]:
    """The config sections every benchmark run here shares (modes.py's too): the model, one
    trainer and one rollout rank (both on GPU 0 where there is one), refits without
    verification, the ``dataset`` environment over ``data`` scored by ``rewards``, no eval."""
    gpu = cuda()
    return {
        "model": {"path": str(model)},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": 1}
        | ({"trainer_gpus": [0], "rollout_gpus": [0]} if gpu else {}),
        "refit": {"transport": "cuda_ipc" if gpu else "shm", "verify_every_steps": 0},
        "environment": {
            "name": "dataset",
            "options": {"train": str(data), "prompt_field": "text", "id_field": "id",
                        "rewards": [{"function": f"{rewards}:distinct", "weight": 1.0}]},
        },  # fmt: skip
        "eval": {"num_prompts": 0},
    }
