"""Tool calls read from generated text (asyncrl.env.tool_parsers).

Valid calls are rendered here independently (``json.dumps`` in each family's format) and must
come back exactly; hostile text must give the documented errors, numbered, and nothing else.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import registry
from asyncrl.env.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ParsedTurn,
    ToolCallParser,
    load_tool_parser,
    make_call_id,
)
from asyncrl.env.tools import ToolCallError, tool_message
from asyncrl.errors import PluginError

PARSERS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}
HEX9 = re.compile(r"^[0-9a-f]{9}$")


def render(family: str, calls: list[tuple[str, dict[str, Any]]], content: str = "") -> str:
    """The text a model of ``family`` writes for ``calls`` (an independent rendering)."""
    if family == "hermes":
        blocks = "".join(
            f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n'
            "</tool_call>\n" for n, a in calls
        )  # fmt: skip
        return content + blocks
    if family == "llama3_json":
        return "<|python_tag|>" + "; ".join(
            json.dumps({"name": n, "parameters": a}) for n, a in calls
        )
    body = [{"name": n, "arguments": a} for n, a in calls]
    return content + "[TOOL_CALLS]" + json.dumps(body, ensure_ascii=False)


def check_shape(turn: ParsedTurn) -> None:
    """What every parse must give, whatever the text: numbered attempts, documented errors."""
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    indices = sorted([c.index for c in turn.calls] + [e.index for e in turn.errors])
    assert indices == list(range(1, len(indices) + 1))
    for c in turn.calls:
        assert isinstance(c.name, str) and c.name and isinstance(c.arguments, dict)
        assert isinstance(c.id, str) and c.id
        json.dumps(c.arguments, ensure_ascii=False).encode("utf-8")  # plain, encodable JSON
    for e in turn.errors:
        assert isinstance(e, ToolCallError) and HEX9.match(e.id)
        assert e.message.startswith(f"error: your tool call #{e.index} "), e.message
        assert "Write a call as: " in e.message


# ------------------------------------------------------------------------ valid calls
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip
CALLS = st.lists(
    st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,20}", fullmatch=True),
              st.dictionaries(st.text(max_size=10), JSON, max_size=5)),
    min_size=1, max_size=4,
)  # fmt: skip


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=150, deadline=None)
@given(calls=CALLS, content=st.text(max_size=40).filter(lambda t: "<" not in t and "[" not in t))
def test_rendered_calls_come_back_exactly(
    family: str, calls: list[tuple[str, dict[str, Any]]], content: str
) -> None:
    if family == "llama3_json":
        content = ""  # the whole turn is the calls
    turn = PARSERS[family].parse(render(family, calls, content))
    check_shape(turn)
    assert turn.errors == ()
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert turn.content == content.strip()
    assert all(HEX9.match(c.id) for c in turn.calls)
    assert len({c.id for c in turn.calls}) == len(calls)


def test_known_turns_by_hand() -> None:
    qwen = ('I will compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": '
            '"12+30"}}\n</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {}}\n'
            "</tool_call><|im_end|>")  # fmt: skip
    turn = HERMES.parse(qwen)
    assert turn.content == "I will compute.\n\n<|im_end|>"
    assert [(c.name, c.arguments, c.index) for c in turn.calls] == [
        ("calc", {"expression": "12+30"}, 1), ("calc", {}, 2)]  # fmt: skip
    assert turn.calls[0].id == make_call_id(qwen, 1)
    assert turn.assistant_message() == {
        "role": "assistant", "content": "I will compute.\n\n<|im_end|>",
        "tool_calls": [
            {"id": turn.calls[0].id, "type": "function",
             "function": {"name": "calc", "arguments": {"expression": "12+30"}}},
            {"id": turn.calls[1].id, "type": "function",
             "function": {"name": "calc", "arguments": {}}},
        ],
    }  # fmt: skip
    think = '<think>maybe <tool_call>{"name": "x"}</tool_call>?</think>\n<tool_call>{"name": "y"}'
    assert [c.name for c in HERMES.parse(think).calls] == ["y"]  # the open last block counts
    assert HERMES.parse('<think>still <tool_call>{"name": "x"}</tool_call>').calls == ()
    tags_in_strings = ('<tool_call>{"name": "a", "arguments": {"s": "</tool_call>", '
                       '"</think>": 1}}</tool_call>')  # fmt: skip
    assert HERMES.parse(tags_in_strings).calls[0].arguments == {"s": "</tool_call>", "</think>": 1}
    prompt_opened = 'so I call it</think>\n<tool_call>{"name": "y"}</tool_call>'  # no <think>
    assert [c.name for c in HERMES.parse(prompt_opened).calls] == ["y"]
    llama = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert LLAMA3_JSON.parse(llama).calls[0].arguments == {"city": "Paris"}
    assert LLAMA3_JSON.parse("The weather is fine.") == ParsedTurn(content="The weather is fine.")
    mistral = 'Let me check.[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "Ab3dE6gH9"}]'
    turn = MISTRAL.parse(mistral)
    assert (turn.content, turn.calls[0].id, turn.calls[0].arguments) == (
        "Let me check.", "Ab3dE6gH9", {"a": 1})  # fmt: skip
    assert MISTRAL.parse("no calls") == ParsedTurn(content="no calls")
    marker_in_string = '[TOOL_CALLS][{"name": "a", "arguments": {"s": "[TOOL_CALLS]"}}]'
    assert MISTRAL.parse(marker_in_string).calls[0].arguments == {"s": "[TOOL_CALLS]"}
    assert not HERMES.parse("plain").attempted and HERMES.parse(qwen).attempted


# ------------------------------------------------------------------------ hostile text
HOSTILE = [
    ("hermes", '<tool_call>{"name": "a", "arguments": {}',  # unclosed, cut in the middle
     ["#1 is not closed with </tool_call> and is not valid JSON"], 0),
    ("hermes", '<tool_call>[1]', ["#1 is not closed with </tool_call>"], 0),
    ("hermes", '<tool_call><tool_call>{"name": "a"}</tool_call></tool_call>',
     ["#1 holds another <tool_call> before its </tool_call>"], 1),
    ("hermes", '<tool_call>{"name": "a"} and more</tool_call>',
     ["#1 has text after its JSON: 'and more'"], 0),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
     ['#1 has a "name" that is not a non-empty string (5)'], 0),
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>',
     ['#1 has a "name" that is not a non-empty string'], 0),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', ['#1 has no "name"'], 0),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>',
     ['#1 has "arguments" that is not a JSON object (it is a string) (write the object '
      "itself, not a string holding it)"], 0),
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'
               '<tool_call>{"name": "b", "arguments": null}</tool_call>',
     ['#1 has "arguments" that is not a JSON object (it is an array)',
      '#2 has "arguments" that is not a JSON object (it is null)'], 0),
    ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>",
     ["#1 is not valid JSON: it is nested too deeply"], 0),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"n": 1' + "0" * 5000 + "}}</tool_call>",
     ["#1 is not valid JSON: Exceeds the limit"], 0),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": Infinity}}</tool_call>',
     ["#1 is not valid JSON: Infinity is not a JSON number"], 0),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"s": "\\udc80"}}</tool_call>',
     ["#1 is not valid JSON: it holds a lone surrogate escape"], 0),
    ("hermes", "<tool_call></tool_call>", ["#1 is not valid JSON: Expecting value"], 0),
    ("llama3_json", '{"name": "a", "parameters": {}} trailing garbage',
     ["#2 is text that is not a JSON call: 'trailing garbage'"], 1),
    ("llama3_json", '{"name": "a", "parameters": {}', ["#1 is not valid JSON"], 0),
    ("llama3_json", "<|python_tag|>brave_search.call(query='x')", ["#1 is not valid JSON"], 0),
    ("llama3_json", '{"name": ["a"], "parameters": {}}', ['#1 has a "name" that is not'], 0),
    ("llama3_json", '{"name": "a", "parameters": 3}; {"name": "b"}',
     ['#1 has "parameters" that is not a JSON object (it is a number)'], 1),
    ("mistral", "[TOOL_CALLS]", ["#1 is not valid JSON: Expecting value"], 0),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}] junk',
     ["#2 is text after the calls: 'junk'"], 1),
    ("mistral", '[TOOL_CALLS]["a", {"name": null}, {"name": "b", "arguments": "x"}]',
     ["#1 is not a JSON object (it is a string)", "#2 has a \"name\" that is not",
      '#3 has "arguments" that is not a JSON object'], 0),
    ("mistral", "[TOOL_CALLS][]", ["#1 is an empty list"], 0),
    ("mistral", '[TOOL_CALLS][{"name": "a"}][TOOL_CALLS]{"name": "b"}', [], 2),
]  # fmt: skip


@pytest.mark.parametrize(("family", "text", "errors", "n_calls"), HOSTILE)
def test_hostile_text_gives_the_documented_errors(
    family: str, text: str, errors: list[str], n_calls: int
) -> None:
    turn = PARSERS[family].parse(text)
    check_shape(turn)
    assert len(turn.calls) == n_calls
    assert len(turn.errors) == len(errors)
    for error, expected in zip(turn.errors, errors, strict=True):
        assert f"error: your tool call {expected}" in error.message, error.message


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_huge_and_unicode_arguments(family: str) -> None:
    huge = {"text": "数字 🧮 مرحبا " * 200_000, **{f"k{i}": i for i in range(20_000)}}
    calls = [("résumé_工具", {"ключ": "значение", "emoji": "👩‍👩‍👧"}), ("big", huge)]
    turn = PARSERS[family].parse(render(family, calls, "über ✓ "))
    check_shape(turn)
    assert [(c.name, c.arguments) for c in turn.calls] == calls and turn.errors == ()


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "[TOOL_CALLS]",
    "{", "}", "[", "]", '"', ":", ",", ";", "\\", "\\u", "\\ud800", '"name"', '"arguments"',
    '"parameters"', '"id"', '"calc"', "null", "true", "1e999", "NaN", "-0", "9" * 30, "{}",
    "[]", '{"name": "f", "arguments": {}}', '{"name": "f", "parameters": {"a": [1, {"b": 2}]}}',
    "\n", " ", "é", "🧮", "\x00",
]  # fmt: skip
TEXTS = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=12), max_size=40).map("".join)


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=1000, deadline=None)
@given(text=TEXTS)
def test_random_text_never_raises(family: str, text: str) -> None:
    check_shape(PARSERS[family].parse(text))


def test_call_ids_are_nine_hex_digits_and_stable() -> None:
    assert make_call_id("turn", 1) == make_call_id("turn", 1)
    assert len({make_call_id("turn", i) for i in range(1, 100)}) == 99
    assert HEX9.match(make_call_id("\ud800 lone surrogate", 3))


def test_tool_message() -> None:
    assert tool_message("42", call_id="abc123def", name="calc") == {
        "role": "tool", "content": "42", "tool_call_id": "abc123def", "name": "calc"}
    assert tool_message("x") == {"role": "tool", "content": "x"}


# ------------------------------------------------------------------------ the plugin group
def test_the_built_ins_load_through_the_plugin_group() -> None:
    assert "asyncrl.tool_parsers" in registry.GROUPS
    for name, parser in PARSERS.items():
        loaded = load_tool_parser(name)
        assert loaded is parser and isinstance(loaded, ToolCallParser) and loaded.name == name


def test_a_missing_parser_is_a_plugin_error_naming_the_field() -> None:
    with pytest.raises(PluginError) as info:
        load_tool_parser("qwen9", field="episode.tool_parser")
    message = str(info.value)  # the installed list also holds other packages' parsers
    assert message.startswith(
        "episode.tool_parser: no tool-call parser named 'qwen9' is installed (installed: "
    ), message
    installed = message.rpartition("(installed: ")[2].rstrip(")").split(", ")
    assert {"hermes", "llama3_json", "mistral"} <= set(installed) and installed == sorted(installed)


def test_an_entry_point_that_is_not_a_parser_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fresh:
        name = "fresh"

        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn(content=text)

    monkeypatch.setattr(registry, "load", lambda group, name, field=None: Fresh)
    assert load_tool_parser("fresh").parse(" x ").content == " x "  # a class: made
    monkeypatch.setattr(registry, "load", lambda group, name, field=None: len)
    with pytest.raises(PluginError, match="tool-call parser 'bad' is a builtin_function"):
        load_tool_parser("bad")
