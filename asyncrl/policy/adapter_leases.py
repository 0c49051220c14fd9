"""Which adapters an engine holds, and for whom: requests lease the adapter they start on (pure:
no I/O; issue 51, LoRA; issue 53, jobs).

With LoRA the base weights never change; each refit installs a job's trained adapter as a new
*version* beside the old ones. A run's jobs (docs/jobs.md) share the engine: each has its own
versions, and together they hold at most ``slots`` adapters (vLLM's ``max_loras``: adapters
one batch may use). A single-job run is the job ``""``. A request starts on its job's newest
version and holds it like a lease until it ends: it is served by exactly that adapter, never by
another version or another job's, and an adapter is unloaded only once no request holds it and
its job has a newer one (or the job is closed). So:

* :meth:`AdapterLeases.install` adds a job's version and answers the adapters to unload at once
  (those no request holds); it refuses, changing nothing, when every slot would be held (the
  old versions' requests must end, or be aborted by the staleness policy, first);
* :meth:`AdapterLeases.lease` tags a request with its job's newest version (or the version it
  names, which must still be held: a request that needs an unloaded version is refused, never
  served by another);
* :meth:`AdapterLeases.release` ends a lease and answers the adapters to unload now;
* :meth:`AdapterLeases.close` ends a job: its adapters go as their last requests end.

Each adapter gets the engine's id for it (vLLM's ``lora_int_id``) when it is installed, from a
counter never reset: vLLM keys its prefix cache by that id, so an id is never given twice.

The engine loads and unloads exactly what these answers say, so an adapter with a lease is
always resident (tests/unit/test_adapter_leases.py drives the class through random schedules
of several jobs against a model engine and checks every response against the job and version
its request was tagged with).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

__all__ = ["Adapter", "AdapterError", "AdapterLeases"]


class AdapterError(RuntimeError):
    """An adapter version cannot be installed or leased (the message says why and what to
    change)."""


class Adapter(NamedTuple):
    """One resident adapter: ``job``'s ``version``, known to the engine as ``lora_id``."""

    job: str
    version: int
    lora_id: int

    def __str__(self) -> str:
        return f"{self.job}:v{self.version}" if self.job else f"v{self.version}"


