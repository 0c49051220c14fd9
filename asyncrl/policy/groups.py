"""A prompt group, one record from dispatch to the optimizer step: its state and its payload.

Pure data. The table of live groups (:class:`~asyncrl.policy.live.LiveGroups`) keeps one
:class:`Group` per group it tracks; the same object goes from generating to scored to trained,
so a sample is reshaped only where it must be: the raw sample as it arrives, then the scored
sample the trainer packs. Its states::

    GENERATING ──its n samples (episodes) back──► SCORING ──committed──► READY ──► taken
        │  ▲ dispatched again                                              (the open step's)
        ▼  │
    RETRYING (generation failed or its worker died; still live)
    ABORTING (hopeless at a refit, or the run ended; its samples still come back)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np

if TYPE_CHECKING:
    from asyncrl.environment import Prompt

__all__ = [
    "ABORTING",
    "GENERATING",
    "READY",
    "RETRYING",
    "SCORING",
    "CompletedSample",
    "Group",
    "Part",
    "Rewards",
    "aligned_mask",
]

GENERATING, SCORING, READY, ABORTING = "generating", "scoring", "ready", "aborting"
RETRYING = "retrying"
"""Generation failed and will be tried again (still live: it keeps its place and its step)."""


@dataclass(frozen=True)
class Part:
    """A training sequence an episode's chat template split off before its last one (its
    own prompt; it trains with its episode's advantage)."""

    prompt_ids: Any  # int32 array
    token_ids: Any  # int32 array: the response
    logprobs: Any  # float32 array, aligned with token_ids
    loss_mask: Any  # uint8 array, aligned with token_ids
    finish_reason: str
    versions: Any = None
    """int32 array aligned with token_ids: the weight version that generated each token (-1
    on inserted ones); ``None``: unknown (restored from an older checkpoint)."""

    def __post_init__(self) -> None:
        """Raises ValueError: the mask is not one 0 or 1 per token (:func:`aligned_mask`,
        checked once, here: every later use reads it as it is)."""
        object.__setattr__(self, "loss_mask", aligned_mask(self.token_ids, self.loss_mask))

    def trained_mask(self) -> np.ndarray:
        """Its loss mask (uint8, aligned with ``token_ids``)."""
        return self.loss_mask  # type: ignore[no-any-return]

    def trained_versions(self, unknown: int) -> np.ndarray:
        """The versions of the tokens that train (``unknown`` for each when not recorded)."""
        return _trained_versions(self.versions, self.loss_mask, unknown)


def _trained_versions(versions: Any, mask: np.ndarray, unknown: int) -> np.ndarray:
    """``versions`` where ``mask`` (a checked uint8 mask) is 1; ``unknown`` for each such token
    when ``versions`` is ``None``."""
    trained = mask.view(bool)
    if versions is None:
        return np.full(int(np.count_nonzero(trained)), unknown, np.int32)
    return np.asarray(versions, np.int32)[trained]


