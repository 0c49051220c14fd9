"""Model directories for chat-template tests, built here: nothing is downloaded.

A directory holds a small byte-level BPE ``tokenizer.json`` trained on a given corpus, with
the template's special tokens, and a ``tokenizer_config.json`` that
``transformers.AutoTokenizer.from_pretrained`` loads (the tests' reference).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

# the special tokens a template spells out: <|...|>, [INST], [/TOOL_RESULTS], <start_of_turn>...
SPECIAL = re.compile(r"<\|[^|\s]+?\|>|\[/?INST\]")


def token_text(token: Any) -> str | None:
    """A special token as saved: its text, or an AddedToken dict's ``content``."""
    return token["content"] if isinstance(token, dict) else token


def model_dir(
    path: Path,
    template: Any,
    tokens: Mapping[str, Any],
    *,
    corpus: Iterable[str],
    where: str = "config",
    extra_config: Mapping[str, Any] | None = None,
    specials: Iterable[str] = (),
    nfc: bool = False,
    vocab_size: int = 600,
) -> Path:
    """A model directory: tokenizer.json (byte-level BPE trained on ``corpus`` and the
    template; BOS added to plain text by the post-processor when there is one; an NFC
    normalizer, as Qwen's, with ``nfc``) and tokenizer_config.json; the template in
    tokenizer_config.json (``where="config"``) or in chat_template.jinja (``"jinja"``).
    The special tokens are the named ones in ``tokens``, those ``SPECIAL`` finds in the
    template, and ``specials``."""
    path.mkdir(parents=True, exist_ok=True)
    source = template if isinstance(template, str) else json.dumps(template)
    named = [t for t in (token_text(v) for v in tokens.values()) if t]
    all_specials = sorted({*named, *SPECIAL.findall(source), *specials})
    tok = HFTokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=all_specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*corpus, source, "system user assistant Answer Question"], trainer)
    bos = token_text(tokens.get("bos_token"))
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **tokens,
    }
    config.update(extra_config or {})
    if where == "config":
        config["chat_template"] = template
    else:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path
