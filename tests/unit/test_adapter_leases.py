"""Adapter versions as leases (:mod:`asyncrl.policy.adapter_leases`), against a model engine.

The model engine holds a table of resident adapters (version → its weights) and loads and
unloads exactly what the lease table answers; each request reads the weights of the version it
was tagged with at every token it generates. The test keeps its own ledger of every version's
weights, so a response built from any other version's weights, or a read of an unloaded one, is
a mismatch. Through ≥ 10,000 requests and ≥ 100 refits (requests continuing across refits,
re-prefilled on the new version, or aborted by the staleness policy) there must be none.
"""

from __future__ import annotations

import random

import pytest

from asyncrl.policy.adapter_leases import AdapterError, AdapterLeases


class Engine:
    """An engine's adapter table: what the lease table says to load and unload, nothing else."""

    def __init__(self) -> None:
        self.loaded: dict[int, float] = {}
        self.max_loaded = 0

    def apply(self, load: tuple[int, float] | None, unload: list[int]) -> None:
        for v in unload:
            del self.loaded[v]  # a KeyError: told to unload what it never held
        if load is not None:
            self.loaded[load[0]] = load[1]
        self.max_loaded = max(self.max_loaded, len(self.loaded))


def run(seed: int, *, slots: int, window: int, refits: int, per_refit: int) -> dict[str, int]:
    """One random run; returns its counts. ``window``: the staleness policy aborts, at each
    refit, the requests on versions more than ``window`` behind the new one."""
    rng = random.Random(seed)
    table, engine = AdapterLeases(slots), Engine()
    truth: dict[int, float] = {}  # the ledger: every version's weights, never forgotten
    running: dict[str, list[float]] = {}  # request → the weights read at each token so far
    tag: dict[str, int] = {}  # request → the version it was tagged with when it (re)started
    counts = dict(requests=0, refits=0, mismatches=0, continued=0, reprefilled=0, aborted=0)
    next_id = 0

    def refit(version: int) -> None:
        for rid in [r for r in running if tag[r] < version - window]:  # too stale: aborted
            engine.apply(None, table.release(rid))
            del running[rid], tag[rid]
            counts["aborted"] += 1
        truth[version] = rng.random()
        engine.apply((version, truth[version]), table.install(version))
        counts["refits"] += 1
        for rid in list(running):
            if rng.random() < 0.3:  # re-prefilled: starts again on the new version
                engine.apply(None, table.release(rid))
                tag[rid] = table.lease(rid)
                running[rid] = []
                counts["reprefilled"] += 1
            else:
                counts["continued"] += 1

    def step(rid: str) -> None:
        weights = engine.loaded.get(tag[rid])
        if weights is None or weights != truth[tag[rid]]:
            counts["mismatches"] += 1
        running[rid].append(weights if weights is not None else float("nan"))

    def finish(rid: str) -> None:
        if any(w != truth[tag[rid]] for w in running[rid]):
            counts["mismatches"] += 1
        engine.apply(None, table.release(rid))
        del running[rid], tag[rid]

    refit(1)
    for version in range(2, refits + 2):
        for _ in range(per_refit):
            action = rng.random()
            if action < 0.45:  # a new request on the newest version
                rid = f"r{next_id}"
                next_id += 1
                tag[rid] = table.lease(rid)
                assert tag[rid] == version - 1
                running[rid] = []
                counts["requests"] += 1
            elif running and action < 0.85:
                step(rng.choice(list(running)))
            elif running:
                finish(rng.choice(list(running)))
            assert table.problems() == []
            assert set(engine.loaded) == set(table.resident)
        refit(version)
    for rid in list(running):
        finish(rid)
    assert table.resident == (refits + 1,) and engine.loaded.keys() == {refits + 1}
    assert engine.max_loaded <= slots
    return counts


@pytest.mark.parametrize("seed", [0, 1])
def test_every_response_is_served_by_the_version_it_was_tagged_with(seed: int) -> None:
    counts = run(seed, slots=4, window=2, refits=120, per_refit=100)
    assert counts["requests"] >= 5_000 and counts["refits"] >= 100  # 10,000 over both seeds
    assert counts["continued"] and counts["reprefilled"] and counts["aborted"]
    assert counts["mismatches"] == 0


def test_a_refit_that_would_need_a_slot_held_by_requests_is_refused_and_changes_nothing() -> None:
    table = AdapterLeases(2)
    assert table.install(1) == []
    table.lease("a")
    assert table.install(2) == []  # v1 still held by "a": both resident
    table.lease("b")
    with pytest.raises(AdapterError, match="all 2 adapter slots hold versions still in use"):
        table.install(3)
    assert table.resident == (1, 2) and table.problems() == []
    assert table.release("a") == [1]  # v1 free and older than the newest: unloaded
    assert table.install(3) == []  # v2 is still held by "b"
    assert table.release("b") == [2]
    assert table.resident == (3,)


def test_a_request_never_gets_another_version_than_the_one_it_names() -> None:
    table = AdapterLeases(3)
    with pytest.raises(AdapterError, match="no adapter version is installed"):
        table.lease("a")
    table.install(1)
    assert table.install(2) == [1]  # nobody held v1
    with pytest.raises(AdapterError, match="needs adapter v1, which this engine no longer holds"):
        table.lease("late", version=1)
    assert table.lease("a", version=2) == 2
    with pytest.raises(AdapterError, match="holds adapter v2 already"):
        table.lease("a")
    with pytest.raises(AdapterError, match="not newer"):
        table.install(2)
    assert table.release("nobody") == []
    assert table.release("a") == []  # the newest stays resident
    with pytest.raises(ValueError, match="at least 2 adapter slots"):
        AdapterLeases(1)
