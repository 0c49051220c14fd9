"""Groups that must be generated again: a generation that failed (retried after a back-off,
or dropped within the failure budget) and the groups of a rollout worker that died (sent
again at once, to the workers that serve). The scheduler decides each group's fate
(:meth:`~asyncrl.policy.schedule.Scheduler.failed`, :meth:`~asyncrl.policy.schedule.Scheduler.retry`);
this keeps their prompts until they are dispatched again."""

from __future__ import annotations

from typing import Any

import anyio
import structlog

from asyncrl.environment import Prompt
from asyncrl.policy.failures import FailureBudget
from asyncrl.run.intake import Generating, Signal
from asyncrl.wire.messages import GroupFailed
from asyncrl.policy.schedule import Scheduler

__all__ = ["Redispatcher"]

log = structlog.get_logger("asyncrl.run.restarts")


class Redispatcher:
    """Owns the prompts of groups waiting to be dispatched again.

    ``generating`` and ``load`` are the pipeline's tables (groups whose samples are coming
    back; samples in flight per worker); ``changed`` wakes the rollout pump.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        generating: dict[str, Generating],
        load: dict[str, int],
        failures: FailureBudget,
        changed: Signal,
    ) -> None:
        self.sched = scheduler
        self.generating = generating
        self.load = load
        self.failures = failures
        self.changed = changed
        self._prompts: dict[str, tuple[Prompt, list[int]]] = {}

    def take(self, group_id: str) -> tuple[Prompt, list[int]] | None:
        """The prompt of a group dispatched again (``None``: a group dispatched first)."""
        return self._prompts.pop(group_id, None)

    def group_failed(self, pending: Generating, msg: GroupFailed, tg: Any) -> None:
        """Retry the group after a back-off (in ``tg``), or drop it (:mod:`asyncrl.policy.failures`)."""
        gid = msg.group_id
        error = f"{msg.error_type}: {msg.message}"
        del self.generating[gid]
        self.load[pending.worker] -= sum(1 for s in pending.samples if s is None)
        if self.sched.aborting(gid):  # counted as aborted already: gone, nothing to retry
            self.sched.failed(gid, retry=False)
            self.changed.notify()
            return
        delay = self.failures.generation_failed(
            gid, pending.prompt.id, retryable=msg.retryable, error=error, worker=msg.worker
        )
        if delay is None:
            self.drop(gid, f"group {gid} (prompt {pending.prompt.id}) on {msg.worker}: {error}")
            return
        self.sched.failed(gid, retry=True)
        self._prompts[gid] = (pending.prompt, pending.prompt_ids)
        tg.start_soon(self._retry_after, gid, delay)
        self.changed.notify()

    def drop(self, gid: str, what: str) -> None:
        """Drop a failed group for good; the run stops once the failure budget is spent."""
        self.sched.failed(gid, retry=False)
        self.changed.notify()
        self.failures.check_dropped(self.sched.failed_groups, what)

    async def _retry_after(self, gid: str, delay: float) -> None:
        await anyio.sleep(delay)
        if not self.sched.tracks(gid):  # aborted meanwhile (hopeless after a refit, the end)
            self._prompts.pop(gid, None)
            return
        self.sched.retry(gid)
        self.changed.notify()

    def worker_lost(self, worker: str) -> list[tuple[str, Generating]]:
        """``worker`` died: its training groups are dispatched again first (same prompt, same
        step, no back-off, outside the failure budget; those being aborted are simply gone).
        Returns its evaluation groups (by id), for the evaluator to send again."""
        evals, again = [], 0
        for gid, pending in list(self.generating.items()):
            if pending.worker != worker:
                continue
            del self.generating[gid]
            if pending.eval_done is not None:
                pending.samples = [None] * pending.n
                evals.append((gid, pending))
            elif self.sched.aborting(gid):
                self.sched.failed(gid, retry=False)
            else:
                self.sched.failed(gid, retry=True)
                self._prompts[gid] = (pending.prompt, pending.prompt_ids)
                self.sched.retry(gid)
                again += 1
        self.load[worker] = 0
        log.info("groups_redispatched", worker=worker, groups=again, evaluation_groups=len(evals))
        self.changed.notify()
        return evals
