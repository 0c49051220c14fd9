"""Chat templates written here in the formats of real models (each assistant turn, content and
end token, inside ``{% generation %}`` so transformers can say where turns lie), and a
random episode generator, for ``test_trajectory.py``.

Each family says what its template does to earlier turns, as the real one does:

* ``chatml``: plain ChatML, any role, nothing rewritten.
* ``qwen25``: Qwen2.5 with tools (listed in the system turn; calls as ``<tool_call>`` JSON in
  the assistant text; results as ``<tool_response>`` inside one user turn per run of tool
  messages).
* ``qwen3``: Qwen3 with thinking: an assistant turn before the last user query loses its
  ``<think>...</think>`` reasoning.
* ``llama31``: Llama 3.1 (tools in the system turn, ``ipython``/``tool`` results as JSON,
  every message trimmed).
* ``mistral``: Mistral (``[SYSTEM_PROMPT]``, ``[INST]``, ``[TOOL_CALLS]``,
  ``[TOOL_RESULTS]``; ``[AVAILABLE_TOOLS]`` before the last user message; no generation
  prompt).
* ``gemma``: Gemma (``<start_of_turn>model``, no system role, roles alternate, trimmed).
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

QWEN3 = (
    QWEN_TOOLS.replace("{{- DEFAULT_SYSTEM }}", "")
    + """\
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not (message.content.startswith('<tool_response>')
                   and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                                               .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
"""
    + QWEN_TOOL_RESULT
    + """\
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

LLAMA31 = """\
{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, please respond "
        "with JSON for a function call. Respond in the format {\\"name\\": function name, "
        "\\"parameters\\": dictionary of argument name and its value}. Do not use "
        "variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- generation %}{{- message.content | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'
            + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- if tools is not none and loop.index0 == ns.last_user %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- generation %}{{- message.content + eos_token }}{%- endgeneration %}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]'
            + {"content": message.content, "call_id": message.tool_call_id} | tojson
            + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, assistant and tool roles after the system message') }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set first_user_prefix = messages[0].content + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/...") }}
    {%- endif %}
    {%- set role = "model" if message.role == 'assistant' else message.role %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if role == 'model' %}
        {%- generation %}{{- message.content | trim + '<end_of_turn>' }}{%- endgeneration %}
    {%- else %}
        {{- message.content | trim + '<end_of_turn>' }}
    {%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

CHATML = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
    {%- else %}
        {{- message.content + '<|im_end|>' }}
    {%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_QWEN_EXTRA = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<|endoftext|>"]


@dataclass(frozen=True)
class Family:
    """One template and what the tests need to know about it."""

    name: str
    template: str
    tokens: dict[str, Any]
    end: str
    """The end-of-turn token the engine generates (and the template writes)."""
    extra_ends: tuple[str, ...] = ()
    """Other stop tokens (the engine's EOS list)."""
    specials: tuple[str, ...] = ()
    nfc: bool = False
    tool_role: str | None = "tool"
    """The role of a tool result (``None``: results go back as user turns)."""
    trims: bool = False
    """Assistant content is written ``| trim``."""
    thinks: bool = False
    moves_tools: bool = False
    """The tool list sits before the last user message."""
    closer: dict[str, Any] = field(default_factory=dict)
    """A message the reference appends so the segment's last turn is not the last message
    (templates treat a last assistant message specially), one the family keeps unchanged."""

    def splits(self, contents: list[str], observation: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> bool:
        """Whether this template re-renders a segment with ``contents`` (its turns' texts)
        differently once ``observation`` follows: worked out by hand from the template."""
        user = any(m["role"] == "user" for m in observation)
        if self.thinks:  # reasoning before the last user query is dropped
            return user and any("</think>" in c for c in contents)
        if self.moves_tools:
            return user and tools is not None
        if self.trims:
            return any(c != c.strip() for c in contents)
        return False


FAMILIES = {
    f.name: f
    for f in [
        Family("chatml", CHATML, {"eos_token": "<|im_end|>"}, "<|im_end|>",
               closer={"role": "tool", "content": "end"}),
        Family("qwen25", QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
               "<|im_end|>", ("<|endoftext|>",), tuple(_QWEN_EXTRA), nfc=True,
               closer={"role": "tool", "content": "end"}),
        Family("qwen3", QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
               "<|im_end|>", ("<|endoftext|>",), tuple(_QWEN_EXTRA), nfc=True, thinks=True,
               closer={"role": "tool", "content": "end"}),
        Family("llama31", LLAMA31, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               "<|eot_id|>", ("<|end_of_text|>", "<|eom_id|>"),
               ("<|python_tag|>", "<|eom_id|>", "<|end_of_text|>"), tool_role="ipython",
               trims=True, closer={"role": "tool", "content": "end"}),
        Family("mistral", MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
               "</s>", (), ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                            "[/TOOL_RESULTS]"),
               moves_tools=True,
               closer={"role": "tool", "content": "end", "tool_call_id": "c0end0000"}),
        Family("gemma", GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
               "<end_of_turn>", ("<eos>",), ("<start_of_turn>", "<end_of_turn>"),
               tool_role=None, trims=True, closer={"role": "user", "content": "end"}),
    ]
}

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


def tool_call(family: Family, rng: random.Random) -> str:
    """An assistant tool call in the family's format (raw text: the template copies it)."""
    expr = f"{rng.randint(0, 999)}*({rng.randint(0, 99)}+{rng.randint(0, 9)})"
    args = {"expr": expr} if rng.random() < 0.7 else {"expr": random_text(rng, 1, 4)}
    if family.name in ("qwen25", "qwen3", "chatml"):
        call = json.dumps({"name": "calc", "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"
    if family.name == "llama31":
        if rng.random() < 0.3:
            return f"<|python_tag|>calc.call(expr={json.dumps(args['expr'], ensure_ascii=False)})"
        return json.dumps({"name": "calc", "parameters": args}, ensure_ascii=False)
    if family.name == "mistral":
        call = json.dumps([{"name": "calc", "arguments": args, "id": "a1b2c3d4e"}],
                          ensure_ascii=False)
        return f"[TOOL_CALLS]{call}"
    return f"```tool_code\ncalc({json.dumps(args['expr'], ensure_ascii=False)})\n```"


def assistant_text(family: Family, rng: random.Random) -> str:
    """What a model of this family would write in one turn (before any cut): the canonical
    shapes its template re-renders unchanged (Qwen3: non-empty reasoning in a think block;
    trimming templates: no edge whitespace)."""
    body = tool_call(family, rng) if rng.random() < 0.35 else random_text(rng, 1, 30)
    if rng.random() < 0.3 and not body.startswith(("[TOOL_CALLS]", "<|python_tag|>")):
        body = random_text(rng, 1, 8).strip() + "\n" + body
    if family.thinks:
        reasoning = random_text(rng, 1, 20).strip("\n") or "hmm"
        body = f"<think>\n{reasoning}\n</think>\n\n{body.lstrip(chr(10))}"
    if family.trims:
        body = body.strip() or "ok"
    return body


def observation(family: Family, rng: random.Random, after_call: bool) -> list[dict[str, Any]]:
    """Tool results (after a call, mostly) and/or a user turn (feedback)."""
    def result() -> dict[str, Any]:
        content = (json.dumps({"result": rng.randint(-9999, 9999)}) if rng.random() < 0.5
                   else random_text(rng, 1, 16))
        return {"role": family.tool_role, "content": content,
                **({"tool_call_id": "a1b2c3d4e"} if family.name == "mistral" else {})}
    if family.tool_role is None:  # results go back as a user turn
        return [{"role": "user", "content": random_text(rng, 1, 16)}]
    out = [result() for _ in range(rng.randint(1, 2))] if after_call or rng.random() < 0.3 else []
    if not out or rng.random() < 0.3:
        out.append({"role": "user", "content": "Not quite, try again: " + random_text(rng, 0, 8)})
    return out


def prompt(family: Family, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    if rng.random() < 0.5:
        out.append({"role": "system", "content": "You are terse. " + random_text(rng, 0, 6)})
    out.append({"role": "user", "content": "Q: " + random_text(rng, 1, 20)})
    return out


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


Encode = Callable[[str], list[int]]
