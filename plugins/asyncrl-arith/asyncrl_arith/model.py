"""Build the tiny local Qwen2-architecture model and its character-level tokenizer.

Nothing is downloaded: the vocabulary is fixed here, the weights are random (seeded), and a
short supervised warm start (:mod:`asyncrl_arith.sft`) can give RL a signal to improve on.
The directory loads in transformers and in vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=?: ") + list("abcdefghijklmnopqrstuvwxyz") + list(".,()")
VOCAB = SPECIAL + CHARS
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def build_tokenizer():
    """A WordLevel tokenizer over single characters, wrapped as a fast HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character is its own token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen2 model + tokenizer to ``out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **TINY,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
