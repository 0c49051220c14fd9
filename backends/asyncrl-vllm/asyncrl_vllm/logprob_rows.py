"""The sampled-token logprob rows of requests that only want their final output (pure; numpy
and the standard library only).

vLLM's engine core slices every step's logprobs per request, serialises each slice into that
step's output (three small numpy arrays per request per step) and the front end decodes them
again, though a ``FINAL_ONLY`` request shows nothing before its end. :class:`HeldRows` keeps
those rows in the engine core instead (:mod:`asyncrl_vllm.scheduler` feeds it) and hands
them over once, with the request's last output.

A row is what vLLM's ``LogprobsLists`` holds for one generated token: the token ids its
logprobs are of (the sampled token first, then the top ``k``), their logprobs, and the
sampled token's rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["HeldRows", "Rows", "StepColumns"]


@dataclass(frozen=True, slots=True)
class StepColumns:
    """One step's logprobs as flat Python lists (one ``tolist()`` per step, not per
    request): row ``r``'s ``width`` entries (the step's largest ``k`` + 1) are
    ``token_ids[r * width : (r + 1) * width]`` and the same of ``logprobs``; ``ranks[r]`` is
    its sampled token's rank. Flat lists of numbers hold no objects the garbage collector
    tracks, where a list per row would be 128+ more for it to walk every step. ``dtypes``
    are the arrays' (token ids, logprobs, ranks), so that a request's rows go back as the
    engine made them."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    width: int
    dtypes: tuple[np.dtype, np.dtype, np.dtype]

    @classmethod
    def of(cls, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> StepColumns:
        width = int(token_ids.shape[1]) if token_ids.ndim == 2 else 1
        return cls(
            token_ids.ravel().tolist(), logprobs.ravel().tolist(), ranks.ravel().tolist(),
            width, (token_ids.dtype, logprobs.dtype, ranks.dtype),
        )  # fmt: skip

    @property
    def rows(self) -> int:
        return len(self.ranks)


@dataclass(slots=True)
class Rows:
    """One request's rows so far (flat, as in :class:`StepColumns`), each cut to the
    request's own ``width`` (its ``k`` + 1: a step's rows are as wide as the widest request
    in it asked for)."""

    width: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    dtypes: tuple[np.dtype, np.dtype, np.dtype] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(token_ids [n, k+1], logprobs [n, k+1], ranks [n])`` in the engine's dtypes."""
        ids_t, lps_t, ranks_t = self.dtypes or (np.dtype(np.int64), np.dtype(np.float32),
                                                np.dtype(np.int64))  # fmt: skip
        n = len(self.ranks)
        return (
            np.asarray(self.token_ids, dtype=ids_t).reshape(n, self.width),
            np.asarray(self.logprobs, dtype=lps_t).reshape(n, self.width),
            np.asarray(self.ranks, dtype=ranks_t),
        )


class HeldRows:
    """The rows of every held request, by request id. One owner (the engine core's
    scheduler); a request is held from :meth:`hold` until :meth:`take` or :meth:`drop`."""

    def __init__(self) -> None:
        self._rows: dict[str, Rows] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def hold(self, request_id: str, logprobs: int) -> None:
        """Keep ``request_id``'s rows from now on: the sampled token's and the top
        ``logprobs`` (again: no change).

        Raises:
            ValueError: ``logprobs`` is negative.
        """
        if logprobs < 0:
            raise ValueError(f"request {request_id}: logprobs must be >= 0, got {logprobs}")
        self._rows.setdefault(request_id, Rows(logprobs + 1))

    def add(self, request_id: str, step: StepColumns, start: int, count: int) -> None:
        """Rows ``start .. start + count`` of ``step`` are ``request_id``'s next ``count``
        tokens' (a request not held is ignored).

        Raises:
            ValueError: the step has fewer rows than that, or narrower ones than the request
                asked for.
        """
        rows = self._rows.get(request_id)
        if rows is None or count <= 0:
            return
        end = start + count
        if start < 0 or end > step.rows or step.width < rows.width:
            raise ValueError(
                f"request {request_id}: rows {start}..{end} of width {rows.width} from a step "
                f"of {step.rows} rows of width {step.width}"
            )
        w, sw = rows.width, step.width
        if count == 1 and w == 1:  # the common case: the sampled token's entry only
            rows.token_ids.append(step.token_ids[start * sw])
            rows.logprobs.append(step.logprobs[start * sw])
            rows.ranks.append(step.ranks[start])
        elif w == sw:
            rows.token_ids.extend(step.token_ids[start * sw : end * sw])
            rows.logprobs.extend(step.logprobs[start * sw : end * sw])
            rows.ranks.extend(step.ranks[start:end])
        else:
            for r in range(start, end):
                rows.token_ids.extend(step.token_ids[r * sw : r * sw + w])
                rows.logprobs.extend(step.logprobs[r * sw : r * sw + w])
            rows.ranks.extend(step.ranks[start:end])
        if rows.dtypes is None:
            rows.dtypes = step.dtypes

    def take(self, request_id: str) -> Rows | None:
        """``request_id``'s rows, no longer held (``None`` if it was not)."""
        return self._rows.pop(request_id, None)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget these requests' rows (aborted: nobody will read them)."""
        for rid in request_ids:
            self._rows.pop(rid, None)

    def keep_only(self, live: Sequence[str] | set[str] | dict[str, object]) -> int:
        """Forget every held request not in ``live``; returns how many were forgotten."""
        gone = [rid for rid in self._rows if rid not in live]
        self.drop(gone)
        return len(gone)
