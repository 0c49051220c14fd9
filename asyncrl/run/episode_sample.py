"""Where an episode becomes a training sample: a multi-turn episode of the run's environment, or
a gateway session (whose turns are an agent program's calls), ends with its recorded
trajectory and its score; this makes them the :class:`~asyncrl.policy.groups.CompletedSample`
its group commits (pure).

The trajectory is token ids throughout: each part's prompt is the template's render (tools
included), its response the engine's generated ids with the inserted observations between
them, each token with its behaviour logprob, its weight version and its loss mask (only
generated tokens train). A template that would re-render earlier turns differently split the
episode into several parts: they come along as ``earlier`` and train with the same reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncrl.env.segments import TrajectorySample
from asyncrl.environment import Score
from asyncrl.policy.groups import CompletedSample, Part

__all__ = ["training_sample"]


def training_sample(
    parts: Sequence[TrajectorySample], score: Score, truncated: str | None, *, mask_truncated: bool
) -> CompletedSample | None:
    """The episode whose trajectory is ``parts`` (in order; the last one is the sample, the
    others its ``earlier`` parts) and whose reward is ``score``, as one training sample; None
    when it generated nothing. ``truncated``: why the episode was cut short (its
    ``finish_reason`` then), if it was; with ``mask_truncated`` (``episode.on_truncation =
    "mask"``) such an episode trains no token."""
    done = [_part(p, truncated is not None and mask_truncated) for p in parts]
    if not done:
        return None
    *earlier, last = done
    return CompletedSample(
        token_ids=last.token_ids, logprobs=last.logprobs,
        finish_reason=truncated or last.finish_reason, reward=float(score.reward),
        correct=bool(score.correct), components=dict(score.components),
        loss_mask=last.loss_mask, prompt_ids=last.prompt_ids, earlier=tuple(earlier),
        versions=last.versions,
    )  # fmt: skip


def _part(sample: TrajectorySample, masked: bool) -> Part:
    return Part(
        prompt_ids=sample.prompt_ids, token_ids=sample.response_ids, logprobs=sample.logprobs,
        loss_mask=np.zeros_like(sample.loss_mask) if masked else sample.loss_mask,
        finish_reason=sample.finish_reason, versions=sample.versions,
    )  # fmt: skip
