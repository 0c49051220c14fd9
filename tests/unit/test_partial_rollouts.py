"""Partial rollouts: requests (single-turn samples, episodes' turns) in flight across refits.

Per-token weight versions (protocol 9): what an engine reports, what the rollout phase keeps
or refuses, what a sample trains, what a checkpoint keeps; and the sampler's choice of what
happens to the requests in flight at a refit. The end-to-end bound per token is the property
test in test_phases_episodes.py; the refit's order (re-prefill after the last bucket, before
resuming) is in test_refit.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncrl.policy.groups import CompletedSample, Group, Part
from asyncrl.run import arrivals
from asyncrl.run.arrivals import ArrivalKind
from asyncrl.run.arrivals import store
from asyncrl.checkpoints.directory import SavedSample
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import DataMessage, Sample, SampleDone

TOKENS = np.array([5, 6, 7, 8], np.int32)
LPS = np.full(4, -0.25, np.float32)


def group(start_version: int) -> Group:
    return Group("g0", "p0", [1], start_version, None, 0.0, [None, None], index=0, worker="w")


def arrive(g: Group, index: int, versions: list[int] | None) -> arrivals.Arrival | None:
    v = np.zeros(0, np.int32) if versions is None else np.array(versions, np.int32)
    return store(g, SampleDone("g0", "w", index, Sample(TOKENS, LPS, "stop", v)))


def test_versions_are_kept_stamped_or_refused_against_the_dispatch_version() -> None:
    g = group(start_version=2)
    assert arrive(g, 0, [2, 2, 3, 3]) is None  # continued across a refit: kept as reported
    assert g.samples[0].versions.tolist() == [2, 2, 3, 3]
    assert arrive(g, 1, None) is None  # the engine cannot tell: the oldest they can be
    assert g.samples[1].versions.tolist() == [2, 2, 2, 2]
    g = group(start_version=2)
    refused = arrive(g, 0, [1, 2, 2, 2])
    assert refused is not None and refused.kind == ArrivalKind.MALFORMED
    assert "older than v2" in refused.detail
    refused = arrive(g, 0, [2, 2])
    assert refused is not None and refused.kind == ArrivalKind.MALFORMED and "versions of shape" in refused.detail
    assert g.samples == [None, None]  # nothing taken


def test_versions_cross_the_wire_and_an_older_peer_sends_none() -> None:
    codec = Codec(DataMessage)
    sent = SampleDone("g", "w", 0, Sample(TOKENS, LPS, "stop", np.array([0, 0, 1, 1], np.int32)))
    got = codec.decode(codec.encode(sent))
    assert got.sample.versions.tolist() == [0, 0, 1, 1]
    bare = codec.decode(codec.encode(SampleDone("g", "w", 0, Sample(TOKENS, LPS, "stop"))))
    assert bare.sample.versions.size == 0


def test_the_vllm_spans_become_one_version_per_token() -> None:
    from asyncrl_vllm.engine_io import versions_of

    def span(version: str, start: int, end: int) -> SimpleNamespace:
        return SimpleNamespace(version=version, start=start, end=end)

    assert versions_of([span("3", 0, 2), span("4", 2, 5)], 5).tolist() == [3, 3, 4, 4, 4]
    assert versions_of([span("7", 0, 3)], 3).tolist() == [7, 7, 7]
    for bad in (
        None,  # vLLM before 0.32: no spans
        [span("default", 0, 3)],  # not labelled by us
        [span("1", 0, 2)],  # does not cover every token
        [span("1", 0, 1), span("2", 2, 3)],  # a gap
    ):
        assert versions_of(bad, 3).size == 0, bad


def test_a_sample_trains_the_versions_of_its_generated_tokens_only() -> None:
    earlier = Part(
        np.array([1], np.int32), np.array([9, 9, 9], np.int32), np.zeros(3, np.float32),
        np.array([1, 0, 1], np.uint8), "stop", np.array([4, -1, 5], np.int32),
    )  # fmt: skip
    sample = CompletedSample(
        TOKENS, LPS, "stop", 1.0, True, loss_mask=np.array([0, 1, 1, 0], np.uint8),
        earlier=(earlier,), versions=np.array([-1, 5, 6, -1], np.int32),
    )  # fmt: skip
    assert sample.trained_versions(unknown=0).tolist() == [4, 5, 5, 6]
    unknown = CompletedSample(TOKENS, LPS, "stop", 1.0, True)  # an older checkpoint's
    assert unknown.trained_versions(unknown=3).tolist() == [3, 3, 3, 3]


def test_a_scored_single_turn_sample_keeps_its_versions() -> None:
    """The feeder's scoring carries a sample's per-token versions into what trains (the
    step's token staleness reads them; they were once dropped here)."""
    from asyncrl.environment import Prompt
    from asyncrl.run.scoring import score_samples

    env = SimpleNamespace(score=lambda prompt, completion: SimpleNamespace(reward=1.0, correct=True))
    tok = SimpleNamespace(decode=lambda ids: "x")
    raw = Sample(TOKENS, LPS, "stop", np.array([2, 2, 3, 3], np.int32))
    (done,) = score_samples(env, tok, "env", Prompt("p0", "q"), [raw])  # type: ignore[arg-type]
    assert done.versions.tolist() == [2, 2, 3, 3]
    assert done.trained_versions(unknown=0).tolist() == [2, 2, 3, 3]


def test_token_staleness_counts_every_trained_token_at_its_own_version() -> None:
    """The step record's per-token staleness against a count token by token, written here:
    single-turn samples across a refit, masked episode samples with a split-off part, and
    samples restored without versions (their group's start version)."""
    from asyncrl.obs.steps import StepRecord, TrainRecord

    rng = np.random.default_rng(7)
    step, groups, expected = 6, [], []
    for gi in range(40):
        start = int(rng.integers(3, 7))
        g = Group(f"g{gi}", "p", [1], start, None, 0.0, [], index=gi)
        for _ in range(4):
            n = int(rng.integers(1, 6))
            kind = rng.integers(0, 3)
            versions = np.sort(rng.integers(start, step + 1, n)).astype(np.int32)
            if kind == 0:  # single-turn: every token trains
                g.samples.append(CompletedSample(np.zeros(n, np.int32), np.zeros(n, np.float32),
                                                 "stop", 0.0, False, versions=versions))  # fmt: skip
                expected += [(step - int(v), int(v) > start) for v in versions]
            elif kind == 1:  # an episode's: inserted tokens masked, a part split off before
                mask = rng.integers(0, 2, n).astype(np.uint8)
                pv = np.full(2, start, np.int32)
                part = Part(np.zeros(1, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32),
                            np.ones(2, np.uint8), "stop", pv)  # fmt: skip
                g.samples.append(CompletedSample(np.zeros(n, np.int32), np.zeros(n, np.float32),
                                                 "stop", 0.0, False, loss_mask=mask,
                                                 earlier=(part,), versions=versions))  # fmt: skip
                expected += [(step - start, False)] * 2
                expected += [(step - int(v), int(v) > start) for v, m in zip(versions, mask) if m]
            else:  # restored from a checkpoint that had no versions
                g.samples.append(CompletedSample(np.zeros(n, np.int32), np.zeros(n, np.float32),
                                                 "stop", 0.0, False))  # fmt: skip
                expected += [(step - start, False)] * n
        groups.append(g)
    rec = StepRecord(step=step, train=TrainRecord(groups=groups))
    got = rec._token_staleness()
    stale = [s for s, _ in expected]
    hist: dict[str, int] = {}
    for s in sorted(stale):
        hist[str(s)] = hist.get(str(s), 0) + 1
    assert got["token_staleness_hist"] == hist
    assert got["token_staleness_max"] == max(stale)
    assert got["token_staleness_mean"] == pytest.approx(sum(stale) / len(stale), rel=1e-12)
    assert got["tokens_after_refit"] == sum(later for _, later in expected) > 0


def test_a_checkpoint_keeps_the_versions_and_reads_one_without_them() -> None:
    sample = CompletedSample(TOKENS, LPS, "stop", 1.0, True, {"correct": 1.0, "format": 0.5},
                             versions=np.array([1, 1, 2, 2]))  # fmt: skip
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(SavedSample.of(sample)), type=SavedSample)
    assert back.sample().versions.tolist() == [1, 1, 2, 2]
    assert back.sample().components == {"correct": 1.0, "format": 0.5}  # reward_weights reads them

    class Format3(msgspec.Struct, array_like=True):  # what an asyncrl before protocol 9 wrote
        token_ids: bytes
        logprobs: bytes
        finish_reason: str
        reward: float
        correct: bool

    old = Format3(TOKENS.tobytes(), LPS.tobytes(), "stop", 0.5, False)
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=SavedSample).sample()
    assert restored.versions is None and restored.trained_versions(7).tolist() == [7] * 4
    assert restored.components == {}



