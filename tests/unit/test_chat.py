"""Chat prompts: ``ChatTemplate`` + ``Tokenizer.encode_prompts`` give the ids transformers'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` gives.

Each model directory is built here: a small byte-level BPE trained on the conversations, with
the template's special tokens, saved as ``tokenizer.json`` + ``tokenizer_config.json`` that
``AutoTokenizer.from_pretrained`` loads (the reference). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from asyncrl.data.chat import ChatTemplate
from asyncrl.environment import Prompt
from asyncrl.errors import ConfigError
from asyncrl.run.preflight import _longest_prompt
from asyncrl.data.prompts import PromptStream, Tokenizer
import chat_support

transformers = pytest.importorskip("transformers")  # the reference (the `training` extra)
jinja2 = pytest.importorskip("jinja2")

Messages = Sequence[Mapping[str, Any]]

ONE_USER: Messages = [{"role": "user", "content": "What is 2+2?"}]
MULTI_TURN: Messages = [
    {"role": "system", "content": "You are terse. Réponds en français si on te parle français."},
    {"role": "user", "content": "Grüße aus 東京 ☃ — what is ½ of 9?"},
    {"role": "assistant", "content": "  4.5  "},
    {"role": "user", "content": "Et 3×3 ?\nMerci 😀"},
]
BAD_ORDER: Messages = [
    {"role": "user", "content": "hello"},
    {"role": "user", "content": "hello again"},
]
# content that is not a string: rendered through tojson (non-ASCII kept, '<' '&' not escaped)
STRUCTURED: Messages = [
    {"role": "user", "content": [{"type": "text", "text": "a < b & c > d, 'ü' \"東\""}]},
]

# --- templates written here in the formats of real models -----------------------------------

CHATML_QWEN = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. '
        + 'You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- if tools is not none or documents is not none %}
    {{- raise_exception('no tools or documents here') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {%- if message.role == 'assistant' %}
            {% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}
        {%- else %}
            {{- message.content + '<|im_end|>' }}
        {%- endif %}
    {%- else %}
        {{- message.content | tojson + '<|im_end|>' }}
    {%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """\
{%- if strftime_now is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- else %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- set loop_messages = messages %}
{%- for message in loop_messages %}
    {%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}
    {%- if message['role'] == 'system' %}
        {%- set content = content + 'Today Date: ' + date_string + '\\n\\n' %}
    {%- endif %}
    {%- set content = content + message['content'] | trim + '<|eot_id|>' %}
    {%- if loop.index0 == 0 %}
        {%- set content = bos_token + content %}
    {%- endif %}
    {{- content }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ALTERNATING = """\
{{ bos_token }}
{% set first = 1 if messages[0]['role'] == 'system' else 0 %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% if not loop.first %}{{ raise_exception('A system message must come first') }}{% endif %}
        {% set offset = 1 %}
    {% else %}
        {% if (message['role'] == 'user') != ((loop.index0 - first) % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
        {% endif %}
        {% if message['role'] == 'user' %}
            {{ '[INST] ' + message['content'] | trim + ' [/INST]' }}
        {% else %}
            {{ ' ' + message['content'] | trim + eos_token }}
        {% endif %}
    {% endif %}
{% endfor %}
"""

BOS_DICT = {
    "content": "<|begin_of_text|>",
    "lstrip": False,
    "normalized": False,
    "rstrip": False,
    "single_word": False,
    "special": True,
    "__type": "AddedToken",
}
TOKENS: dict[str, dict[str, Any]] = {
    "chatml": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "llama3": {"bos_token": BOS_DICT, "eos_token": "<|eot_id|>"},
    "alternating": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
}
OWN = {"chatml": CHATML_QWEN, "llama3": LLAMA3, "alternating": ALTERNATING}

CORPUS = [str(m["content"]) for c in (ONE_USER, MULTI_TURN, BAD_ORDER) for m in c]
_SPECIAL = chat_support.SPECIAL


def _model_dir(
    path: Path,
    template: Any,
    tokens: Mapping[str, Any],
    *,
    where: str = "config",
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    return chat_support.model_dir(
        path, template, tokens, corpus=CORPUS, where=where, extra_config=extra_config
    )


def _reference(model_dir: Path, messages: Messages, add_generation_prompt: bool = True) -> Any:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )


def _reference_text(model_dir: Path, messages: Messages, add_generation_prompt: bool) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _tokenizer(model_dir: Path, setting: str = "auto") -> Tokenizer:
    template = ChatTemplate.from_model(str(model_dir), setting)
    return Tokenizer(str(model_dir / "tokenizer.json"), None, template)


def _ours(model_dir: Path, messages: Messages, setting: str = "auto") -> list[int]:
    return _tokenizer(model_dir, setting).encode_prompts([Prompt("p0", messages=messages)])[0]


@pytest.mark.parametrize("name", sorted(OWN))
@pytest.mark.parametrize("messages", [ONE_USER, MULTI_TURN], ids=["one_user", "multi_turn"])
def test_own_templates_match_transformers(tmp_path: Path, name: str, messages: Messages) -> None:
    model = _model_dir(tmp_path, OWN[name], TOKENS[name])
    expected = _reference(model, messages)
    assert _ours(model, messages) == expected
    # the template's special tokens are single ids (not spelled out)
    vocab = HFTokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
    first = _SPECIAL.findall(OWN[name])[0]
    assert vocab[first] in expected


def test_qwen_default_system_message_and_no_generation_prompt(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, CHATML_QWEN, TOKENS["chatml"])
    template = ChatTemplate.from_model(str(model))
    assert template is not None
    for add in (True, False):
        text = template.render(ONE_USER, add_generation_prompt=add)
        assert text == _reference_text(model, ONE_USER, add)
        ids = HFTokenizer.from_file(str(model / "tokenizer.json")).encode(
            text, add_special_tokens=False
        )
        assert ids.ids == _reference(model, ONE_USER, add_generation_prompt=add)
    # hand-written: the default system message when none is given
    assert template.render(ONE_USER, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )


def test_llama3_bos_comes_from_the_template_only(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, LLAMA3, TOKENS["llama3"])
    bos = HFTokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<|begin_of_text|>")
    ids = _ours(model, MULTI_TURN)
    assert ids == _reference(model, MULTI_TURN)
    assert ids[0] == bos and ids.count(bos) == 1  # not a second one from the post-processor


def test_tojson_non_string_content(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, CHATML_QWEN, TOKENS["chatml"])
    template = ChatTemplate.from_model(str(model))
    assert template is not None
    text = template.render(STRUCTURED)
    assert text == _reference_text(model, STRUCTURED, True)
    assert '"a < b & c > d, \'ü\' \\"東\\""' in text  # json.dumps, not HTML-escaped
    assert _ours(model, STRUCTURED) == _reference(model, STRUCTURED)


def test_raise_exception_names_the_prompt_and_the_message(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, ALTERNATING, TOKENS["alternating"])
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate") as ref:
        _reference(model, BAD_ORDER)
    tok = _tokenizer(model)
    good = Prompt("good", messages=MULTI_TURN)
    with pytest.raises(ConfigError) as err:
        tok.encode_prompts([good, Prompt("bad-1", messages=BAD_ORDER)])
    message = str(err.value)
    assert message.startswith("model.chat_template: prompt 'bad-1'")
    assert str(ref.value) in message and "Fix:" in message


def _shipped_templates() -> list[Path]:
    """Every ``*.jinja`` chat template an installed package ships (found by the package's
    file list: a ``.jinja`` file under a path naming "chat" that renders ``messages``)."""
    found: set[Path] = set()
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            if file.name.endswith(".jinja") and "chat" in str(file).lower():
                path = Path(str(dist.locate_file(file)))
                if path.is_file() and "messages" in path.read_text(encoding="utf-8"):
                    found.add(path)
    return sorted(found)


SHIPPED = _shipped_templates()


@pytest.mark.parametrize(
    "template_path",
    SHIPPED or [None],
    ids=[f"{p.parent.name}/{p.name}" for p in SHIPPED] or ["none"],
)
def test_shipped_templates_match_transformers(tmp_path: Path, template_path: Path | None) -> None:
    if template_path is None:
        pytest.skip("no installed package ships a chat template")
    source = template_path.read_text(encoding="utf-8")
    model = _model_dir(tmp_path, source, {"bos_token": "<s>", "eos_token": "</s>"}, where="jinja")
    compared = 0
    for i, messages in enumerate((ONE_USER, MULTI_TURN, BAD_ORDER)):
        try:
            rendered = _reference_text(model, messages, True)
        except jinja2.exceptions.TemplateError as exc:
            with pytest.raises(ConfigError, match=re.escape(str(exc))):
                _tokenizer(model).encode_prompts([Prompt(f"c{i}", messages=messages)])
            continue
        if not rendered:
            continue  # it needs inputs a chat prompt does not give (e.g. `conversations`)
        assert _ours(model, messages) == _reference(model, messages)
        assert _ours(model, messages, setting=str(template_path)) == _reference(model, messages)
        compared += 1
    if not compared:
        pytest.skip(f"{template_path.name} renders nothing from messages alone")


def test_jinja_file_takes_precedence(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, LLAMA3, TOKENS["llama3"], where="jinja")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'from the config' }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    expected = _reference(model, MULTI_TURN)
    assert _ours(model, MULTI_TURN) == expected
    template = ChatTemplate.from_model(str(model))
    assert template is not None and "from the config" not in template.render(MULTI_TURN)


