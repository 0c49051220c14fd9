"""Adapters as leases (:mod:`asyncrl.policy.adapter_leases`), against a model engine.

The model engine holds a table of resident adapters (engine id → its weights) and loads and
unloads exactly what the lease table answers; each request reads the weights of the adapter it
was tagged with at every token it generates. The test keeps its own ledger of every job's every
version's weights, so a response built from another version's weights or another job's, or a
read of an unloaded adapter, is a mismatch. Several jobs share the engine's slots; each refits on
its own schedule, and jobs are closed and opened while requests run. Through ≥ 10,000 requests
and ≥ 100 refits (requests continuing across refits, re-prefilled on the new version, or aborted
by the staleness policy) there must be none.
"""

from __future__ import annotations

import random

import pytest

from asyncrl.policy.adapter_leases import Adapter, AdapterError, AdapterLeases


class Engine:
    """An engine's adapter table: what the lease table says to load and unload, nothing else."""

    def __init__(self) -> None:
        self.loaded: dict[int, float] = {}
        self.max_loaded = 0
        self.ids_seen: set[int] = set()

    def apply(self, load: tuple[int, float] | None, unload: list[Adapter]) -> None:
        for a in unload:
            del self.loaded[a.lora_id]  # a KeyError: told to unload what it never held
        if load is not None:
            assert load[0] not in self.ids_seen, f"engine id {load[0]} given twice"
            self.ids_seen.add(load[0])
            self.loaded[load[0]] = load[1]
        self.max_loaded = max(self.max_loaded, len(self.loaded))


def run(seed: int, *, jobs: int, window: int, refits: int, per_refit: int) -> dict[str, int]:
    """One random run of ``jobs`` jobs on an engine with one slot more than they need; returns
    its counts. ``window``: the staleness policy aborts, at each of a job's refits, its
    requests on versions more than ``window`` behind the new one."""
    rng = random.Random(seed)
    slots = jobs * (window + 1) + 1
    table, engine = AdapterLeases(slots), Engine()
    truth: dict[tuple[str, int], float] = {}  # the ledger: every adapter's weights
    running: dict[str, list[float]] = {}  # request → the weights read at each token so far
    tag: dict[str, tuple[str, int]] = {}  # request → (job, version) when it (re)started
    version: dict[str, int] = {}  # job → its newest version
    counts = dict(requests=0, refits=0, mismatches=0, continued=0, reprefilled=0, aborted=0,
                  closed=0, opened=0)  # fmt: skip
    names = iter(f"job{i}" for i in range(10**6))
    live = [next(names) for _ in range(jobs)]
    next_id = 0

    def lease(rid: str, job: str) -> None:
        adapter = table.lease(rid, job=job)
        assert adapter.job == job and adapter.version == version[job]
        tag[rid] = (job, adapter.version)

    def end(rid: str) -> None:
        engine.apply(None, table.release(rid))
        del running[rid], tag[rid]

    def refit(job: str) -> None:
        new = version.get(job, 0) + 1
        for rid in [r for r in running if tag[r][0] == job and tag[r][1] < new - window]:
            end(rid)  # too stale: aborted
            counts["aborted"] += 1
        truth[job, new] = rng.random()
        lora_id = table.new_id()
        unload = table.install(new, job=job, lora_id=lora_id)
        engine.apply((lora_id, truth[job, new]), unload)
        version[job] = new
        counts["refits"] += 1
        for rid in [r for r in running if tag[r][0] == job]:
            if rng.random() < 0.3:  # re-prefilled: starts again on the new version
                engine.apply(None, table.release(rid))
                lease(rid, job)
                running[rid] = []
                counts["reprefilled"] += 1
            else:
                counts["continued"] += 1

    def step(rid: str) -> None:
        adapter = table.adapter_of(rid)
        weights = engine.loaded.get(adapter.lora_id) if adapter is not None else None
        if weights is None or weights != truth[tag[rid]]:
            counts["mismatches"] += 1
        running[rid].append(weights if weights is not None else float("nan"))

    def finish(rid: str) -> None:
        if any(w != truth[tag[rid]] for w in running[rid]):
            counts["mismatches"] += 1
        end(rid)

    for job in live:
        refit(job)
    for _ in range(refits):
        for _ in range(per_refit):
            action = rng.random()
            if action < 0.45:  # a new request of some job on its newest version
                rid = f"r{next_id}"
                next_id += 1
                lease(rid, rng.choice(live))
                running[rid] = []
                counts["requests"] += 1
            elif running and action < 0.85:
                step(rng.choice(list(running)))
            elif running and action < 0.999:
                finish(rng.choice(list(running)))
            else:  # a job stops (its requests aborted) and another starts
                gone = live.pop(rng.randrange(len(live)))
                for rid in [r for r in running if tag[r][0] == gone]:
                    end(rid)
                    counts["aborted"] += 1
                engine.apply(None, table.close(gone))
                with pytest.raises(AdapterError, match="was closed"):
                    table.lease("late", job=gone)
                live.append(next(names))
                refit(live[-1])
                counts["closed"] += 1
                counts["opened"] += 1
            assert table.problems() == []
            assert set(engine.loaded) == {a.lora_id for a in table.resident()}
        refit(rng.choice(live))
    for rid in list(running):
        finish(rid)
    assert {a.job for a in table.resident()} == set(live)
    assert all(table.versions(job) == (version[job],) for job in live)
    assert engine.max_loaded <= slots
    return counts


