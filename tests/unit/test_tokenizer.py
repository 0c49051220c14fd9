"""The controller's tokenizer never pads or truncates prompts, whatever tokenizer.json says."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from asyncrl.data.prompts import Tokenizer as PromptTokenizer

VOCAB = ["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789+="]


def _tokenizer_json(path: Path, *, padded: bool) -> Path:
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    if padded:  # what save_pretrained leaves behind after a padded, truncated batch
        tok.enable_padding(direction="left", pad_id=0, pad_token="<pad>")
        tok.enable_truncation(max_length=4)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_prompts_are_never_padded_or_truncated(tmp_path: Path, padded: bool) -> None:
    path = _tokenizer_json(tmp_path, padded=padded)
    with structlog.testing.capture_logs() as logs:
        tok = PromptTokenizer(str(path), eos_token_id=2)
    # hand-computed: <bos> then one id per character
    assert tok.encode_batch(["97+70=", "1+2="]) == [
        [1, 13, 11, 14, 11, 4, 15],
        [1, 5, 14, 6, 15],
    ]
    warned = [e for e in logs if e["event"] == "tokenizer_settings_ignored"]
    assert (warned[0]["settings"] if warned else []) == (["padding", "truncation"] if padded else [])


def test_decode_drops_eos_and_special_tokens(tmp_path: Path) -> None:
    tok = PromptTokenizer(str(_tokenizer_json(tmp_path, padded=False)), eos_token_id=2)
    assert tok.decode([5, 14, 6, 2]) == "1+2"
    assert tok.decode([1, 5, 0, 2]) == "1"
