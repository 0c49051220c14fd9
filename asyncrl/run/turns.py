"""Whose turn it is on a shared GPU (``cluster.placement = "take_turns"``; docs/one-gpu.md):
the engines generate while the trainer waits with its optimizer state in host memory, then the
engines sleep while the trainer steps, and the step's refit wakes them with the new weights.

::

    engines' turn ─ a step's groups are in ─► to_trainer(): dispatch stops; a validation under
    (dispatch)      way ends; (refit.drain: the samples in flight end); Sleep ∥ every engine
                    (what is still in flight stops and is held); the trainers' state back
    trainer's turn ─ the step trains, FinishStep ─► before_refit(): the trainers' state to host
                    memory ─► the refit wakes the engines (asyncrl.run.refit) ─► to_engines():
                    dispatch again

A rollout worker restarted in the trainer's turn is held before its engine starts (its
``Init`` waits: :meth:`~asyncrl.wire.rpc.ControlPlane.hold_starts`) until the engines' turn;
the switch to the trainer's turn waits for an engine starting (and syncing) then, and puts it
to sleep with the others. An engine never starts while the trainer steps.

In sync mode nothing is in flight at the switch. In the asynchronous modes the samples in
flight stop at the sleep and go on from their tokens after the wake, on the new weights (as
``in_flight_at_refit = "reprefill"`` has them), each token keeping the version that made it; with
``refit.drain`` they end first. The switch is this module's; what an engine does when it sleeps
is its backend's (``Sleeps``), what a trainer moves its (``StateOffload``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from asyncrl.run.context import RunContext
from asyncrl.wire.messages import MoveState, Sleep, TurnResult

__all__ = ["Turns"]

log = structlog.get_logger("asyncrl.run.turns")

STARTING_POLL_S = 0.05
"""How often the switch to the trainer's turn looks whether a starting engine serves yet."""


class Turns:
    """The turn on the run's shared GPUs, and what each switch took (each step's record takes
    it: :meth:`take`). Off (``placement = "resident"``): every method returns at once and
    dispatch is never held.

    Args:
        ctx: the run's parts.
        offload: the trainers' optimizer state leaves the GPU in the engines' turn (the memory
            plan's decision, ``cluster.trainer_offload``).
        before_sleep: awaited before the engines sleep (a validation under way must end: its
            requests would wait for the wake, and the step for it).
        drain: with ``refit.drain``, awaited before the engines sleep (the samples in flight
            end first).
    """

    def __init__(
        self,
        ctx: RunContext,
        *,
        offload: bool,
        before_sleep: Callable[[], Awaitable[None]],
        drain: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.enabled = ctx.config.cluster.placement == "take_turns"
        self.offload = offload and self.enabled
        self._control, self._trainers, self._serving = ctx.control, ctx.trainers, ctx.serving
        self._changed, self._timeout_s = ctx.changed, ctx.config.cluster.call_timeout_s
        self._before_sleep, self._drain = before_sleep, drain
        self._engines = True
        """The engines' turn (they serve): dispatch goes on."""
        self._state_on_host = False
        self._record: dict[str, float] = {}
        if self.enabled:  # an engine restarted in the trainer's turn waits for the engines'
            self._control.hold_starts(lambda hello: self._engines or hello.group != "rollout")

    @property
    def dispatching(self) -> bool:
        """Whether groups may be dispatched now (always, unless the trainer has the turn)."""
        return self._engines

    async def to_trainer(self) -> None:
        """The trainer's turn begins (its step's groups are in): stop dispatching, let what
        must end end, put every serving engine to sleep, bring the trainers' state back.
        Already the trainer's: nothing. Cancellation: the run is over."""
        if not self.enabled or not self._engines:
            return
        self._engines = False
        start = time.perf_counter()
        await self._before_sleep()
        if self._drain is not None:
            await self._drain()
        await self._engines_started()
        engines = list(self._serving())
        results: list[Any] = []

        async def sleep(worker: str) -> None:  # one restarting sleeps after its refit
            results.append(await self._control.call_unless_restarting(
                worker, Sleep(), timeout_s=self._timeout_s))  # fmt: skip

        slept = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for worker in engines:
                tg.start_soon(sleep, worker)
        turns = [r for r in results if isinstance(r, TurnResult)]
        self._add("turn_sleep_s", max((r.seconds for r in turns), default=0.0))
        self._add("turn_held_requests", sum(r.held for r in turns))
        if self._state_on_host:
            self._add("turn_state_to_device_s", await self._move("device"))
            self._state_on_host = False
        self._add("turn_to_trainer_s", time.perf_counter() - start)
        log.debug("trainer_turn", engines=len(engines), wait_s=slept - start)

    async def before_refit(self) -> None:
        """The step is taken: the trainers' optimizer state leaves the GPU (when the plan says
        so) before the refit wakes the engines."""
        if self.offload and not self._state_on_host and not self._engines:
            self._add("turn_state_to_host_s", await self._move("host"))
            self._state_on_host = True

    async def to_engines(self) -> None:
        """The refit woke the engines with the new weights: dispatch again, and the engines
        restarted meanwhile start."""
        if self.enabled and not self._engines:
            self._engines = True
            self._changed.notify()
            await self._control.admit_held()

    def take(self) -> dict[str, float]:
        """What the switches since the last take measured, for a step's record: the engines'
        sleep (``turn_sleep_s``: the slowest), the requests it stopped, the trainers' state
        moves and the whole switch to the trainer. Empty when nothing switched."""
        record, self._record = self._record, {}
        return record

    async def _engines_started(self) -> None:
        """Wait while a restarted rollout worker's engine is starting or syncing (admitted in
        the engines' turn): it sleeps with the others once it serves. Bounded by the restart's
        own ``cluster.startup_timeout_s``, past which the run fails."""
        start, waited = time.perf_counter(), False
        while starting := [w for w in self._control.started("rollout")
                           if w not in self._serving()]:  # fmt: skip
            if not waited:
                log.info("trainer_turn_waits_for_engines", starting=starting)
                waited = True
            await anyio.sleep(STARTING_POLL_S)
        if waited:
            self._add("turn_start_wait_s", time.perf_counter() - start)

    async def _move(self, to: str) -> float:
        """``MoveState`` on every trainer rank; the slowest's seconds."""
        results = await self._control.call_each(self._trainers, [MoveState(to=to)] * len(
            self._trainers), timeout_s=self._timeout_s)  # fmt: skip
        turns = [r for r in results if isinstance(r, TurnResult)]
        moved = sum(r.moved_bytes for r in turns)
        self._add(f"turn_state_to_{to}_gib", moved / 2**30)
        return max((r.seconds for r in turns), default=0.0)

    def _add(self, key: str, value: float) -> None:
        self._record[key] = self._record.get(key, 0) + value
