"""The gateway tests' model: a Qwen2.5 chat template with tools (each assistant turn inside
``{% generation %}``) and a small byte-level BPE tokenizer trained here on random text, so
that nothing is downloaded. A copy of the pieces of the core's chat-template test helpers
(tests/unit/trajectory_support.py and chat_support.py) that the gateway's tests use, so that
this distribution's tests run on its own install, without the repository's tests/.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

QWEN_TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": "
        "<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- DEFAULT_SYSTEM }}
{%- endif %}
"""

QWEN_TOOL_RESULT = """\
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
"""

QWEN25 = (
    QWEN_TOOLS.replace(
        "DEFAULT_SYSTEM",
        "'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\\n'",
    )
    + """\
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
"""
    + QWEN_TOOL_RESULT
    + "{%- endif %}\n"
)

_QWEN_EXTRA = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<|endoftext|>"]


@dataclass(frozen=True)
class Family:
    """A template and what the tests need to know about it."""

    name: str
    template: str
    tokens: dict[str, Any]
    end: str
    """The end-of-turn token the engine generates (and the template writes)."""
    extra_ends: tuple[str, ...] = ()
    specials: tuple[str, ...] = ()
    nfc: bool = False


QWEN25_FAMILY = Family("qwen25", QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                       "<|im_end|>", ("<|endoftext|>",), tuple(_QWEN_EXTRA), nfc=True)

TOOLS = [
    {"type": "function", "function": {
        "name": "calc", "description": "Evaluate an arithmetic expression, e.g. 12*(3+4).",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                       "required": ["expr"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Look a word up (any language: 東京, café, 😀).",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}},
]

# text pieces: ASCII words and symbols, CJK, emoji (modifiers and ZWJ sequences), combining
# marks (decomposed: NFC tokenizers compose them), whitespace of several kinds; no piece, nor
# two side by side, spells a special token ('<' and '[' only with what follows them here)
_PIECES = [
    "the", "answer", "is", "tool", "sum", "of", "Hello", "world", "Okay", "let", "me",
    "thinking", "42", "3.14", "-7", "1e9", "x=", "(a+b)", "*", "=", ",", ".", "?", "!", ":",
    ";", '"q"', "'s", "{", "}", "[x]", "a<b", "c>d", "/", "&", "#", "%", "_", "\\", "`code`",
    "東京", "中文字", "こんにちは", "한국어", "数学", "😀", "🎉", "👍🏽", "👩‍💻", "🇫🇷",
    "e\u0301", "a\u0308", "n\u0303o", "\u0915\u094d\u0937", "café", "naïve", "Ω", "ß", "ﬁ",
    " ", " ", " ", "  ", "\n", "\n\n", "\t", "\u00a0",
]


# code points mostly unseen by the tokenizers: byte-level tokens, so a cut may split a character
_RARE = [(0x4E00, 0x9FFF), (0x1F300, 0x1F5FF), (0x0400, 0x04FF), (0x0E00, 0x0E5B)]


def random_text(rng: random.Random, lo: int = 0, hi: int = 24) -> str:
    """A random text of pieces (a word, a symbol, now and then a rare character), each
    followed by a space or not."""
    out = []
    for _ in range(rng.randint(lo, hi)):
        if rng.random() < 0.1:
            first, last = rng.choice(_RARE)
            out.append(chr(rng.randint(first, last)))
        else:
            out.append(rng.choice(_PIECES))
        if rng.random() < 0.5:
            out.append(" ")
    return "".join(out)


def corpus(seed: int = 0, n: int = 400) -> list[str]:
    """Texts to train a tokenizer on (so that pieces merge into multi-byte tokens)."""
    rng = random.Random(seed)
    return [random_text(rng, 4, 40) for _ in range(n)] + [json.dumps(TOOLS, ensure_ascii=False)]


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