@pytest.mark.parametrize("name", ["in_order", "gated", "oversampled", "ready_first", "dynamic"])
def test_every_built_in_sampler_continues_by_default_and_can_reprefill(name: str) -> None:
    from asyncrl.errors import ConfigError
    from asyncrl.policy.sampler_choice import make_sampler
    from asyncrl.policy.samplers import in_flight_at_refit

    assert in_flight_at_refit(make_sampler({"name": name})) == "continue"
    chosen = make_sampler({"name": name, "in_flight_at_refit": "reprefill"})
    assert in_flight_at_refit(chosen) == "reprefill"
    with pytest.raises(ConfigError, match="in_flight_at_refit"):
        make_sampler({"name": name, "in_flight_at_refit": "drop"})


def test_a_plugin_sampler_without_the_choice_continues_and_a_bad_one_is_refused() -> None:
    from asyncrl.errors import ConfigError
    from asyncrl.policy.samplers import in_flight_at_refit

    assert in_flight_at_refit(SimpleNamespace(name="mine")) == "continue"
    with pytest.raises(ConfigError, match=r"in_flight_at_refit: sampler 'mine' chose 'abort'. "
                                          r"Fix: choose one of continue, reprefill"):
        in_flight_at_refit(SimpleNamespace(name="mine", in_flight_at_refit="abort"))


