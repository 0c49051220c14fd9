"""The run's tool calls: a deadline per call, a concurrency limit, errors as observations.

One :class:`ToolBox` per run, owned by the controller; every episode's calls go through it::

    box = ToolBox([calc, search], timeout_s=30.0, max_concurrent=64, now=run_clock)
    turn = parser.parse(text)                  # asyncrl.env.tool_parsers
    for result in await box.answer(turn):      # the turn's calls, at once, in the model's order
        messages.append(result.message())      # {"role": "tool", "content": ..., ...}

A call never fails the run for what the model or the tool did: an unknown tool, arguments the
schema refuses, a malformed call in the text, a tool that raised, one past its deadline
(cancelled), a result that is not text or JSON all come back as a :class:`ToolResult` whose
``content`` says what went wrong, for the model to read. A call waits for a token of the box's
limiter (at most ``max_concurrent`` tools run at once, run-wide); its deadline counts from
when it starts running. Cancelling the caller cancels the tool at once, in the caller's task.

A tool is a coroutine on the controller's event loop: it must not block. Blocking code runs
through :func:`blocking`, on a daemon thread that a cancellation (the deadline, an evicted
episode, the run stopping) does not wait for.

The box counts calls, errors by kind (:data:`~asyncrl.env.tools.ERROR_KINDS`), cancellations,
latencies, waits and the peak concurrency, and records each call's span on the clock it was
given (``now``: the run's clock, for the timeline); :meth:`ToolBox.take_stats` hands them
over and starts afresh, once a step.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import structlog

from asyncrl.data.deadlines import AbandonedThreadsError, in_thread
from asyncrl.env.tools import ERROR_KINDS, Tool, ToolCall, ToolCallError, ToolResult

__all__ = ["MAX_SAMPLES", "ToolBox", "ToolSpan", "ToolStats", "blocking"]

log = structlog.get_logger("asyncrl.env.toolbox")

MAX_SAMPLES = 100_000
"""Latency samples, waits and spans kept per step (each); past it they are counted in
``ToolStats.dropped``, so a step with a flood of calls cannot grow the box without bound."""

_MAX_ERROR_CHARS = 2_000
T = TypeVar("T")


async def blocking(
    fn: Callable[..., T], /, *args: Any, limiter: anyio.CapacityLimiter | None = None,
    **kwargs: Any,
) -> T:  # fmt: skip
    """``fn(*args, **kwargs)`` on a daemon thread, for a tool's blocking code (a ``requests``
    call, a subprocess wait, a CPU-bound parse). Unlike ``anyio.to_thread.run_sync`` (which
    holds a cancellation until the thread returns, and whose threads the interpreter joins at
    exit), a cancellation returns at once and leaves the thread to finish on its own
    (:func:`asyncrl.data.deadlines.in_thread`). Inside a box's tool the threads are bounded by
    the box's ``max_concurrent``; elsewhere pass a ``limiter``.

    Cancellation: returns at once; the thread runs on until ``fn`` returns (it counts as
    abandoned until then).

    Raises:
        AbandonedThreadsError: too many abandoned calls (rewards' and tools') still run; the
            box lets it through to stop the run.
        BaseException: whatever ``fn`` raised.
    """
    call = functools.partial(fn, *args, **kwargs)
    try:
        return await in_thread(call, limiter=limiter or anyio.CapacityLimiter(1))
    except AbandonedThreadsError as exc:
        raise AbandonedThreadsError(
            f"{exc} (tool code run with asyncrl.env.toolbox.blocking counts too: make its "
            "blocking calls return, e.g. give them a timeout)"
        ) from exc


@dataclass(frozen=True)
class ToolSpan:
    """One call's run, from when it got its limiter token to when it ended, on the box's
    clock; ``outcome`` is ``ok``, an error kind or ``cancelled``."""

    name: str
    start: float
    end: float
    outcome: str


@dataclass
class ToolStats:
    """What the box did since the last :meth:`ToolBox.take_stats`."""

    calls: int = 0
    """Calls answered (each :class:`ToolResult`), errors included; not the cancelled ones."""
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    cancelled: int = 0
    """Calls whose caller was cancelled (no result)."""
    latencies_s: list[float] = field(default_factory=list)
    """How long each answered call's tool ran."""
    waits_s: list[float] = field(default_factory=list)
    """How long each call that ran waited for the concurrency limit."""
    spans: list[ToolSpan] = field(default_factory=list)
    max_in_flight: int = 0
    max_waiting: int = 0
    dropped: int = 0
    """Samples and spans left out past :data:`MAX_SAMPLES`."""

    @property
    def timeouts(self) -> int:
        return self.errors["timeout"]

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a step's metrics line (``tool_*``)."""
        out: dict[str, float] = {
            "tool_calls": self.calls,
            "tool_errors": sum(self.errors.values()),
            "tool_cancelled": self.cancelled,
            "tool_in_flight_max": self.max_in_flight,
            "tool_waiting_max": self.max_waiting,
        }
        out.update({f"tool_errors_{kind}": n for kind, n in self.errors.items()})
        for name, values in (("latency", self.latencies_s), ("wait", self.waits_s)):
            if values:
                ordered = sorted(values)
                out[f"tool_{name}_p50_s"] = _quantile(ordered, 0.50)
                out[f"tool_{name}_p99_s"] = _quantile(ordered, 0.99)
                out[f"tool_{name}_max_s"] = ordered[-1]
        return out

    def busy_by_tool(self) -> dict[str, list[list[float]]]:
        """Each tool's busy time (the union of its calls' spans), ``{name: [[start, end],
        ...]}`` in seconds on the box's clock (microseconds): what a step record carries for
        the timeline's tool lanes, as ``gen_by_worker`` does for the generators'."""
        by_tool: dict[str, list[tuple[float, float]]] = {}
        for s in self.spans:
            by_tool.setdefault(s.name, []).append((s.start, s.end))
        out = {}
        for name, intervals in sorted(by_tool.items()):
            merged: list[list[float]] = []
            for a, b in sorted(intervals):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            out[name] = [[round(a, 6), round(b, 6)] for a, b in merged]
        return out


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _Turn(Protocol):
    calls: Sequence[ToolCall]
    errors: Sequence[ToolCallError]


