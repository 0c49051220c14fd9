"""One episode's conversation as token ids: what the engine saw, what it generated, what trains.

::

    prompt ids ─► turn 1 (engine ids) ─► observation ids ─► turn 2 (engine ids) ─► ...
    └ context ┘   └──── trains ─────┘    └── masked ───┘    └──── trains ─────┘

The first prompt is the chat template's render of the prompt messages with a generation prompt,
encoded without adding special tokens (as a single-turn chat prompt is,
:meth:`asyncrl.data.prompts.Tokenizer.encode_prompts`). A turn appends the engine's token ids
exactly as generated, with their behaviour logprobs and weight versions; they are never decoded
and encoded again. An observation (tool results, a user turn, feedback, as messages) is
templated once: the whole conversation is rendered again with a generation prompt, and the text
it adds after what is already recorded is encoded once and appended (loss mask 0). Observation
tokens thus include whatever the template writes between turns: the end-of-turn token after a
turn cut at the token limit, the newline after an end token, the next generation prompt.

**The prefix check.** That is only sound while the re-rendered conversation begins with the
text already recorded (the template's *prefix property*). Some templates break it: Qwen3's drops
the reasoning (``<think>...</think>``) of assistant turns before the last user message, a
template that trims turns drops a turn's edge whitespace, one may write a different end token
than the model generated (Llama's ``<|eot_id|>`` where the model wrote ``<|eom_id|>``), or
move a block (Mistral's ``[AVAILABLE_TOOLS]`` goes before the last user message). Every
observation is checked, on text: the render must start with the recorded text (prompt renders,
the decoded generated ids, the inserted texts). On a mismatch, ``on_mismatch="split"`` (what a
run does) closes the current segment as one training sample (up to its last generated token)
and starts a new one whose prompt is the template's own render of the conversation so far (what
a chat server would send the model), and tells ``on_split`` where the texts differ
(:class:`TemplateMismatch`: the run logs it); ``"refuse"`` (a check of a template, as a test
makes) raises :class:`PrefixMismatchError`. :attr:`Trajectory.splits` counts the splits.

**The assistant message** added to the conversation (for the agent, the reward and later
renders) holds the turn's ids decoded with every special token written out (Qwen3's ``<think>``,
a ``<tool_call>`` tag, Llama's ``<|python_tag|>``: the template copies a message's content
verbatim, so only then does the re-render reproduce them), except one end token the turn ends
with, which the template writes itself after the content. Ids cut inside a UTF-8 character decode
to U+FFFD; the trained ids are the engine's all the same.

Pure: no I/O, no torch; the template renders and the tokenizer runs in the calling thread (see
``docs/environments.md`` for what that costs).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncrl.data.chat import ChatTemplate
from asyncrl.data.prompts import Tokenizer
from asyncrl.env.segments import Segment, TrajectorySample
from asyncrl.errors import AsyncRLError, ConfigError

__all__ = [
    "PrefixMismatchError", "TemplateMismatch", "Trajectory", "TrajectoryError", "TrajectorySample",
]  # fmt: skip

OnMismatch = Literal["split", "refuse"]
_EXCERPT = 40  # characters of each text shown around a mismatch


class TrajectoryError(AsyncRLError):
    """A trajectory was used wrongly or given bad data (a turn where an observation is due,
    ids outside the vocabulary, a template that rejects the conversation): the agent's bug,
    which fails its episode. The message names the episode, the turn and the fix."""


@dataclass(frozen=True)
class TemplateMismatch:
    """Where the chat template's re-render of the conversation first differs from the text
    recorded: why a trajectory split an episode (or refused it)."""

    episode: str
    turn: int
    """Turns generated before the observation that failed the check."""
    position: int
    """The first differing character in the current segment's text."""
    where: str
    """The piece of the segment that holds it (the prompt, a turn's generated text, an
    observation), and where that piece starts."""
    recorded: str
    """The recorded text from a little before :attr:`position`."""
    rendered: str
    """The template's text from the same place."""

    def describe(self) -> str:
        """The mismatch in words: the episode, the turn, the first difference and its likely
        causes."""
        return (
            f"episode {self.episode!r}, the observation after turn {self.turn}: the chat "
            f"template does not re-render the tokens recorded so far: from character "
            f"{self.position} (in {self.where}) the recorded text reads {self.recorded!r} where "
            f"the template now renders {self.rendered!r} (a template that drops earlier "
            "reasoning, trims a turn, writes another end token or moves a block)"
        )