def test_chat_template_json_is_read(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "{{ 'from the config' }}", TOKENS["chatml"])
    (model / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_QWEN}))
    template = ChatTemplate.from_model(str(model))
    assert template is not None
    # hand-written: chat_template.json's template, not tokenizer_config.json's
    assert template.render(ONE_USER).endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                                              "<|im_start|>assistant\n")


def test_list_of_named_templates(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "{{ 'tools ' + messages[0]['content'] }}"},
        {"name": "default", "template": CHATML_QWEN},
    ]
    model = _model_dir(tmp_path, named, TOKENS["chatml"])
    assert _ours(model, MULTI_TURN) == _reference(model, MULTI_TURN)
    no_default = _model_dir(tmp_path / "b", named[:1], TOKENS["chatml"])
    with pytest.raises(ConfigError, match=r"^model\.chat_template: .*none named 'default'"):
        ChatTemplate.from_model(str(no_default))


def test_missing_template(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, CHATML_QWEN, TOKENS["chatml"])
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_model(str(model)) is None
    tok = _tokenizer(model)
    assert tok.encode_prompts([Prompt("t", text="hi")]) == tok.encode_batch(["hi"])
    with pytest.raises(ConfigError, match=r"^model\.chat_template: prompt 'c' .*no chat template"):
        tok.encode_prompts([Prompt("t", text="hi"), Prompt("c", messages=ONE_USER)])
    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(ConfigError, match=r"^model\.chat_template: cannot read .*nope\.jinja"):
        ChatTemplate.from_model(str(model), missing)