class ToolBox:
    """The run's tools and the rules their calls run under.

    Args:
        tools: The tools, by their unique names.
        timeout_s: Each call's deadline, from when it starts running (a tool's own
            ``timeout_s`` overrides it).
        max_concurrent: Tools running at once, across every episode of the run.
        max_result_chars: A longer result is cut there, with a note saying how much was cut.
        now: The clock of the spans (e.g. the run's: seconds since the controller started).

    Raises:
        ValueError: two tools with one name, or a limit that is not positive.
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        *,
        timeout_s: float = 60.0,
        max_concurrent: int = 64,
        max_result_chars: int = 16_000,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}: rename one (@tool(name=...))")
            self._tools[t.name] = t
        for what, value in (("timeout_s", timeout_s), ("max_concurrent", max_concurrent),
                            ("max_result_chars", max_result_chars)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"ToolBox {what} must be > 0, got {value!r}")
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._now = now
        self._in_flight = 0
        self._waiting = 0
        self._stats = ToolStats()
        self._warned: set[tuple[str, str]] = set()

    def names(self) -> list[str]:
        return list(self._tools)

    def definitions(self) -> list[dict[str, Any]]:
        """Every tool's OpenAI-style definition (a chat template's ``tools=``)."""
        return [t.definition for t in self._tools.values()]

    def in_flight(self) -> int:
        """Tools running now."""
        return self._in_flight

    def waiting(self) -> int:
        """Calls waiting for the concurrency limit now."""
        return self._waiting

    def take_stats(self) -> ToolStats:
        """The statistics since the last call; the box starts counting afresh."""
        stats, self._stats = self._stats, ToolStats()
        self._stats.max_in_flight, self._stats.max_waiting = self._in_flight, self._waiting
        return stats

    async def answer(self, turn: _Turn) -> list[ToolResult]:
        """The results of a parsed turn (:class:`~asyncrl.env.tool_parsers.ParsedTurn`): its
        calls run at once, its malformed calls rejected, in the order the model wrote them.

        Cancellation: as :meth:`call`, for every call of the turn."""
        results = await self.call_all(turn.calls)
        answered = [(c.index, r) for c, r in zip(turn.calls, results, strict=True)]
        answered += [(e.index, self.reject(e)) for e in turn.errors]
        return [r for _, r in sorted(answered, key=lambda pair: pair[0])]

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """:meth:`call` for each call at once (each still under the limit); results in order.

        Cancellation: as :meth:`call`, for every call."""
        results: list[ToolResult | None] = [None] * len(calls)

        async def one(i: int) -> None:
            results[i] = await self.call(calls[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(one, i)
        return [r for r in results if r is not None]

    def reject(self, error: ToolCallError) -> ToolResult:
        """The observation for a malformed call in the model's text (counted as such)."""
        return self._refuse(error.id, "", "malformed", error.message)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call: check it, wait for a token of the limit, run the tool under its
        deadline. Returns the tool's output as text (a ``str`` as it is, anything else as
        JSON), or the error it met as text (never raises for it).

        Cancellation: cancels the tool in this task at once (its ``finally`` blocks run);
        a thread it started with :func:`blocking` is left to finish.

        Raises:
            AbandonedThreadsError: from :func:`blocking` (the process is piling up threads).
        """
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return self._refuse(call.id, call.name, "unknown_tool",
                                f"error: there is no tool named {call.name!r}; the tools are: "
                                f"{known}")  # fmt: skip
        try:
            arguments = tool.check(call.arguments)
        except ValueError as exc:
            return self._refuse(call.id, call.name, "bad_arguments", f"error: {exc}")
        queued = self._now()
        token = object()  # one per call: a task may make several calls (nested, at once)
        try:
            self._limiter.acquire_on_behalf_of_nowait(token)
        except anyio.WouldBlock:
            self._waiting += 1
            self._stats.max_waiting = max(self._stats.max_waiting, self._waiting)
            try:
                await self._limiter.acquire_on_behalf_of(token)
            finally:
                self._waiting -= 1
        try:
            return await self._run(tool, call.id, arguments, self._now() - queued)
        finally:
            self._limiter.release_on_behalf_of(token)

    async def _run(self, tool: Tool, call_id: str, arguments: dict[str, Any],
                   waited_s: float) -> ToolResult:  # fmt: skip
        timeout_s = tool.timeout_s or self.timeout_s
        self._in_flight += 1
        self._stats.max_in_flight = max(self._stats.max_in_flight, self._in_flight)
        start = self._now()
        outcome, content, raised = "cancelled", "", None
        try:
            with anyio.move_on_after(timeout_s) as scope:
                try:
                    value = await tool.fn(**arguments)
                except AbandonedThreadsError:
                    raise
                except Exception as exc:
                    outcome, raised = "raised", exc
                else:
                    outcome, content = self._render(tool.name, value)
            if scope.cancelled_caught or (scope.cancel_called and outcome == "raised"):
                outcome = "timeout"
                content = (f"error: tool {tool.name!r} did not finish within {timeout_s:g} s "
                           "and was stopped")  # fmt: skip
        finally:
            end = self._now()
            self._in_flight -= 1
            self._record(tool.name, start, end, outcome, waited_s)
        if outcome == "raised":
            content = self._raised(tool.name, raised)
        elif outcome in ("timeout", "bad_result"):  # the tool's fault: said once
            self._warn_once(tool.name, outcome, content)
        error = None if outcome == "ok" else outcome
        return ToolResult(id=call_id, name=tool.name, content=content, error=error,
                          seconds=end - start, waited_s=waited_s)  # fmt: skip

    def _render(self, name: str, value: Any) -> tuple[str, str]:
        """``(outcome, content)`` of a tool's return value."""
        try:
            text = value if isinstance(value, str) else json.dumps(
                value, ensure_ascii=False, allow_nan=False
            )
            text.encode("utf-8")  # a lone surrogate would break the tokenizer later
        except (TypeError, ValueError, RecursionError) as exc:
            content = (f"error: tool {name!r} returned a {type(value).__name__}, which is not "
                       f"text or JSON ({type(exc).__name__}: {_cut(str(exc), 200)})")  # fmt: skip
            return "bad_result", content
        if len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = text[: self.max_result_chars] + f"\n[... {cut} more characters cut]"
        return "ok", text

    def _raised(self, name: str, exc: BaseException | None) -> str:
        content = f"error: tool {name!r} failed: {type(exc).__name__}: {exc}"
        self._warn_once(name, f"raised {type(exc).__name__}", content, exc)
        return _cut(content, _MAX_ERROR_CHARS)

    def _refuse(self, call_id: str, name: str, kind: str, content: str) -> ToolResult:
        self._stats.calls += 1
        self._stats.errors[kind] += 1
        log.debug("tool_call_refused", tool=name, kind=kind, message=_cut(content, 300))
        return ToolResult(id=call_id, name=name, content=content, error=kind)

    def _record(self, name: str, start: float, end: float, outcome: str, waited: float) -> None:
        stats = self._stats
        if outcome == "cancelled":
            stats.cancelled += 1
        else:
            stats.calls += 1
            if outcome != "ok":
                stats.errors[outcome] += 1
        if len(stats.spans) >= MAX_SAMPLES:
            stats.dropped += 1
            return
        stats.spans.append(ToolSpan(name, start, end, outcome))
        stats.waits_s.append(waited)
        if outcome != "cancelled":
            stats.latencies_s.append(end - start)

    def _warn_once(self, name: str, what: str, message: str,
                   exc: BaseException | None = None) -> None:  # fmt: skip
        """A tool's own fault is logged once per tool and kind (then only counted)."""
        if (name, what) in self._warned or len(self._warned) >= 1_000:
            return
        self._warned.add((name, what))
        log.warning("tool_failed", tool=name, kind=what, message=_cut(message, 500),
                    exc_info=exc, note="logged once per tool and kind; the step's "
                    "tool_errors_* metrics count them all")  # fmt: skip


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