class PrefixMismatchError(TrajectoryError):
    """The chat template does not re-render the tokens recorded so far, and the trajectory was
    told to refuse such episodes (``on_mismatch="refuse"``: a check of a template; a run
    splits them).

    Attributes:
        episode: the episode's name.
        turn: the number of turns generated before the observation that failed the check.
        position: the first differing character in the current segment's text.
        recorded: the recorded text from a little before ``position``.
        rendered: the template's text from the same place.
    """

    def __init__(
        self, message: str, *, episode: str, turn: int, position: int, recorded: str,
        rendered: str,
    ) -> None:
        super().__init__(message)
        self.episode = episode
        self.turn = turn
        self.position = position
        self.recorded = recorded
        self.rendered = rendered


@dataclass(frozen=True)
class _Next:
    """The pending observation, rendered: ids to append to the segment, or (``split``) the
    prompt of a new segment."""

    text: str
    ids: list[int]
    split: bool
    mismatch: TemplateMismatch | None = None
    """Why it splits (a template mismatch; ``None`` otherwise)."""


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class Trajectory:
    """One episode's token-exact record, turn by turn (see the module docstring).

    The agent alternates: :attr:`prompt_ids` (send them to the engine), :meth:`add_turn` (what
    the engine generated), then an observation (:meth:`add_messages` or :meth:`add_tokens`,
    either as often as it likes) before the next :attr:`prompt_ids`. :meth:`samples` gives
    the training sequences; :attr:`messages` the conversation. Not thread-safe: one owner
    (the episode's task) at a time.

    Args:
        template: the model's chat template.
        tokenizer: the model's tokenizer.
        messages: the prompt messages (at least one).
        tools: OpenAI-style tool definitions, given to the template as ``tools``.
        episode: the episode's name, for error messages.
        end_token_ids: the ids that end a turn (the engine's stop tokens); default the
            tokenizer's EOS.
        on_mismatch: ``"split"`` or ``"refuse"`` an episode the template does not re-render.
        on_split: called with each split's :class:`TemplateMismatch` when it is taken (the
            next turn added); the run logs it.
        assistant_message: turns a generated text into the assistant message recorded in
            the conversation (default ``{"role": "assistant", "content": text}``); the prefix
            check holds whatever it returns to the tokens.

    Raises:
        TrajectoryError: no messages, no end token, an id outside the vocabulary, a bad
            ``on_mismatch``, the template rejects the messages or renders no tokens.
    """

    def __init__(
        self,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        episode: str = "?",
        end_token_ids: Collection[int] | None = None,
        on_mismatch: OnMismatch = "split",
        on_split: Callable[[TemplateMismatch], None] | None = None,
        assistant_message: Callable[[str], Mapping[str, Any]] = _assistant,
    ) -> None:
        self.episode = episode
        if on_mismatch not in ("split", "refuse"):
            raise self._error(
                f"on_mismatch is {on_mismatch!r}", 'give "split" or "refuse"'
            )
        self._on_mismatch = on_mismatch
        self._on_split = on_split
        self._template = template
        self._tok = tokenizer
        self._tools = None if tools is None else [dict(t) for t in tools]
        self._to_message = assistant_message
        self._vocab = tokenizer.vocab_size
        ends = tokenizer.eos_token_id if end_token_ids is None else end_token_ids
        self._ends = frozenset([ends] if isinstance(ends, int) else ends or ())
        if not self._ends or any(not 0 <= e < self._vocab for e in self._ends):
            raise self._error(
                f"the end-of-turn token ids {sorted(self._ends)} are not ids of the vocabulary "
                f"(size {self._vocab})",
                "give end_token_ids (the engine's stop tokens), or a tokenizer with an EOS id",
            )
        if not messages:
            raise self._error("the prompt has no messages", "give at least one message")
        self._messages = [self._checked(m, "the prompt") for m in messages]
        self._turns = 0
        self._splits = 0
        self._closed: list[TrajectorySample] = []
        text = self._render()
        ids = tokenizer.encode_rendered(text)
        if not ids:
            raise self._error(
                "the chat template renders the prompt to no tokens",
                "give messages the template renders, or a template that writes something",
            )
        self._segment = Segment(text, ids)
        self._observed: str | None = None  # None, "messages" or "tokens" since the last turn
        self._pending_tokens: list[int] = []
        self._next: _Next | None = None  # the observation rendered (cached until it changes)

    # --- reading ---------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the prompt, each turn's assistant message, each observation's
        messages (copies of the dicts)."""
        return [dict(m) for m in self._messages]

    @property
    def turns(self) -> int:
        """Turns generated so far."""
        return self._turns

    @property
    def splits(self) -> int:
        """Times the prefix check closed a segment and started a new one."""
        return self._splits

    @property
    def prompt_ids(self) -> list[int]:
        """The token ids of the next engine request: every token of the current segment, the
        observation since the last turn included, ending with the generation prompt.

        Renders the observation (once; the result is kept until another one is added) and runs
        the prefix check; on a mismatch the ids are the new segment's prompt (the split is
        taken, and counted, when the next turn is added).

        Raises:
            TrajectoryError: the last turn has no observation yet, or the template rejects it.
            PrefixMismatchError: the check failed and ``on_mismatch`` is ``"refuse"``.
        """
        if self._turns and self._observed is None:
            raise self._error(
                f"turn {self._turns} has no observation yet, so there is no next prompt",
                "add_messages() or add_tokens() after a turn, before asking for the prompt",
            )
        nxt = self._pending()
        if nxt is None:
            return self._segment.ids.tolist()
        if nxt.split:
            return list(nxt.ids)
        return self._segment.ids.tolist() + nxt.ids

    @property
    def num_tokens(self) -> int:
        """Tokens in the conversation as the engine sees it: :attr:`prompt_ids`' length, or
        the current segment's while the last turn awaits its observation.

        Raises:
            TrajectoryError, PrefixMismatchError: as :attr:`prompt_ids`.
        """
        if self._turns and self._observed is None:
            return len(self._segment.ids)
        nxt = self._pending()
        if nxt is None:
            return len(self._segment.ids)
        return len(nxt.ids) + (0 if nxt.split else len(self._segment.ids))

    def samples(self) -> list[TrajectorySample]:
        """The training sequences so far: one per segment that generated a token, each ending
        with its last generated token (an observation after it trains nothing and is left
        out)."""
        last = self._segment.sample()
        return [*self._closed, *([last] if last is not None else [])]

    # --- writing ---------------------------------------------------------------------------

    def add_turn(
        self,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        version: int | Sequence[int] | np.ndarray,
        finish_reason: str | None = None,
    ) -> str:
        """Record what the engine generated for :attr:`prompt_ids`.

        Args:
            token_ids: the generated ids as produced: they may end with one end token, be cut
                at the token limit without it, or be that end token alone.
            logprobs: the behaviour logprob of each id.
            version: the weight version that generated each id (one for all, or one per id).
            finish_reason: what the engine reported (kept for the sample); default
                ``"stop"`` when the ids end with an end token, else ``"length"``.

        Returns:
            The assistant text added to the conversation (the ids decoded, special tokens
            kept, the end token left out).

        Raises:
            TrajectoryError: an observation is due, an id is outside the vocabulary, an end
                token is not last, the lengths differ, a logprob is not finite.
            PrefixMismatchError: the pending observation failed the check (``"refuse"``).
        """
        n = self._turns + 1
        if self._turns and self._observed is None:
            raise self._error(
                f"turn {n} came while turn {self._turns} awaits an observation",
                "add_messages() or add_tokens() between two turns",
            )
        ids = self._ids(token_ids, f"turn {n}")
        lps, versions = self._values(ids.size, logprobs, version, n)
        id_list = ids.tolist()
        ends = [i for i, t in enumerate(id_list) if t in self._ends]  # a turn is short
        if ends and ends[0] != ids.size - 1:
            raise self._error(
                f"turn {n} has the end token {id_list[ends[0]]} at position {ends[0]}, "
                f"before its last token (of {ids.size})",
                "stop generating at the first end token (the engine's stop tokens must be "
                "end_token_ids)",
            )
        nxt = self._pending()  # checked before anything changes: an error leaves it as it was
        text, content = self._turn_texts(nxt, id_list, bool(ends))
        message = self._checked(self._to_message(content), f"turn {n}'s assistant message")
        reason = finish_reason or ("stop" if ends else "length")
        self._commit()
        self._segment.generate(id_list, text, lps, versions, n, reason)
        self._messages.append(message)
        self._turns = n
        self._observed = None
        return content

    def turn_text(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The assistant text :meth:`add_turn` would add for ``token_ids`` (decoded where they
        would follow, the end token left out), without adding them: what a caller shows
        before it decides which of several candidate turns to keep.

        Raises:
            TrajectoryError: an observation is due, or an id is outside the vocabulary.
            PrefixMismatchError: as :attr:`prompt_ids`.
        """
        if self._turns and self._observed is None:
            raise self._error(
                f"turn {self._turns} awaits an observation", "add one before the next turn"
            )
        id_list = self._ids(token_ids, f"turn {self._turns + 1}").tolist()
        ends = bool(id_list) and id_list[-1] in self._ends
        return self._turn_texts(self._pending(), id_list, ends)[1]

    def restart(
        self, messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Go on from ``messages`` (and ``tools``) instead of the conversation recorded: the
        current segment, if it generated anything, is closed as a training sample (counted in
        :attr:`splits`), and a new one starts whose prompt is the template's render of
        ``messages``. Before the first turn it replaces the prompt. For an agent that rewrote
        its context (summarized it, dropped turns, changed its tools or system prompt); any
        pending observation is dropped (it is in ``messages`` or it is gone).

        Raises:
            TrajectoryError: no messages, a message without a role, the template rejects
                them or renders no tokens; nothing changes then.
        """
        if not messages:
            raise self._error("restart() with no messages", "give at least one message")
        checked = [self._checked(m, "the restarted conversation") for m in messages]
        tool_list = None if tools is None else [dict(t) for t in tools]
        text = self._render(checked, tool_list)
        self._begin(text, checked, tool_list)

    def restart_text(self, prompt: str | Sequence[int]) -> None:
        """As :meth:`restart`, from a prompt the caller wrote itself (a text-completion
        client that applies its own template): text, encoded as it is (no template, no
        special tokens added), or token ids, taken as they are.

        Raises:
            TrajectoryError: the prompt is empty, or an id is outside the vocabulary;
                nothing changes then.
        """
        if isinstance(prompt, str):
            self._begin(prompt, [], self._tools)
        else:
            ids = self._ids(prompt, "the restarted prompt").tolist()
            self._begin(self._tok.decode_verbatim(ids), [], self._tools, ids)

    @property
    def recorded(self) -> tuple[str, list[int]]:
        """The current segment's text and token ids (a pending observation left out): what a
        caller that writes its own prompts must begin its next one with to go on."""
        return self._segment.text, self._segment.ids.tolist()

    def _begin(
        self, text: str, messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None, ids: list[int] | None = None,
    ) -> None:
        ids = self._tok.encode_rendered(text) if ids is None else ids
        if not ids:
            raise self._error("the restarted prompt encodes to no tokens",
                              "give a prompt with some text")  # fmt: skip
        closed = self._segment.sample()
        if closed is not None:
            self._closed.append(closed)
            self._splits += 1
        self._segment = Segment(text, ids)
        self._messages, self._tools = messages, tools
        self._observed = "restart" if self._turns else None  # the next thing is a turn
        self._pending_tokens = []
        self._next = None

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Add observation messages (role ``tool``, ``user``, ...) after the last turn. They
        are rendered with the template at the next :attr:`prompt_ids` (or turn), all of this
        observation's messages at once.

        Raises:
            TrajectoryError: no turn yet, token ids already added to this observation, or a
                message without a string ``role``.
        """
        self._observable("add_messages", "messages")
        what = f"the observation after turn {self._turns}"
        checked = [self._checked(m, what) for m in messages]
        self._observed = "messages"
        self._messages.extend(checked)
        self._next = None

    def add_tokens(
        self, token_ids: Sequence[int] | np.ndarray,
        messages: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Add an observation as token ids, appended as they are (masked) with no template:
        they must end with whatever the model needs before it generates (a generation prompt).
        ``messages`` say what the ids stand for in the conversation; the next message
        observation's prefix check holds the template to them (without them, the template
        renders no text for the ids and that check fails).

        Raises:
            TrajectoryError: no turn yet, messages already added to this observation, or an id
                outside the vocabulary.
        """
        self._observable("add_tokens", "tokens")
        what = f"the observation after turn {self._turns}"
        ids = self._ids(token_ids, what)
        checked = [self._checked(m, what) for m in messages]
        self._observed = "tokens"
        self._pending_tokens.extend(ids.tolist())
        self._messages.extend(checked)
        self._next = None

    # --- internals -------------------------------------------------------------------------

    def _observable(self, method: str, kind: str) -> None:
        """Raise unless an observation of ``kind`` may be added now."""
        if not self._turns:
            raise self._error(
                f"{method}() before the first turn",
                "put the messages before the first turn in the prompt",
            )
        if self._observed not in (None, kind):
            raise self._error(
                f"{method}() after {self._observed} in the observation after turn "
                f"{self._turns}",
                "give one observation as messages or as token ids, not both",
            )

    def _turn_texts(self, nxt: _Next | None, ids: list[int], ends: bool) -> tuple[str, str]:
        """A turn's text as it follows what is recorded (and the pending observation), and
        its content (the end token left out when ``ends``)."""
        before = nxt.ids[-1] if nxt is not None and nxt.ids else self._segment.ids[-1]
        text = self._decode_after(before, ids)
        return text, (self._without_end(before, ids, text) if ends else text)

    def _pending(self) -> _Next | None:
        """The observation since the last turn, rendered and checked (cached); ``None``
        when there is none (before the first turn, or a segment just restarted)."""
        if not self._turns or self._next is not None or self._observed == "restart":
            return self._next
        if self._observed == "tokens":
            ids = self._pending_tokens
            text = self._decode_after(self._segment.ids[-1], ids)
            self._next = _Next(text, list(ids), split=False)
            return self._next
        text = self._render()
        recorded = self._segment.text
        if text.startswith(recorded):
            suffix = text[len(recorded) :]
            self._next = _Next(suffix, self._tok.encode_rendered(suffix), split=False)
            return self._next
        mismatch = self._mismatch(recorded, text)
        if self._on_mismatch == "refuse":
            raise self._refused(mismatch)
        self._next = _Next(text, self._tok.encode_rendered(text), split=True, mismatch=mismatch)
        return self._next

    def _commit(self) -> None:
        """Append the pending observation to the segment (or start a new one)."""
        nxt = self._pending()
        if nxt is None:
            return
        what = f"the observation after turn {self._turns}"
        if nxt.split:
            closed = self._segment.sample()
            if closed is not None:  # None: its turns generated no tokens, nothing to train
                self._closed.append(closed)
            self._segment = Segment(nxt.text, nxt.ids)
            self._splits += 1
            if nxt.mismatch is not None and self._on_split is not None:
                self._on_split(nxt.mismatch)
        else:
            self._segment.insert(nxt.ids, nxt.text, what)
        self._next = None
        self._pending_tokens = []

    def _render(
        self, messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation recorded (or ``messages`` with ``tools``) rendered with a
        generation prompt."""
        try:
            return self._template.render(
                self._messages if messages is None else messages,
                add_generation_prompt=True,
                prompt_id=f"{self.episode} after turn {self._turns}",
                tools=self._tools if messages is None else tools,
            )
        except ConfigError as exc:
            raise TrajectoryError(f"episode {self.episode!r}: {exc}") from exc

    def _decode_after(self, before: int, ids: Sequence[int]) -> str:
        """The text of ``ids`` where they follow the token ``before``: decoded after it and
        cut off, so a decoder that treats a first token specially (SentencePiece's leading
        space) decodes them as in context."""
        if not ids:
            return ""
        head = self._tok.decode_verbatim([before])
        text = self._tok.decode_verbatim([before, *ids])
        return text[len(head) :] if text.startswith(head) else self._tok.decode_verbatim(ids)

    def _without_end(self, before: int, ids: list[int], text: str) -> str:
        """The text of a turn that ended, its end token left out: cut off the text when it
        ends with the token's own (one decode, not two), else decoded without it."""
        end = self._tok.decode_verbatim(ids[-1:])
        if end and text.endswith(end):
            return text[: -len(end)]
        return self._decode_after(before, ids[:-1])

    def _ids(self, values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        ids = np.asarray(values)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise self._error(
                f"{what}: token ids must be a flat sequence of integers, got "
                f"{ids.dtype} of shape {ids.shape}",
                "pass the engine's token ids as a list or a 1-D integer array",
            )
        ids = ids.astype(np.int64, copy=False)
        bad = np.flatnonzero((ids < 0) | (ids >= self._vocab))
        if bad.size:
            raise self._error(
                f"{what}: token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
                f"vocabulary (0..{self._vocab - 1})",
                "give ids of this model's tokenizer (an engine with a larger padded vocabulary "
                "must not sample the padding)",
            )
        return ids

    def _values(
        self, n: int, logprobs: Any, version: Any, turn: int
    ) -> tuple[np.ndarray, np.ndarray]:
        lps = np.asarray(logprobs, dtype=np.float64)
        versions = np.asarray(version)
        if versions.ndim == 0:
            versions = np.full(n, versions)
        if lps.shape != (n,) or versions.shape != (n,):
            raise self._error(
                f"turn {turn} has {n} token ids but logprobs of shape {lps.shape} and versions "
                f"of shape {versions.shape}",
                "give one logprob and one version (or a single version) per generated id",
            )
        if n and (not np.isfinite(lps).all() or versions.dtype.kind not in "iu"
                  or versions.min() < 0):
            raise self._error(
                f"turn {turn}: logprobs must be finite and versions non-negative integers",
                "pass the engine's behaviour logprobs and the weight versions it reported",
            )
        return lps, versions

    def _checked(self, message: Any, what: str) -> dict[str, Any]:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise self._error(
                f"{what}: a message must be a mapping with a string 'role', got {message!r:.80}",
                'give messages like {"role": "tool", "content": "..."}',
            )
        return dict(message)

    def _mismatch(self, recorded: str, rendered: str) -> TemplateMismatch:
        pos = _common_prefix(recorded, rendered)
        start = max(0, pos - _EXCERPT // 2)
        return TemplateMismatch(
            episode=self.episode, turn=self._turns, position=pos,
            where=self._segment.where(pos), recorded=recorded[start : pos + _EXCERPT],
            rendered=rendered[start : pos + _EXCERPT],
        )  # fmt: skip

    @staticmethod
    def _refused(m: TemplateMismatch) -> PrefixMismatchError:
        return PrefixMismatchError(
            f"{m.describe()}. Fix: use a chat template that renders earlier turns unchanged, "
            'or let the trajectory split such an episode into several samples (on_mismatch = '
            '"split", what a run does).',
            episode=m.episode, turn=m.turn, position=m.position, recorded=m.recorded,
            rendered=m.rendered,
        )  # fmt: skip

    def _error(self, problem: str, fix: str) -> TrajectoryError:
        return TrajectoryError(f"episode {self.episode!r}: {problem}. Fix: {fix}.")


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (by halving: C-speed
    comparisons, as a mismatch in a long conversation is found on every split)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