class AdapterLeases:
    """The adapters resident on one engine, by job, and the requests holding each.

    Args:
        slots: adapters the engine can hold at once, over all jobs (at least 2: a job's newest
            version and one still finishing its requests).

    Raises:
        ValueError: fewer than 2 slots.
    """

    def __init__(self, slots: int) -> None:
        if slots < 2:
            raise ValueError(
                f"an engine needs at least 2 adapter slots (the newest version and one whose "
                f"requests are finishing), got {slots}"
            )
        self.slots = slots
        self._resident: dict[str, list[Adapter]] = {}
        """Adapters loaded on the engine, per job, oldest first (the job's newest is last)."""
        self._holders: Counter[Adapter] = Counter()
        """Leases per resident adapter."""
        self._lease: dict[str, Adapter] = {}
        """Request id → the adapter it holds."""
        self._closed: set[str] = set()
        self._next_id = 1  # vLLM refuses 0

    # ------------------------------------------------------------------ reading
    def newest(self, job: str = "") -> Adapter | None:
        """The adapter ``job``'s new requests start on (``None``: none installed yet)."""
        resident = self._resident.get(job)
        return resident[-1] if resident else None

    def resident(self, job: str | None = None) -> tuple[Adapter, ...]:
        """The adapters loaded on the engine: ``job``'s (oldest first), or every job's."""
        if job is not None:
            return tuple(self._resident.get(job, ()))
        return tuple(a for adapters in self._resident.values() for a in adapters)

    def versions(self, job: str = "") -> tuple[int, ...]:
        """``job``'s resident versions, oldest first."""
        return tuple(a.version for a in self._resident.get(job, ()))

    def closed(self, job: str) -> bool:
        """Whether ``job`` was closed (:meth:`close`)."""
        return job in self._closed

    def holders(self, adapter: Adapter) -> int:
        """Requests holding ``adapter``."""
        return self._holders[adapter]

    def adapter_of(self, request: str) -> Adapter | None:
        """The adapter ``request`` holds (``None``: it holds none)."""
        return self._lease.get(request)

    # ------------------------------------------------------------------ installing
    def new_id(self) -> int:
        """An engine id no adapter had before (for the adapter an install will add)."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def install(self, version: int, *, job: str = "", lora_id: int | None = None) -> list[Adapter]:
        """Load ``job``'s ``version`` (as engine id ``lora_id``, else a new one) as its newest;
        returns the adapters to unload now (the job's older ones that no request holds),
        oldest first.

        Raises:
            AdapterError: ``version`` is not newer than the job's newest, the job is closed, or
                every slot would be held (nothing changed: wait for the old versions' requests,
                or abort them).
        """
        held = self.check_install(version, job=job)
        mine = self._resident.get(job, [])
        unload = [a for a in mine if not self._holders[a]]
        adapter = Adapter(job, version, self.new_id() if lora_id is None else lora_id)
        self._resident[job] = [*held, adapter]
        return unload

    def check_install(self, version: int, *, job: str = "") -> list[Adapter]:
        """Raise what :meth:`install` would raise, changing nothing; returns ``job``'s adapters
        that would stay resident beside the new one (those some request holds).

        Raises:
            AdapterError: as :meth:`install`.
        """
        if job in self._closed:
            raise AdapterError(f"job {job!r} was closed: its adapters are no longer installed")
        newest = self.newest(job)
        if newest is not None and version <= newest.version:
            what = f"job {job!r}'s newest" if job else "the newest"
            raise AdapterError(
                f"adapter version {version} is not newer than {what} installed, {newest.version}"
            )
        held = [a for a in self._resident.get(job, ()) if self._holders[a]]
        others = [a for j, adapters in self._resident.items() if j != job for a in adapters]
        if len(others) + len(held) + 1 > self.slots:
            leases = ", ".join(f"{a}: {self._holders[a]} requests" for a in held)
            jobs = ", ".join(sorted({repr(a.job) for a in others}))
            raise AdapterError(
                f"adapter {Adapter(job, version, 0)} cannot be installed: all {self.slots} "
                f"adapter slots hold adapters still in use ({leases or 'none of this job'}"
                + (f"; other jobs hold {len(others)}: {jobs}" if others else "")
                + "). Fix: give the engine more adapter slots (generator.options.lora_slots: "
                "at least the jobs × (the sampler's staleness bound + 1) + 1), or abort "
                "requests on old versions at the refit (the sampler's in_flight_at_refit)"
            )
        return held

    def close(self, job: str) -> list[Adapter]:
        """``job`` ended: no request leases its adapters any more, and they are unloaded as
        their last requests end. Returns those to unload now (none holds them)."""
        self._closed.add(job)
        adapters = self._resident.get(job, [])
        unload = [a for a in adapters if not self._holders[a]]
        held = [a for a in adapters if self._holders[a]]
        if held:
            self._resident[job] = held
        else:
            self._resident.pop(job, None)
        return unload

    # ------------------------------------------------------------------ requests
    def lease(self, request: str, *, job: str = "", version: int | None = None) -> Adapter:
        """``request`` starts on ``job``'s ``version`` (its newest when ``None``) and holds it
        until :meth:`release`. Returns the adapter.

        Raises:
            AdapterError: the job is closed or has no version installed, ``version`` is not
                resident (unloaded: the request must not be served by another), or ``request``
                holds a lease already.
        """
        if request in self._lease:
            raise AdapterError(f"request {request!r} holds adapter {self._lease[request]} already")
        if job in self._closed:
            raise AdapterError(f"request {request!r} is of job {job!r}, which was closed")
        mine = self._resident.get(job, [])
        if version is None:
            if not mine:
                raise AdapterError(
                    "no adapter version is installed yet"
                    + (f" for job {job!r}" if job else "")
                    + ": refit before generating"
                )
            adapter = mine[-1]
        else:
            found = [a for a in mine if a.version == version]
            if not found:
                names = ", ".join(str(a) for a in mine) or "none"
                raise AdapterError(
                    f"request {request!r} needs adapter {Adapter(job, version, 0)}, which this "
                    f"engine no longer holds (resident: {names}); it is refused rather than "
                    "served by another version"
                )
            adapter = found[0]
        self._lease[request] = adapter
        self._holders[adapter] += 1
        return adapter

    def release(self, request: str) -> list[Adapter]:
        """``request`` ended (done, failed or aborted): its lease ends. Returns the adapters to
        unload now: its own, if no request holds it any more and its job has a newer one (or
        was closed). A request holding no lease releases nothing."""
        adapter = self._lease.pop(request, None)
        if adapter is None:
            return []
        self._holders[adapter] -= 1
        if self._holders[adapter]:
            return []
        del self._holders[adapter]
        mine = self._resident[adapter.job]
        if adapter == mine[-1] and adapter.job not in self._closed:
            return []
        mine.remove(adapter)
        if not mine:
            del self._resident[adapter.job]
        return [adapter]

    def problems(self) -> list[str]:
        """Every broken invariant (none: ``[]``); for tests."""
        out = []
        resident = self.resident()
        if len(resident) > self.slots:
            out.append(f"{len(resident)} adapters resident, {self.slots} slots")
        for job, adapters in self._resident.items():
            versions = [a.version for a in adapters]
            if versions != sorted(set(versions)):
                out.append(f"job {job!r}'s resident versions {versions} are not increasing")
            if any(a.job != job for a in adapters):
                out.append(f"job {job!r} lists another job's adapter")
            last = len(adapters) if job in self._closed else len(adapters) - 1
            idle = [str(a) for a in adapters[:last] if not self._holders[a]]
            if idle:
                out.append(f"adapters {idle} are resident with no lease and not their job's newest")
        ids = [a.lora_id for a in resident]
        if len(set(ids)) != len(ids):
            out.append(f"engine ids given twice: {sorted(ids)}")
        if Counter(self._lease.values()) != +self._holders:
            out.append("the leases per adapter disagree with the requests' leases")
        stray = {str(a) for a in self._lease.values() if a not in resident}
        if stray:
            out.append(f"requests hold adapters {sorted(stray)} that are not resident")
        return out
