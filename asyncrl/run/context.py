"""What the parts of a run share: one frozen :class:`RunContext`, built once by the pipeline
(:mod:`asyncrl.run.loops`) and handed to each part in place of a dozen keyword arguments.

It holds references, not state: each part keeps its own (the table of live groups its groups,
the rollout phase its requests, the publisher its refit report); the context only says where
the shared ones are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.policy.failures import FailureBudget
    from asyncrl.policy.live import LiveGroups
    from asyncrl.run.rollout_phase import RolloutPhase
    from asyncrl.run.train_phase import TrainPhase
    from asyncrl.run.probes import Probes
    from asyncrl.run.wake import Signal
    from asyncrl.wire.rpc import ControlPlane

__all__ = ["RunContext"]


@dataclass(frozen=True, eq=False)
class RunContext:
    """The run's shared parts, as the train pump, the refit, the episodes, the evaluation and
    the feeder see them."""

    config: Config
    control: ControlPlane
    """Calls to the workers."""
    trainers: list[str]
    """The trainer ranks' worker names (``trainer:<rank>``)."""
    groups: LiveGroups
    """The one owner of the run's groups between dispatch and the trainer (read it; the two
    phases change it)."""
    rollout: RolloutPhase
    """Dispatch to commit: the requests in flight, arrivals, failures, the refit's aborts."""
    training: TrainPhase
    """Ready to trained: the open step's chunks, its abort and finish, the end of a refit."""
    serving: Callable[[], Sequence[str]]
    """The rollout workers that serve now (one restarting is not among them)."""
    changed: Signal
    """A change of the live groups: what the rollout pump (or a drain) waits for."""
    committed: Signal
    """A commit: the train pump's only reason to look again."""
    failures: FailureBudget
    probes: Probes
    """Fixed token sequences scored on the engines and on the trainer."""
    metrics: Any
    """The run's metrics writer (:class:`~asyncrl.obs.log.MetricsWriter`)."""
    now: Callable[[], float]
    """Seconds since the run's clock origin."""
    id_prefix: str = ""
    """Before every group and request id the run mints: a job's name and ``:``
    (:data:`~asyncrl.run.intake.JOB_SEPARATOR`; docs/jobs.md); none for the run's own."""

    def commit(self, group_id: str, samples: list[Any]) -> None:
        """The one place a group becomes ready to train: its episodes' scored ``samples``, in
        order (a single-turn group's once the feeder scored them, a multi-turn group's as its
        episodes ended). A group the run ended meanwhile is not committed (counted as
        unused)."""
        if self.rollout.commit(group_id, samples, self.now()):
            self.committed.notify()
