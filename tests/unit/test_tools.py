"""Tools (asyncrl.env.tools) and the run's tool box (asyncrl.env.toolbox).

Schemas are compared with JSON written by hand; refusals must name the argument; the box's
deadline, concurrency limit and cancellation are checked on the real event loop (the
deadline's overshoot is printed: run with ``-s`` to see it; the cancellation latencies are
measured by ``benchmarks/cancellation.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Annotated, Any, Literal

import anyio
import anyio.lowlevel
import pytest

from asyncrl.data.deadlines import abandoned_threads
from asyncrl.env.toolbox import ToolBox, ToolSpan, ToolStats, blocking
from asyncrl.env.tools import Tool, ToolCall, ToolCallError, schema_from_signature, tool

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, id="c1")


@tool
async def search(
    query: str,
    limit: int = 5,
    threshold: float | None = None,
    exact: bool = False,
    tags: list[str] | None = None,
    order: Literal["new", "old"] = "new",
    weights: dict[str, float] | None = None,
    lang: Annotated[str, "An ISO 639-1 code."] = "en",
) -> dict[str, Any]:
    """Search the notes.

    Matches words, not substrings.

    Args:
        query: The words to find,
            all of them.
        limit (int): At most this many hits.
        threshold: The lowest score kept.
        exact: Match case.
        tags: Only notes with all these tags.
        order: Newest or oldest first.

    Returns:
        The hits.
    """
    return {"query": query, "limit": limit}


# ------------------------------------------------------------------------ definitions
def test_schema_from_a_signature_is_the_json_written_by_hand() -> None:
    expected = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.\n\nMatches words, not substrings.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "The words to find, all of them."},
                    "limit": {"type": "integer", "description": "At most this many hits.",
                              "default": 5},
                    "threshold": {"type": ["number", "null"],
                                  "description": "The lowest score kept.", "default": None},
                    "exact": {"type": "boolean", "description": "Match case.", "default": False},
                    "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                       {"type": "null"}],
                             "description": "Only notes with all these tags.", "default": None},
                    "order": {"type": "string", "enum": ["new", "old"],
                              "description": "Newest or oldest first.", "default": "new"},
                    "weights": {"anyOf": [{"type": "object",
                                           "additionalProperties": {"type": "number"}},
                                          {"type": "null"}], "default": None},
                    "lang": {"type": "string", "description": "An ISO 639-1 code.",
                             "default": "en"},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    }  # fmt: skip
    assert search.definition == expected
    assert ToolBox([search]).definitions() == [expected]


def test_an_explicit_schema_is_kept_and_checked_against_the_function() -> None:
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def add_one(a: int) -> int:
        return a + 1

    t = tool(add_one, name="inc", description="Add one.", parameters=params, timeout_s=2.0)
    assert t.definition == {"type": "function", "function": {
        "name": "inc", "description": "Add one.", "parameters": params}}  # fmt: skip
    assert t.timeout_s == 2.0
    params["properties"]["a"]["type"] = "string"  # the tool kept its own copy
    assert t.parameters["properties"]["a"] == {"type": "integer"}
    with pytest.raises(TypeError, match=r"\['b'\] that add_one does not take"):
        Tool(add_one, name="x", description="d", parameters={
            "type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]})  # fmt: skip
    with pytest.raises(TypeError, match=r"add_one needs \['a'\]"):
        Tool(add_one, name="x", description="d", parameters={"type": "object"})
    with pytest.raises(TypeError, match="not a valid JSON schema"):
        Tool(add_one, name="x", description="d", parameters={"type": "object",
                                                             "properties": 3})  # fmt: skip


async def _noop() -> str:
    """Does nothing."""
    return ""


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tool(lambda: None), "not an async function"),
        (lambda: tool(_noop, name="has space"), "tool name 'has space'"),
        (lambda: tool(_noop, description=""), "has no description"),
        (lambda: tool(_noop, timeout_s=0), "timeout_s must be > 0"),
    ],
)
def test_a_bad_tool_is_refused_with_the_fix(make: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        make()


def test_a_parameter_without_a_json_schema_is_named() -> None:
    async def f(when: complex) -> str:
        """Doc."""
        return ""

    async def g(x) -> str:  # type: ignore[no-untyped-def]
        """Doc."""
        return ""

    async def h(*items: str) -> str:
        """Doc."""
        return ""

    async def k(m: dict[int, str]) -> str:
        """Doc."""
        return ""

    with pytest.raises(TypeError, match=r"f\(when\): no JSON schema for the type"):
        schema_from_signature(f)
    with pytest.raises(TypeError, match=r"g\(x\) has no type hint"):
        schema_from_signature(g)
    with pytest.raises(TypeError, match=r"h\(items\): a tool takes named arguments only"):
        schema_from_signature(h)
    with pytest.raises(TypeError, match=r"k\(m\): JSON object keys are strings"):
        schema_from_signature(k)


def test_any_json_and_bare_containers() -> None:
    async def f(  # noqa: ANN401
        x: Any, items: list, table: dict, n: Literal[1, 2], m: Literal["a", 1]
    ) -> str:
        """Doc."""
        return ""

    assert schema_from_signature(f)["properties"] == {
        "x": {}, "items": {"type": "array"}, "table": {"type": "object"},
        "n": {"type": "integer", "enum": [1, 2]}, "m": {"enum": ["a", 1]},
    }  # fmt: skip


# ------------------------------------------------------------------------ checking
@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        ({}, ["'query' is missing (required)"]),
        ({"query": 5}, ["argument 'query': 5 is not of type 'string'"]),
        ({"query": "a", "limit": True}, ["argument 'limit': True is not of type 'integer'"]),
        ({"query": "a", "order": "mid"}, ["argument 'order': 'mid' is not one of"]),
        ({"query": "a", "tags": ["x", 2]}, ["argument 'tags'"]),
        ({"query": "a", "bogus": 1}, ["'bogus' was unexpected"]),
        ({"query": 1, "limit": "x"}, ["argument 'limit'", "argument 'query'"]),
    ],
)
def test_refused_arguments_name_the_field(arguments: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        search.check(arguments)
    text = str(info.value)
    assert text.startswith("invalid arguments for tool 'search': ")
    assert all(n in text for n in names), text
    assert "Its parameters: {" in text


def test_arguments_that_are_not_an_object_are_refused() -> None:
    with pytest.raises(ValueError, match="must be a JSON object, got an array"):
        search.check(["q"])


def test_an_integral_float_becomes_an_int_and_the_rest_is_untouched() -> None:
    checked = search.check({"query": "q", "limit": 3.0, "threshold": 0.5})
    assert checked == {"query": "q", "limit": 3, "threshold": 0.5}
    assert type(checked["limit"]) is int
    with pytest.raises(ValueError, match="argument 'limit'"):
        search.check({"query": "q", "limit": 3.5})


# ------------------------------------------------------------------------ the box
@tool
async def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


async def test_answers_and_errors_are_observations_never_exceptions() -> None:
    box = ToolBox([divide, search], max_result_chars=50)
    ok = await box.call(call("divide", a=1, b=4))
    assert (ok.content, ok.error, ok.ok, ok.id, ok.name) == ("0.25", None, True, "c1", "divide")
    hits = await box.call(call("search", query="héllo"))
    assert hits.content == '{"query": "héllo", "limit": 5}'
    cases = {
        "unknown_tool": (call("nope"), "there is no tool named 'nope'; the tools are: divide, "
                                       "search"),
        "bad_arguments": (call("divide", a=1), "'b' is missing"),
        "raised": (call("divide", a=1, b=0), "failed: ZeroDivisionError: division by zero"),
    }  # fmt: skip
    for kind, (c, text) in cases.items():
        result = await box.call(c)
        assert result.error == kind and text in result.content and not result.ok
        assert result.content.startswith("error: ")
    assert box.reject(ToolCallError(index=2, id="e2", message="error: bad")).error == "malformed"
    stats = box.take_stats()
    assert stats.calls == 6 and stats.cancelled == 0
    assert stats.errors == {"malformed": 1, "unknown_tool": 1, "bad_arguments": 1,
                            "raised": 1, "timeout": 0, "bad_result": 0}  # fmt: skip
    assert len(stats.latencies_s) == 3  # the calls that ran
    assert [s.outcome for s in stats.spans] == ["ok", "ok", "raised"]
    assert box.take_stats().calls == 0  # taken: the box starts afresh


@pytest.mark.parametrize(
    ("value", "content", "error"),
    [
        ("plain", "plain", None),
        ({"a": [1, None, True]}, '{"a": [1, null, true]}', None),
        (None, "null", None),
        ("x" * 60, "x" * 50 + "\n[... 10 more characters cut]", None),
        ({1, 2}, "returned a set, which is not text or JSON", "bad_result"),
        (float("nan"), "returned a float, which is not text or JSON", "bad_result"),
        (b"bytes", "returned a bytes", "bad_result"),
        ("\ud800", "returned a str, which is not text or JSON", "bad_result"),
    ],
)
async def test_results_become_text(value: Any, content: str, error: str | None) -> None:
    @tool
    async def give() -> Any:  # noqa: ANN401
        """Give the value."""
        return value

    result = await ToolBox([give], max_result_chars=50).call(call("give"))
    assert result.error == error
    assert content in result.content if error else result.content == content


async def test_a_tool_past_its_deadline_is_stopped_and_reported() -> None:
    stopped = []

    @tool
    async def hang() -> str:
        """Never returns."""
        try:
            await anyio.sleep_forever()
        finally:
            stopped.append(time.perf_counter())
        return ""

    @tool(timeout_s=0.1)
    async def stuck_thread() -> str:
        """Blocks in a thread."""
        await blocking(release.wait)
        return ""

    release = threading.Event()
    box = ToolBox([hang, stuck_thread], timeout_s=0.2)
    start = time.perf_counter()
    result = await box.call(call("hang"))
    late = time.perf_counter() - start - 0.2
    assert result.error == "timeout" and stopped
    assert result.content == "error: tool 'hang' did not finish within 0.2 s and was stopped"
    stuck = await box.call(call("stuck_thread"))
    late_thread = time.perf_counter() - start - 0.3
    release.set()
    print(f"\ndeadline overshoot: {late * 1e3:.2f} ms (coroutine), "
          f"{late_thread * 1e3:.2f} ms (thread)")  # fmt: skip
    # Measured 1-2 ms (coroutine) and 2.5-3.7 ms (thread) idle, up to 7 ms loaded on the
    # 2-core dev box; 1 s is deliberately generous (a deadline is seconds, not milliseconds)
    assert 0 <= late < 1.0 and 0 <= late_thread < 1.0
    assert stuck.error == "timeout" and "within 0.1 s" in stuck.content
    assert box.take_stats().timeouts == 2


async def test_the_concurrency_limit_holds_across_many_callers() -> None:
    gate = anyio.Event()
    running = [0, 0]  # now, most

    @tool
    async def slow() -> str:
        """Waits for the gate."""
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            await gate.wait()
        finally:
            running[0] -= 1
        return "done"

    box = ToolBox([slow], max_concurrent=4)
    async with anyio.create_task_group() as tg:
        results = []
        for _ in range(50):
            tg.start_soon(lambda: _append(results, box.call(call("slow"))))
        await anyio.wait_all_tasks_blocked()
        assert (box.in_flight(), box.waiting(), running[0]) == (4, 46, 4)
        gate.set()
    stats = box.take_stats()
    assert running[1] == 4 and stats.max_in_flight == 4 and stats.max_waiting == 46
    assert [r.content for r in results] == ["done"] * 50
    assert sum(w > 0 for w in stats.waits_s) >= 46
    assert box.in_flight() == box.waiting() == 0


async def _append(out: list[Any], awaitable: Any) -> None:
    out.append(await awaitable)


async def test_nested_calls_from_one_task_each_take_a_token() -> None:
    @tool
    async def outer() -> str:
        """Calls inner."""
        return (await box.call(call("inner"))).content + "!"

    @tool
    async def inner() -> str:
        """Inner."""
        return "in"

    box = ToolBox([outer, inner], max_concurrent=2)
    assert (await box.call(call("outer"))).content == "in!"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


CANCEL_BOUND_S = 1.0
"""Issue 24's requirement: cancelling a tool's caller cancels the tool within 1 s (p99). The
latencies themselves are measured by ``benchmarks/cancellation.py``."""


async def _cancel_latency(box: ToolBox, name: str, entered: list[anyio.Event],
                          finished: list[float]) -> float:  # fmt: skip
    """Seconds from cancelling a caller blocked in tool ``name`` to the tool's ``finally``."""
    entered.append(anyio.Event())
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await box.call(call(name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await entered[-1].wait()
        await anyio.sleep(0)  # let the tool reach its await
        start = time.perf_counter()
        scope.cancel()
    return finished[-1] - start


async def tool_cancel_latencies(trials: int) -> tuple[list[float], ToolBox]:
    """Cancel the caller of a coroutine tool that never returns, ``trials`` times: the
    latency of each, and the box (its statistics)."""
    entered: list[anyio.Event] = []
    finished: list[float] = []

    @tool
    async def hang() -> str:
        """Never returns."""
        entered[-1].set()
        try:
            await anyio.sleep_forever()
        finally:
            finished.append(time.perf_counter())
        return ""

    box = ToolBox([hang], timeout_s=3600)
    return [await _cancel_latency(box, "hang", entered, finished) for _ in range(trials)], box


async def blocking_cancel_latencies(trials: int) -> tuple[list[float], float]:
    """Cancel the caller of a tool blocked in :func:`blocking` (a daemon thread), ``trials``
    times: the latency of each; then how long a tool blocked for 0.3 s in anyio's own
    ``to_thread.run_sync`` held its cancellation."""
    entered: list[anyio.Event] = []
    finished: list[float] = []
    release = threading.Event()

    token = anyio.lowlevel.current_token()

    def wait_in_thread(seconds: float) -> None:
        anyio.from_thread.run_sync(entered[-1].set, token=token)
        release.wait(seconds)

    @tool
    async def helper() -> str:
        """Blocks in a daemon thread (the documented way)."""
        try:
            await blocking(wait_in_thread, 30.0)
        finally:
            finished.append(time.perf_counter())
        return ""

    @tool
    async def plain() -> str:
        """Blocks in anyio's worker thread (holds the cancellation until it returns)."""
        try:
            await anyio.to_thread.run_sync(wait_in_thread, 0.3)
        finally:
            finished.append(time.perf_counter())
        return ""

    box = ToolBox([helper, plain], timeout_s=3600)
    latencies = []
    for _ in range(trials):
        latencies.append(await _cancel_latency(box, "helper", entered, finished))
        release.set()  # the abandoned thread ends; at most 16 may pile up
        with anyio.fail_after(5):
            while abandoned_threads():
                await anyio.sleep(0.001)
        release.clear()
    return latencies, await _cancel_latency(box, "plain", entered, finished)


async def test_cancelling_the_caller_cancels_the_tool_at_once() -> None:
    latencies, box = await tool_cancel_latencies(200)
    assert _quantile(latencies, 0.99) < CANCEL_BOUND_S, sorted(latencies)[-5:]
    stats = box.take_stats()
    assert stats.cancelled == 200 and stats.calls == 0 and box.in_flight() == 0
    assert {s.outcome for s in stats.spans} == {"cancelled"}


async def test_a_tool_blocked_in_a_thread_does_not_delay_cancellation() -> None:
    latencies, held = await blocking_cancel_latencies(50)
    assert held >= 0.25  # the measurement sees a held cancellation: this test can fail
    assert _quantile(latencies, 0.99) < CANCEL_BOUND_S, sorted(latencies)[-5:]


def test_statistics_give_the_step_metrics_and_the_timeline() -> None:
    spans = [ToolSpan("calc", 1.0, 2.0, "ok"), ToolSpan("calc", 1.5, 3.0, "timeout"),
             ToolSpan("calc", 4.0, 4.5, "ok"), ToolSpan("search", 0.1234567, 0.2, "raised")]
    stats = ToolStats(calls=4, latencies_s=[0.4, 0.1, 0.3, 0.2], spans=spans)
    stats.errors["timeout"] = 1
    assert stats.busy_by_tool() == {"calc": [[1.0, 3.0], [4.0, 4.5]],
                                    "search": [[0.123457, 0.2]]}  # fmt: skip
    m = stats.metrics()
    # nearest rank of [0.1, 0.2, 0.3, 0.4]: p50 is the 2nd, p99 the 4th
    assert (m["tool_latency_p50_s"], m["tool_latency_p99_s"], m["tool_latency_max_s"]) == (
        0.2, 0.4, 0.4)  # fmt: skip
    assert m["tool_calls"] == 4 and m["tool_errors"] == 1 and m["tool_errors_timeout"] == 1
    assert "tool_wait_p50_s" not in m


async def test_answer_runs_a_turn_in_the_models_order() -> None:
    class Turn:
        calls = [ToolCall(name="divide", arguments={"a": 1, "b": 2}, id="a", index=1),
                 ToolCall(name="divide", arguments={"a": 3, "b": 0}, id="c", index=3)]
        errors = [ToolCallError(index=2, id="b", message="error: your tool call #2 ...")]

    clock = iter(range(100))
    box = ToolBox([divide], now=lambda: float(next(clock)))
    results = await box.answer(Turn())
    assert [(r.id, r.error) for r in results] == [("a", None), ("b", "malformed"),
                                                  ("c", "raised")]  # fmt: skip
    assert results[1].message() == {"role": "tool", "content": "error: your tool call #2 ...",
                                    "tool_call_id": "b"}  # fmt: skip
    assert results[0].message() == {"role": "tool", "content": "0.5", "tool_call_id": "a",
                                    "name": "divide"}  # fmt: skip
    spans = box.take_stats().spans  # on the box's clock
    assert all(s.start < s.end and float(s.start).is_integer() for s in spans)


def test_the_box_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="two tools are named 'divide'"):
        ToolBox([divide, divide])
    with pytest.raises(ValueError, match="max_concurrent must be > 0"):
        ToolBox([divide], max_concurrent=0)
