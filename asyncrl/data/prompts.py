"""Prompts on their way in: the model's tokenizer (no torch) and the seeded prompt stream.

Pure and I/O-free apart from reading ``tokenizer.json`` once.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import structlog

from asyncrl.environment import Prompt
from asyncrl.errors import RunError, config_error

if TYPE_CHECKING:
    from asyncrl.data.chat import ChatTemplate

__all__ = ["PromptStream", "Tokenizer", "prompt_batches", "sample_seed", "unlocked"]

log = structlog.get_logger("asyncrl.data.prompts")

UNLOCKED_CHARS = 64 * 1024
"""Texts this long are encoded with the GIL released (:meth:`Tokenizer.encode_rendered`); a
shorter one costs less than the GIL's hand-back to the loop's thread can (up to 5 ms while
another thread computes), unless the thread encoding it is not the loop's (:func:`unlocked`)."""

_THREAD = threading.local()


@contextlib.contextmanager
def unlocked() -> Iterator[None]:
    """Within it, this thread encodes every text with the GIL released: for a worker thread,
    which has nothing to gain from keeping it, while the event loop's thread runs."""
    _THREAD.unlocked = True
    try:
        yield
    finally:
        _THREAD.unlocked = False


class Tokenizer:
    """The model directory's ``tokenizer.json`` via the ``tokenizers`` library (no torch).

    Prompts are encoded one by one as the model's tokenizer would (its normalizer,
    pre-tokenizer and post-processor, e.g. a BOS token), never padded or truncated: a
    ``tokenizer.json`` saved after a padded batch carries a padding setting that would make
    ``encode_batch`` left-pad every prompt with pad tokens the engine and the trainer would
    take for context, and a truncation setting would cut prompts silently. Both are switched
    off here (with a warning naming them).

    Chat prompts are rendered with ``chat_template`` (the model's, see
    :meth:`asyncrl.data.chat.ChatTemplate.from_model`) and encoded without adding special tokens
    (the template writes them), as transformers' ``apply_chat_template`` does.

    Completions are decoded for ``Environment.score`` with EOS tokens dropped and special
    tokens skipped.
    """

    def __init__(
        self, path: str, eos_token_id: int | None, chat_template: ChatTemplate | None = None
    ) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)
        ignored = [name for name in ("padding", "truncation") if getattr(self._tok, name)]
        if ignored:
            log.warning(
                "tokenizer_settings_ignored",
                path=path,
                settings=ignored,
                reason="prompts are never padded or truncated",
            )
            self._tok.no_padding()
            self._tok.no_truncation()
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._vocab_size: int | None = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain texts, special tokens added as the post-processor says."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """The token ids the engine gets for each prompt, in order: a text prompt as
        :meth:`encode_batch`, a chat prompt rendered with a generation prompt and encoded
        without adding special tokens.

        Raises:
            ConfigError: a chat prompt and no chat template, or the template failed on one
                (naming ``model.chat_template`` and the prompt).
        """
        out: list[list[int]] = [[] for _ in prompts]
        texts = [i for i, p in enumerate(prompts) if p.messages is None]
        chats = [i for i, p in enumerate(prompts) if p.messages is not None]
        if chats and self.chat_template is None:
            raise config_error(
                "model.chat_template",
                f"prompt {prompts[chats[0]].id!r} is a list of chat messages, but the model "
                "directory has no chat template",
                "save one with the tokenizer, or set model.chat_template to a .jinja file",
            )
        for i, ids in zip(texts, self.encode_batch([prompts[i].text for i in texts])):
            out[i] = ids
        if chats:
            assert self.chat_template is not None
            rendered = [
                self.chat_template.render(prompts[i].messages or (), prompt_id=prompts[i].id)
                for i in chats
            ]
            encoded = self._tok.encode_batch(rendered, add_special_tokens=False)
            for i, e in zip(chats, encoded):
                out[i] = e.ids
        return out

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids if int(i) != self.eos_token_id]
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode_rendered(self, text: str) -> list[int]:
        """Text a chat template rendered (it writes its own special tokens), encoded without
        adding any, as :meth:`encode_prompts` encodes a chat prompt. A long text is encoded
        with the GIL released (``tokenizers`` releases it in ``encode_batch`` only), so a
        worker thread that encodes it leaves the event loop's thread running: the gateway
        records big calls so (a 4 MB conversation took seconds)."""
        if len(text) >= UNLOCKED_CHARS or getattr(_THREAD, "unlocked", False):
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_verbatim(self, ids: Sequence[int]) -> str:
        """Token ids as text with every special token written out (none skipped, EOS kept):
        the text a chat template must render for these ids to stay in place (multi-turn
        episodes, :mod:`asyncrl.env.trajectory`). Ids outside the vocabulary decode to nothing
        (check them against :attr:`vocab_size` first)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id the tokenizer knows (added tokens included)."""
        if self._vocab_size is None:
            self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        return self._vocab_size


def sample_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts`` (the same on every run and host)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def prompt_batches(prompts: Sequence[Prompt], batch: int, seed: int) -> Iterator[list[Prompt]]:
    """Endless epochs over ``prompts`` in a seeded order; each epoch drops the remainder."""
    if len(prompts) < batch:
        raise RunError(
            f"the train split has {len(prompts)} prompts, fewer than one batch ({batch})"
        )
    epoch = 0
    while True:
        order = list(range(len(prompts)))
        random.Random(sample_seed(seed, epoch)).shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            yield [prompts[j] for j in order[i : i + batch]]
        epoch += 1


class PromptStream:
    """The prompt stream by position: prompt ``i`` is prompt ``i % P`` of batch ``i // P`` of
    :func:`prompt_batches` (so a resumed run can name any prompt by its index), tokenized ahead
    off-loop by :meth:`prefetch` and dropped once read (bounded memory)."""

    def __init__(self, prompts: Sequence[Prompt], batch: int, seed: int) -> None:
        self._batches = prompt_batches(prompts, batch, seed)
        self._batch = batch
        self._cached: dict[int, tuple[Prompt, list[int]]] = {}
        self._produced = 0  # prompts drawn from the batch iterator so far
        self._skip: set[int] = set()
        self._start = 0  # the first position a (resumed) run may ask for

    def skip_to(self, start: int, *, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """A resumed run: positions below ``start`` and those in ``skip`` will never be asked
        for (trained, dropped, or restored with their samples); they are passed over without
        tokenizing or caching them."""
        if self._produced:
            raise RunError("skip_to() must come before the first prefetch")
        while self._produced + self._batch <= start:
            next(self._batches)
            self._produced += self._batch
        self._skip = set(range(self._produced, start)) | {i for i in skip if i >= start}
        self._start = start

    async def prefetch(self, upto: int, tokenizer: Tokenizer) -> None:
        """Make prompts ``< upto`` available to :meth:`get` (tokenized in a worker thread)."""
        import anyio

        if self._produced >= upto:
            return
        new: list[tuple[int, Prompt]] = []
        while self._produced < upto:
            for p in next(self._batches):
                if self._produced in self._skip:
                    self._skip.discard(self._produced)
                else:
                    new.append((self._produced, p))
                self._produced += 1
        ids = await anyio.to_thread.run_sync(tokenizer.encode_prompts, [p for _, p in new])
        for (i, p), x in zip(new, ids):
            self._cached[i] = (p, x)

    async def peek_first(self, n: int, tokenizer: Tokenizer) -> list[list[int]]:
        """Token ids of up to ``n`` of the first prompts the run will dispatch (a resumed run's
        skipped positions passed over), without taking them."""
        await self.prefetch(self._start + n, tokenizer)
        return [self._cached[i][1] for i in sorted(self._cached)[:n]]

    def get(self, index: int) -> tuple[Prompt, list[int]]:
        """Prompt ``index`` and its token ids (it must have been prefetched)."""
        try:
            return self._cached.pop(index)
        except KeyError:
            raise RunError(f"prompt {index} was not prefetched (or was already taken)") from None
