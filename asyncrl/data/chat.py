"""Chat prompts rendered with the model's chat template, as transformers renders them, without
torch or transformers.

The template comes from the model directory (or ``model.chat_template``) and is compiled once
in a sandboxed jinja2 environment set up the way transformers sets up its own: blocks trimmed
and left-stripped, ``break``/``continue``, ``raise_exception(message)``, ``strftime_now(fmt)``,
a ``tojson`` filter that writes plain ``json.dumps`` (non-ASCII kept, no HTML escaping), and
``{% generation %}`` blocks rendered as their body. A render sees the same variables as
``apply_chat_template``: ``messages``, ``add_generation_prompt``, ``tools`` (OpenAI-style
function definitions, or ``None``), ``documents`` (``None``) and the tokenizer's named special
tokens (``bos_token``, ``eos_token``...).
The rendered text is then encoded without adding special tokens (``Tokenizer.encode_prompts``),
so the ids equal ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from asyncrl.errors import config_error

__all__ = ["ChatTemplate"]

_FIELD = "model.chat_template"
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplate:
    """One compiled chat template and the special-token variables it renders with.

    Args:
        source: the jinja template text.
        origin: where it came from (a file, for error messages).
        special_tokens: template variables such as ``bos_token`` (name -> token text).

    Raises:
        ConfigError: the template does not compile (naming ``model.chat_template``, the origin
            and the line).
    """

    def __init__(
        self,
        source: str,
        *,
        origin: str = "<string>",
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise config_error(
                _FIELD,
                f"the chat template {origin} does not compile (line {exc.lineno}: {exc.message})",
                "fix the template, or set model.chat_template to a .jinja file that compiles",
            ) from None

    @classmethod
    def from_model(cls, model_dir: str, setting: str = "auto") -> ChatTemplate | None:
        """The chat template for the model in ``model_dir``, with its special tokens.

        ``setting`` is ``model.chat_template``: ``"auto"`` takes the directory's
        ``chat_template.jinja``, else ``chat_template.json``'s ``chat_template``, else
        ``tokenizer_config.json``'s (a string, or a list of ``{"name", "template"}`` of which
        the one named ``"default"``); anything else is the path of a template file. The
        special-token variables always come from ``tokenizer_config.json``.

        Returns:
            The compiled template, or ``None`` when ``"auto"`` finds none.

        Raises:
            ConfigError: the file named by ``setting`` is missing, a template file is
                unreadable or malformed, or the template does not compile.
        """
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        legacy = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
        tokens = _special_tokens(config, legacy)
        if setting != "auto":
            try:
                with open(setting, encoding="utf-8") as f:
                    source = f.read()
            except OSError as exc:
                raise config_error(
                    _FIELD,
                    f"cannot read the chat template file {setting} ({exc.strerror})",
                    'give the path of a .jinja file (relative to the config file), or "auto" '
                    "for the model directory's own template",
                ) from None
            return cls(source, origin=setting, special_tokens=tokens)
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), origin=jinja_path, special_tokens=tokens)
        for name, data in (
            ("chat_template.json", _read_json(os.path.join(model_dir, "chat_template.json"))),
            ("tokenizer_config.json", config),
        ):
            if data.get("chat_template") is not None:
                origin = os.path.join(model_dir, name)
                source = _pick_default(data["chat_template"], origin)
                return cls(source, origin=origin, special_tokens=tokens)
        return None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        prompt_id: str = "?",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation as text, special tokens included, ready to encode without adding
        special tokens.

        ``tools`` are the tool definitions the template may list (OpenAI-style JSON schemas,
        ``{"type": "function", "function": {"name", "description", "parameters"}}``), given to
        it as ``tools`` as transformers gives them; ``None`` (the default) for none.

        Raises:
            ConfigError: the template raised (``raise_exception`` for a bad role order, an
                undefined attribute, ...), naming ``prompt_id`` and the template's message.
        """
        context: dict[str, Any] = {
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except Exception as exc:  # whatever the template's own code raised
            kind = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise config_error(
                _FIELD,
                f"prompt {prompt_id!r}: the chat template {self.origin} failed: {kind}{exc}",
                "correct the prompt's messages (roles, their order, contents), or set "
                "model.chat_template to a template that accepts them",
            ) from exc


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object file's content; ``{}`` when it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise config_error(
            "model.path", f"cannot read {path} ({exc})", "repair or re-save the tokenizer files"
        ) from None
    if not isinstance(data, dict):
        raise config_error(
            "model.path", f"{path} is not a JSON object", "repair or re-save the tokenizer files"
        )
    return data


def _pick_default(value: Any, origin: str) -> str:
    """A ``chat_template`` entry: a string, or a list of named templates (the ``default``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise config_error(
            _FIELD,
            f"{origin} has chat templates named {sorted(map(str, named))} but none named "
            "'default'",
            "set model.chat_template to a .jinja file holding the template to use",
        )
    raise config_error(
        _FIELD,
        f"{origin}'s chat_template is a {type(value).__name__}, not a string or a list of "
        "named templates",
        "re-save the tokenizer, or set model.chat_template to a .jinja file",
    )


def _token_text(value: Any) -> str | None:
    """A special token as saved: its text, or an AddedToken dict's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: Mapping[str, Any], legacy: Mapping[str, Any]) -> dict[str, str]:
    """The special-token variables transformers gives a template: the named tokens
    (``bos_token``...) from ``tokenizer_config.json`` (``special_tokens_map.json`` filling
    the ones it lacks), its other ``*_token`` strings and a named ``extra_special_tokens``."""
    out: dict[str, str] = {}
    for name in _NAMED_SPECIAL_TOKENS:
        text = _token_text(config.get(name, legacy.get(name)))
        if text is not None:
            out[name] = text
    for name, value in config.items():
        if name.endswith("_token") and name not in out and isinstance(value, str):
            out[name] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for name, value in extra.items():
            text = _token_text(value)
            if text is not None:
                out[str(name)] = text
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Plain json.dumps, unlike jinja2's own filter (HTML-escaped '<', '>', '&', "'").
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (where transformers marks assistant text for
    its training masks): rendered as the body, in its own scope as there."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

