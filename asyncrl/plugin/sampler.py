"""The plugin API for staleness samplers (an ``asyncrl.samplers`` entry point): the policy
half of the scheduler (docs/modes.md).

- ``SamplerPlugin``: what a sampler entry point names: its config struct and a factory.
- ``Sampler``: the protocol: admit, select, evict, abort, and the state a checkpoint keeps.
- ``DecidesInFlight``: optional: what becomes of the requests in flight at a refit.
- ``in_flight_at_refit``: a sampler's choice for them (``"continue"`` without one).
- ``DescribesMode``: optional: the sampler's mode in one line, for ``asyncrl check-config``.
- ``SchedulerView``: the scheduler's state as a sampler sees it (read-only).
- ``GroupView``: one live group as the scheduler shows it (read-only).
- ``OversampledConfig``: the built-in ``oversampled`` sampler's config, to build on.
- ``OversampledSampler``: the built-in ``oversampled`` sampler, to build on.
- ``LiveGroups``: the run's table of live groups (what a sampler sees), for its tests.
- ``RolloutPhase``: the real rollout phase (dispatch to commit), for its tests.
- ``TrainPhase``: the real train phase (chunks, steps), for its tests.
"""

from __future__ import annotations

from asyncrl.policy.samplers import (
    DecidesInFlight,
    DescribesMode,
    GroupView,
    OversampledConfig,
    OversampledSampler,
    Sampler,
    SamplerPlugin,
    SchedulerView,
    in_flight_at_refit,
)
from asyncrl.policy.live import LiveGroups
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.train_phase import TrainPhase

__all__ = [
    "DecidesInFlight",
    "DescribesMode",
    "GroupView",
    "LiveGroups",
    "OversampledConfig",
    "OversampledSampler",
    "RolloutPhase",
    "Sampler",
    "SamplerPlugin",
    "SchedulerView",
    "TrainPhase",
    "in_flight_at_refit",
]
