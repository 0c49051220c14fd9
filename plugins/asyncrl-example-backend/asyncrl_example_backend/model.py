"""The bigram model: a ``[V, V]`` logits table and the numpy math both roles share.

Row ``p`` of the table holds the logits of the token that follows token ``p``. Everything here
is pure numpy and deterministic; generation and training call the same functions, so the
trainer's logprobs equal the generator's up to float32 rounding of the table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncrl.plugin.backend import Layout, TokenBatch
from asyncrl.plugin.common import ConfigError

__all__ = [
    "TENSOR_NAME",
    "ModelSpec",
    "initial_table",
    "log_softmax",
    "response_tokens",
    "token_logprobs",
]

TENSOR_NAME = "bigram.logits"
"""The one tensor of the model, as named in refit buckets."""


@dataclass(frozen=True)
class ModelSpec:
    """What ``config.json`` says about the model."""

    vocab_size: int
    eos_token_id: int | None
    init_std: float = 1.0
    """``bigram_init_std`` in ``config.json``: scale of the seeded initial logits."""

    @classmethod
    def read(cls, model_path: str) -> ModelSpec:
        path = os.path.join(model_path, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.path: cannot read {path}: {exc}") from None
        vocab = cfg.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 2:
            raise ConfigError(f"model.path: {path} needs an integer vocab_size >= 2, got {vocab!r}")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):  # Hugging Face allows several; the first one stops generation
            eos = eos[0] if eos else None
        return cls(vocab, None if eos is None else int(eos), float(cfg.get("bigram_init_std", 1.0)))


def initial_table(model_path: str, seed: int) -> np.ndarray:
    """The starting weights: ``<model_path>/bigram.npy`` if present, else a seeded draw.

    Both roles call this with the same arguments (``model.path``, ``run.seed``), which is what
    makes the trainer's and the generators' version-0 weights identical.
    """
    spec = ModelSpec.read(model_path)
    v = spec.vocab_size
    path = os.path.join(model_path, "bigram.npy")
    if os.path.exists(path):
        table = np.load(path, allow_pickle=False)  # never unpickle a model file
        if table.shape != (v, v):
            raise ConfigError(f"model.path: {path} has shape {table.shape}, expected ({v}, {v})")
        return np.ascontiguousarray(table, dtype=np.float32)
    rng = np.random.default_rng([seed, v])
    return (rng.standard_normal((v, v)) * spec.init_std).astype(np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def response_tokens(batch: TokenBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(prev, tok, seq)`` for every response token of ``batch``, in batch order.

    ``tok`` is a response token, ``prev`` the token before it (the bigram's context) and
    ``seq`` the index of its sequence. The order matches the flat ``behaviour_logprobs``.
    """
    seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
    prompt_lens = np.asarray(batch.prompt_lens, dtype=np.int64)
    if np.any((prompt_lens < 1) & (seq_lens > prompt_lens)):
        raise ValueError("every sequence needs at least one prompt token (the bigram's context)")
    layout = Layout.of(seq_lens, prompt_lens)
    seq = np.repeat(np.arange(layout.num_sequences), layout.response_lens)
    pos = layout.response_positions()
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    return tokens[pos - 1], tokens[pos], seq


def token_logprobs(
    table: np.ndarray, prev: np.ndarray, tok: np.ndarray, temperature: float
) -> np.ndarray:
    """``log softmax(table[prev] / T)[tok]`` per token, float64."""
    if prev.size == 0:
        return np.zeros(0, np.float64)
    logp = log_softmax(np.asarray(table, dtype=np.float64)[prev] / temperature)
    return logp[np.arange(tok.size), tok]


def write_model_dir(path: Path) -> Path:
    """A bigram model directory: ``config.json`` + the arithmetic plugin's character-level
    ``tokenizer.json`` (built with ``tokenizers`` alone; no transformers import). Used by the
    integration tests and ``benchmarks/modes.py``."""
    from asyncrl_arith.model import BOS_ID, EOS_ID, PAD_ID, SPECIAL, VOCAB
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(SPECIAL)  # so decode(skip_special_tokens=True) drops them
    tok.save(str(path / "tokenizer.json"))
    config = {
        "model_type": "bigram",
        "vocab_size": len(VOCAB),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    # a message's content as it is, an assistant's followed by <eos>; no generation prompt, so
    # a turn's context ends with the last message's content (the repeat-digit-turns task)
    (path / "chat_template.jinja").write_text(
        "{%- for m in messages -%}{{ m.content }}{%- if m.role == 'assistant' -%}<eos>"
        "{%- endif -%}{%- endfor -%}"
    )
    return path