def test_a_template_file_setting_overrides_the_model_dir(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, LLAMA3, TOKENS["llama3"])
    expected = _reference(model, MULTI_TURN)
    (tmp_path / "llama3.jinja").write_text(LLAMA3)
    (model / "chat_template.jinja").write_text("{{ 'the model dir one' }}")
    assert _ours(model, MULTI_TURN, str(tmp_path / "llama3.jinja")) == expected


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "hi\n{% for m in messages %}{{ m.content }}", TOKENS["chatml"])
    with pytest.raises(ConfigError, match=r"^model\.chat_template: .*does not compile \(line 2"):
        ChatTemplate.from_model(str(model))


def test_encode_prompts_mixes_text_and_chat(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, LLAMA3, TOKENS["llama3"])
    tok = _tokenizer(model)
    prompts = [
        Prompt("t0", text="What is 2+2?"),
        Prompt("c0", messages=MULTI_TURN),
        Prompt("t1", text="Grüße aus 東京"),
        Prompt("c1", messages=ONE_USER),
    ]
    ids = tok.encode_prompts(prompts)
    texts = tok.encode_batch(["What is 2+2?", "Grüße aus 東京"])
    assert [ids[0], ids[2]] == texts
    bos = tok._tok.token_to_id("<|begin_of_text|>")
    assert texts[0][0] == bos  # the post-processor's BOS on plain text, as before
    assert ids[1] == _reference(model, MULTI_TURN)
    assert ids[3] == _reference(model, ONE_USER)