def aligned_mask(token_ids: Any, loss_mask: Any) -> np.ndarray:
    """``loss_mask`` as a uint8 array aligned with ``token_ids`` (all ones for ``None``).

    Raises:
        ValueError: the mask is not aligned with ``token_ids`` or holds values other than 0
            and 1 (the code that built the sample is wrong).
    """
    n = len(token_ids)
    if loss_mask is None:
        return np.ones(n, np.uint8)
    mask = np.asarray(loss_mask)
    if mask.shape != (n,) or (mask.size and ((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            f"a sample's loss_mask must hold one 0 or 1 per token ({n} tokens), got shape "
            f"{mask.shape} with values {np.unique(mask)[:5].tolist()}; fix the code that "
            "built the CompletedSample (an episode's trajectory)"
        )
    return mask.astype(np.uint8, copy=False)


@dataclass(frozen=True)
class CompletedSample:
    token_ids: Any  # int32 array
    logprobs: Any  # float32 array, aligned with token_ids
    finish_reason: str
    reward: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)
    """The score's named parts (``Score.components``; ``grpo.reward_weights`` trains on them;
    empty when restored from a checkpoint an older asyncrl wrote)."""
    loss_mask: Any = None
    """uint8 array aligned with ``token_ids``: 1 where the token trains (generated), 0 where
    it does not (an observation the controller inserted; its logprob is a placeholder).
    ``None``: every token trains (a single-turn sample)."""
    prompt_ids: Any = None
    """int32 array: this sample's own prompt (an episode's: the chat template's render, tools
    included); ``None``: its group's ``prompt_ids``."""
    earlier: tuple[Part, ...] = ()
    """An episode's sequences its chat template split off before this one (each trains with
    this sample's reward and advantage; docs/environments.md)."""
    versions: Any = None
    """int32 array aligned with ``token_ids``: the weight version that generated each token
    (-1 on inserted ones; a sequence in flight during a refit has several); ``None``: unknown
    (restored from an older checkpoint: its group's start version, the oldest possible)."""

    def __post_init__(self) -> None:
        """Raises ValueError: a loss mask is not one 0 or 1 per token (:func:`aligned_mask`,
        checked once, here: every later use reads it as it is)."""
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", aligned_mask(self.token_ids, self.loss_mask))

    def trained_mask(self) -> np.ndarray:
        """This sample's own sequence's loss mask (uint8; all ones for ``None``)."""
        if self.loss_mask is None:
            return np.ones(len(self.token_ids), np.uint8)
        return self.loss_mask  # type: ignore[no-any-return]

    def sequences(self, group_prompt_ids: Any) -> list[tuple[Any, Any, Any, np.ndarray]]:
        """``(prompt_ids, token_ids, logprobs, loss_mask)`` of every sequence this sample
        trains, in order: those split off earlier, then its own (after its own prompt, else
        ``group_prompt_ids``)."""
        prompt = group_prompt_ids if self.prompt_ids is None else self.prompt_ids
        own = (prompt, self.token_ids, self.logprobs, self.trained_mask())
        if not self.earlier:
            return [own]
        return [*((p.prompt_ids, p.token_ids, p.logprobs, p.loss_mask) for p in self.earlier), own]

    def trained_versions(self, unknown: int) -> np.ndarray:
        """The weight versions of every token this sample trains (its split-off sequences'
        included), ``unknown`` for tokens whose version was not recorded."""
        if self.loss_mask is None and self.versions is not None and not self.earlier:
            return np.asarray(self.versions, np.int32)  # every token trains (single-turn)
        own = _trained_versions(self.versions, self.trained_mask(), unknown)
        if not self.earlier:
            return own
        return np.concatenate([*(p.trained_versions(unknown) for p in self.earlier), own])


class Rewards(Sequence[float]):
    """A scored group's rewards, read through from its samples (kept once: what samplers see
    as ``GroupView.rewards`` is not a copy)."""

    __slots__ = ("_samples",)

    def __init__(self, samples: Sequence[CompletedSample]) -> None:
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> list[float]: ...
    def __getitem__(self, i: int | slice) -> float | list[float]:
        if isinstance(i, slice):
            return [s.reward for s in self._samples[i]]
        return self._samples[i].reward

    def __repr__(self) -> str:
        return f"Rewards({list(self)!r})"


@dataclass
class Group:
    """One dispatched group: what samplers see as a ``GroupView`` (its ids, versions, state
    and rewards) and what the trainer packs (its prompt and samples)."""

    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    start_version: int
    target_step: int | None
    dispatched_at: float
    samples: list[Any] = field(default_factory=list)
    """While generating: the raw samples (``asyncrl.wire.messages.Sample``) by index as they
    arrive, ``None`` for those still coming. Once scored: its :class:`CompletedSample` s."""
    end_version: int | None = None
    """The generators' version when the group was committed."""
    committed_at: float | None = None
    index: int = field(kw_only=True)
    """The group's position in the prompt stream (what the prompt ledger records)."""
    worker: str = field(default="", kw_only=True)
    """The rollout worker a single-turn group's request went to ("" for a group of multi-turn
    episodes, whose turns each pick one, or a group restored from a checkpoint)."""
    prompt_text: str = field(default="", kw_only=True)
    """The prompt as one line of text, for completion tables ("" when restored)."""
    prompt: Prompt | None = field(default=None, kw_only=True, repr=False)
    """The prompt itself, for scoring and for dispatching the group again (``None`` when
    restored from a checkpoint: such a group is scored already)."""
    state: str = field(default=GENERATING, kw_only=True)
    finished: int = field(default=0, kw_only=True)
    """Samples (episodes) back of this dispatch, complete or cut short."""
    ready_seq: int = field(default=-1, kw_only=True)
    """Completion order among ready groups (-1 while not ready)."""
    retries: int = field(default=0, kw_only=True)
    """Times its generation failed and was retried (a worker's death is not counted)."""
    informative: bool = field(default=False, kw_only=True)
    """Dynamic sampling found its rewards spread out (it keeps it, and does not look again)."""

    @property
    def n(self) -> int:
        """Samples (episodes) in the group."""
        return len(self.samples)

    @property
    def ready(self) -> bool:
        """Scored: every sample came back and has its reward."""
        return self.state == READY

    @property
    def rewards(self) -> Sequence[float]:
        """The scored samples' rewards once ready (a view, not a copy); empty before."""
        return Rewards(self.samples) if self.state == READY else ()