async def _feed_a_turn(versions: np.ndarray) -> Sample:
    """The real feeder takes a turn's sample from the data socket (as a worker encodes it)
    and hands the episode waiting for it what the rollout phase took."""
    import anyio

    from asyncrl.run.context import RunContext
    from asyncrl.run.intake import Feeder
    from asyncrl.run.rollout_phase import RolloutPhase
    from asyncrl.run.train_phase import TrainPhase
    from asyncrl.run.wake import Signal
    from asyncrl.wire.transport import Rejections
    from schedule_support import SAMPLERS, live_groups

    groups = live_groups(SAMPLERS["gated"](1, 1.0), P=1, N=1, steps=1)
    rollout = RolloutPhase(groups, ["w"], episodes=True)
    sent = rollout.dispatch(["w"], lambda i: (SimpleNamespace(id="p", display="p"), [1]), 0.0)
    assert isinstance(sent, arrivals.Sent)
    assert rollout.start_turn("t#0", ["w"], group_id=sent.group_id, index=0) == "w"
    got: list[Sample] = []
    asker = SimpleNamespace(answered=lambda request, sample: got.append(sample))
    tx, rx = anyio.create_memory_object_stream[SampleDone](4)
    ctx = RunContext(SimpleNamespace(), None, [], groups, rollout, TrainPhase(groups),
                     serving=lambda: ["w"], changed=Signal(), committed=Signal(),
                     failures=None, probes=None, metrics=None,
                     now=lambda: 0.0)  # type: ignore[arg-type]  # fmt: skip
    feeder = Feeder(
        ctx, intake=rx, scorer=None, asker=asker, redispatch=None, rejections=Rejections(),
    )  # type: ignore[arg-type]  # fmt: skip
    tx.send_nowait(SampleDone("t#0", "w", 0, Sample(TOKENS, LPS, "stop", versions)))
    with tx, rx, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(feeder.run)
            while not got:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    return got[0]


@pytest.mark.anyio
async def test_the_feeder_hands_an_episode_its_turn_with_one_version_per_token() -> None:
    """An engine that cannot tell (vLLM before 0.32) reports no versions: the episode gets
    the version the turn was sent at for each token (it adds them to its trajectory, which
    refuses a turn without one per token); reported ones come through as they are."""
    assert (await _feed_a_turn(np.zeros(0, np.int32))).versions.tolist() == [0, 0, 0, 0]
    reported = np.array([0, 0, 1, 1], np.int32)
    assert (await _feed_a_turn(reported)).versions.tolist() == [0, 0, 1, 1]


def test_check_config_says_what_happens_to_requests_in_flight(
    tmp_path: Any, model_dir: Any
) -> None:
    from asyncrl.config import from_dict
    from asyncrl.config.modes import describe

    def report(sampler: dict[str, Any], **refit: Any) -> Any:
        return describe(from_dict({
            "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
            "run": {"output_dir": str(tmp_path / "out")}, "refit": refit,
            "trainer": {"backend": "bigram"}, "generator": {"backend": "bigram"},
            "pipeline": {"sampler": sampler},
        }))  # fmt: skip

    assert report({"name": "gated"}).capacities["refit"].endswith("requests in flight go on")
    chosen = report({"name": "gated", "in_flight_at_refit": "reprefill"})
    assert chosen.capacities["refit"].endswith("recompute their KV cache, then go on")
    assert chosen.advice == []
    drained = report({"name": "gated", "in_flight_at_refit": "reprefill"}, drain=True)
    assert any(a.startswith("pipeline.sampler.in_flight_at_refit") for a in drained.advice)