@pytest.mark.asyncio
async def test_prompt_stream_prefetches_chat_prompts(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, CHATML_QWEN, TOKENS["chatml"])
    tok = _tokenizer(model)
    prompts = [Prompt("t", text="What is 2+2?"), Prompt("c", messages=MULTI_TURN)]
    stream = PromptStream(prompts, batch=2, seed=0)
    await stream.prefetch(2, tok)
    got = {p.id: ids for p, ids in (stream.get(i) for i in range(2))}
    assert got["c"] == _reference(model, MULTI_TURN)
    assert got["t"] == tok.encode_batch(["What is 2+2?"])[0]


class _Env:
    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts

    def dataset(self, split: str) -> list[Prompt]:
        return self.prompts


def test_preflight_measures_chat_prompts_and_needs_a_template(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, CHATML_QWEN, TOKENS["chatml"])
    cfg = SimpleNamespace(eval=SimpleNamespace(num_prompts=0))
    env = _Env([Prompt("t", text="hi"), Prompt("c", messages=MULTI_TURN)])
    assert _longest_prompt(env, _tokenizer(model), cfg) == len(_reference(model, MULTI_TURN))
    plain = Tokenizer(str(model / "tokenizer.json"), None, None)
    with pytest.raises(ConfigError, match=r"^model\.chat_template: .*set model\.chat_template"):
        _longest_prompt(env, plain, cfg)


def test_chat_module_imports_no_torch_or_transformers() -> None:
    code = (
        "import sys, asyncrl.data.chat, asyncrl.data.prompts, asyncrl.run.preflight;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_documented_transformers_check_keeps_a_character_vocabularys_spaces(
    tmp_path: Path,
) -> None:
    """docs/datasets.md tells users to check prompt ids with
    ``PreTrainedTokenizerFast.from_pretrained(model_dir)``: on a model shaped like the demo's
    (``config.json`` says qwen2, ``tokenizer.json`` is a character vocabulary) it gives
    asyncrl's ids, spaces included. (transformers 5's ``AutoTokenizer`` builds Qwen2's own
    pre-tokenizer there instead, and drops them.)"""
    from tokenizers import Regex, models, pre_tokenizers

    chars = ["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789+=?: abcdefghijklmnopqrstuvwxyz"]
    tok = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
        "unk_token": "<unk>", "pad_token": "<pad>"}))  # fmt: skip
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    messages = [{"role": "user", "content": "what is 12 + 34?"}]
    text = "user: what is 12 + 34? assistant: "  # the template's render, by hand
    by_hand = [chars.index(c) for c in text]
    assert _ours(tmp_path, messages) == by_hand
    documented = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert documented.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == by_hand  # fmt: skip
    a, space, b = (chars.index(c) for c in "a b")
    assert documented("a b", add_special_tokens=False).input_ids == [a, space, b]