@pytest.mark.parametrize("seed", [0, 1])
def test_every_response_is_served_by_its_jobs_version(seed: int) -> None:
    counts = run(seed, jobs=4, window=2, refits=120, per_refit=100)
    assert counts["requests"] >= 5_000 and counts["refits"] >= 100  # 10,000 over both seeds
    assert counts["continued"] and counts["reprefilled"] and counts["aborted"]
    assert counts["closed"] and counts["opened"]
    assert counts["mismatches"] == 0


def test_one_job_is_the_job_without_a_name() -> None:
    counts = run(2, jobs=1, window=2, refits=60, per_refit=50)
    assert counts["requests"] >= 1_000 and counts["mismatches"] == 0


def test_a_refit_that_would_need_a_slot_held_by_requests_is_refused_and_changes_nothing() -> None:
    table = AdapterLeases(2)
    assert table.install(1) == []
    table.lease("a")
    assert table.install(2) == []  # v1 still held by "a": both resident
    table.lease("b")
    with pytest.raises(AdapterError, match="all 2 adapter slots hold adapters still in use"):
        table.install(3)
    assert table.versions() == (1, 2) and table.problems() == []
    assert [a.version for a in table.release("a")] == [1]  # free, older than the newest
    assert table.install(3) == []  # v2 is still held by "b"
    assert [a.version for a in table.release("b")] == [2]
    assert table.versions() == (3,)


def test_jobs_share_the_slots_and_a_job_never_gets_another_jobs_adapter() -> None:
    table = AdapterLeases(3)
    table.install(1, job="a")
    table.install(1, job="b")
    assert table.lease("ra", job="a").job == "a"
    assert table.lease("rb", job="b").job == "b"
    table.install(2, job="a")  # a: v1 (held) and v2; b: v1 -> all 3 slots
    with pytest.raises(AdapterError, match="other jobs hold 2: 'a'") as err:
        table.install(2, job="b")  # b's v1 is held: it would need a fourth slot
    assert "lora_slots" in str(err.value)
    with pytest.raises(AdapterError, match="no adapter version is installed yet for job 'c'"):
        table.lease("rc", job="c")
    with pytest.raises(AdapterError, match="needs adapter b:v2"):
        table.lease("late", job="b", version=2)
    table.release("ra")  # a's v1 goes: a slot for b
    assert [a.version for a in table.install(2, job="b")] == []
    assert table.versions("b") == (1, 2) and table.problems() == []
    ids = [a.lora_id for a in table.resident()]
    assert len(set(ids)) == len(ids)


def test_a_closed_job_lets_its_adapters_go_as_its_requests_end() -> None:
    table = AdapterLeases(4)
    table.install(1, job="a")
    kept = table.lease("r", job="a")
    table.install(2, job="a")
    assert [str(a) for a in table.close("a")] == ["a:v2"]  # v1 is held by "r"
    with pytest.raises(AdapterError, match="was closed"):
        table.install(3, job="a")
    assert table.release("r") == [kept] and table.resident() == ()
    assert table.problems() == []


def test_a_request_never_gets_another_version_than_the_one_it_names() -> None:
    table = AdapterLeases(3)
    with pytest.raises(AdapterError, match="no adapter version is installed"):
        table.lease("a")
    table.install(1)
    assert [a.version for a in table.install(2)] == [1]  # nobody held v1
    with pytest.raises(AdapterError, match="needs adapter v1, which this engine no longer holds"):
        table.lease("late", version=1)
    assert table.lease("a", version=2).version == 2
    with pytest.raises(AdapterError, match="holds adapter v2 already"):
        table.lease("a")
    with pytest.raises(AdapterError, match="not newer"):
        table.install(2)
    assert table.release("nobody") == []
    assert table.release("a") == []  # the newest stays resident
    with pytest.raises(ValueError, match="at least 2 adapter slots"):
        AdapterLeases(1)
