"""The vLLM backend's turn (:class:`asyncrl_vllm.turns.EngineTurn`) under random interleavings
of requests and sleep/wake transitions: no request enters an engine that is not awake, a sleep
proceeds only once the engine is empty, every request ends (none lost, none waiting forever),
and the transitions refuse to run out of order. The engine is a stand-in here (requests that
run a few loop turns, or until the sleep stops them, as the backend's abort does); the real one
is ``tests/e2e/test_vllm_turns.py``'s."""

from __future__ import annotations

import random

import anyio
import pytest

pytest.importorskip("asyncrl_vllm")
from asyncrl_vllm.turns import EngineTurn  # noqa: E402

CYCLES = 200


def test_random_requests_across_200_sleeps_never_meet_a_sleeping_engine() -> None:
    async def main(seed: int) -> dict[str, int]:
        rng = random.Random(seed)
        turn = EngineTurn()
        stopping = anyio.Event()  # the backend's abort of what is inside, at a sleep
        counts = {"entered": 0, "done": 0, "stopped": 0, "sent": 0, "max_waiting": 0}

        async def request(turns: int) -> None:
            async with turn.request():
                assert turn.state == "awake"  # never into an engine falling asleep
                counts["entered"] += 1
                for _ in range(turns):
                    if stopping.is_set():
                        counts["stopped"] += 1  # goes on after the wake, as a new part
                        break
                    await anyio.lowlevel.checkpoint()
            counts["done"] += 1

        async with anyio.create_task_group() as tg:

            def send(k: int) -> None:
                for _ in range(k):
                    counts["sent"] += 1
                    tg.start_soon(request, rng.randint(0, 20))

            for _ in range(CYCLES):
                send(rng.randint(0, 6))
                for _ in range(rng.randint(0, 10)):
                    await anyio.lowlevel.checkpoint()
                turn.close()  # a sleep begins: arrivals now wait
                send(rng.randint(0, 3))
                stopping.set()
                await turn.drained()
                assert turn.inside == 0
                stopping = anyio.Event()
                kept = rng.random() < 0.5  # level 1 (LoRA) or level 2
                turn.slept(weights_kept=kept)
                send(rng.randint(0, 3))
                await anyio.lowlevel.checkpoint()
                counts["max_waiting"] = max(counts["max_waiting"], turn.waiting)
                turn.weights_back()
                if not kept:
                    with pytest.raises(RuntimeError, match="without weights"):
                        turn.woke()
                    turn.loaded()
                send(rng.randint(0, 2))
                turn.woke()
        assert turn.waiting == 0 and turn.inside == 0 and turn.state == "awake"
        return counts

    for seed in range(3):
        counts = anyio.run(main, seed)
        # every request sent entered the engine once and ended: none lost, none waiting
        assert counts["entered"] == counts["done"] == counts["sent"], counts
        assert counts["stopped"] > 0 and counts["max_waiting"] > 0, counts


def test_transitions_out_of_order_are_refused() -> None:
    async def main() -> None:
        turn = EngineTurn()
        for wrong in (turn.woke, turn.weights_back, turn.reopen):
            with pytest.raises(RuntimeError, match="while the engine is awake"):
                wrong()
        with pytest.raises(RuntimeError):
            turn.slept(weights_kept=True)
        turn.close()
        with pytest.raises(RuntimeError, match="sleep while the engine is closing"):
            turn.close()
        turn.reopen()  # a sleep that failed: serving as before
        async with turn.request():
            assert turn.inside == 1

    anyio.run(main)


def test_a_held_request_cancelled_while_waiting_leaves_the_queue() -> None:
    async def main() -> None:
        turn = EngineTurn()
        turn.close()
        with anyio.move_on_after(0.01):
            async with turn.request():
                raise AssertionError("entered a closing engine")
        assert turn.waiting == 0 and turn.inside == 0

    anyio.run(main)
