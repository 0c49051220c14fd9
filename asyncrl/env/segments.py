"""A trajectory's training samples: one per segment of the episode (pure; numpy only).

A :class:`Segment` is one sample in the making, owned by its
:class:`~asyncrl.env.trajectory.Trajectory`: its token ids (in compact arrays: an episode in
flight costs about 13 bytes a token, besides the text the ids stand for, which the prefix
check compares against), the per-response-token loss mask, behaviour logprobs and weight
versions, and where each piece (the prompt, a turn, an observation) starts, for error messages.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Segment", "TrajectorySample"]


@dataclass(frozen=True)
class TrajectorySample:
    """One training sequence: the prompt, then the response (the turns and what lies between
    them), laid out as :mod:`asyncrl.policy.packing` lays out a sequence."""

    token_ids: np.ndarray
    """int32 ``[n]``: prompt then response."""
    prompt_len: int
    """The first ``prompt_len`` tokens are context (at least one)."""
    loss_mask: np.ndarray
    """uint8 ``[n - prompt_len]``: 1 on generated tokens (an end token included), 0 on
    inserted ones."""
    logprobs: np.ndarray
    """float32 ``[n - prompt_len]``: behaviour logprobs (0.0 on inserted tokens)."""
    versions: np.ndarray
    """int32 ``[n - prompt_len]``: the weight version that generated each token (-1 on
    inserted tokens)."""
    turns: int
    """Generated turns in this sample."""
    finish_reason: str
    """Its last turn's: ``"stop"`` (it ended with an end token), ``"length"`` (cut at the
    token limit), or what the engine reported (``"abort"``)."""

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.token_ids[: self.prompt_len]

    @property
    def response_ids(self) -> np.ndarray:
        return self.token_ids[self.prompt_len :]


class Segment:
    """One training sample in the making: its ids, its per-response-token values and the text
    the ids stand for (what the next render must begin with)."""

    def __init__(self, text: str, ids: Sequence[int]) -> None:
        self.text = text
        self.ids = array("i", ids)
        self.prompt_len = len(self.ids)
        self.mask = bytearray()
        self.logprobs = array("f")
        self.versions = array("i")
        self.pieces: list[tuple[int, int, str]] = [(0, 0, "the prompt")]  # (char, token, what)
        self.trained_end = self.prompt_len  # ids up to the last generated one
        self.turns = 0
        self.finish_reason = ""

    def insert(self, ids: Sequence[int], text: str, what: str) -> None:
        self.pieces.append((len(self.text), len(self.ids), what))
        self.text += text
        self.ids.extend(ids)
        self.mask.extend(bytes(len(ids)))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def generate(
        self, ids: Sequence[int], text: str, logprobs: np.ndarray, versions: np.ndarray,
        turn: int, finish_reason: str,
    ) -> None:
        self.finish_reason = finish_reason
        self.pieces.append((len(self.text), len(self.ids), f"turn {turn}'s generated text"))
        self.text += text
        self.ids.extend(ids)
        self.mask.extend(b"\x01" * len(ids))
        self.logprobs.frombytes(logprobs.astype(np.float32).tobytes())
        self.versions.frombytes(versions.astype(np.intc).tobytes())
        self.trained_end = len(self.ids)
        self.turns += 1

    def where(self, position: int) -> str:
        """Which piece of the text holds character ``position`` (for error messages)."""
        found = self.pieces[0]
        for piece in self.pieces:
            if piece[0] <= position:
                found = piece
        char, token, what = found
        return f"{what}, which starts at character {char}, token {token}"

    def sample(self) -> TrajectorySample | None:
        """The segment up to its last generated token; ``None`` while it has generated none
        (before its first turn, or after turns of no tokens)."""
        if self.trained_end == self.prompt_len:
            return None
        n, p = self.trained_end, self.prompt_len
        return TrajectorySample(
            token_ids=np.frombuffer(self.ids, np.intc, n).astype(np.int32),
            prompt_len=p,
            loss_mask=np.frombuffer(self.mask, np.uint8, n - p).copy(),
            logprobs=np.frombuffer(self.logprobs, np.float32, n - p).copy(),
            versions=np.frombuffer(self.versions, np.intc, n - p).astype(np.int32),
            turns=self.turns,
            finish_reason=self.finish_reason,
        )
