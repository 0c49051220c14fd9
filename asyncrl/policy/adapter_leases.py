"""Which adapter versions an engine holds, and for whom: requests lease the version they start
on (pure: no I/O; issue 51, LoRA).

With LoRA the base weights never change; each refit installs the trained adapter as a new
*version* beside the old ones, and an engine holds at most ``slots`` of them (vLLM's
``max_loras``: adapters one batch may use). A request starts on the newest version and holds it
like a lease until it ends: it is served by exactly that adapter, never by another, and a
version is unloaded only once no request holds it and a newer one is installed. So:

* :meth:`AdapterLeases.install` adds a version and answers the versions to unload at once (those
  no request holds); it refuses, changing nothing, when every slot would be held (the old
  versions' requests must end, or be aborted by the staleness policy, first);
* :meth:`AdapterLeases.lease` tags a request with the newest version (or the one it names,
  which must still be held: a request that needs an unloaded version is refused, never served by
  another);
* :meth:`AdapterLeases.release` ends a lease and answers the versions to unload now.

The engine loads and unloads exactly what these answers say, so a version with a lease is
always resident (tests/unit/test_adapter_leases.py drives the class through random schedules
against a model engine and checks every response against the version its request was tagged
with).
"""

from __future__ import annotations

from collections import Counter

__all__ = ["AdapterError", "AdapterLeases"]


class AdapterError(RuntimeError):
    """An adapter version cannot be installed or leased (the message says why and what to
    change)."""


class AdapterLeases:
    """The adapter versions resident on one engine and the requests holding each.

    Args:
        slots: versions the engine can hold at once (at least 2: the newest and one still
            finishing its requests).

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
        self._resident: list[int] = []
        """Versions loaded on the engine, oldest first (the newest is the last)."""
        self._holders: Counter[int] = Counter()
        """Leases per resident version."""
        self._lease: dict[str, int] = {}
        """Request id → the version it holds."""

    @property
    def newest(self) -> int | None:
        """The version new requests start on (``None``: none installed yet)."""
        return self._resident[-1] if self._resident else None

    @property
    def resident(self) -> tuple[int, ...]:
        """The versions loaded on the engine, oldest first."""
        return tuple(self._resident)

    def holders(self, version: int) -> int:
        """Requests holding ``version``."""
        return self._holders[version]

    def version_of(self, request: str) -> int | None:
        """The version ``request`` holds (``None``: it holds none)."""
        return self._lease.get(request)

    def install(self, version: int) -> list[int]:
        """Load ``version`` as the newest; returns the versions to unload now (older ones that
        no request holds), oldest first.

        Raises:
            AdapterError: ``version`` is not newer than the newest, or every slot would be held
                (nothing changed: wait for the old versions' requests, or abort them).
        """
        held = self.check_install(version)
        unload = [v for v in self._resident if not self._holders[v]]
        self._resident = [*held, version]
        return unload

    def check_install(self, version: int) -> list[int]:
        """Raise what :meth:`install` would raise, changing nothing; returns the versions
        that would stay resident beside ``version`` (those some request holds).

        Raises:
            AdapterError: as :meth:`install`.
        """
        if self._resident and version <= self._resident[-1]:
            raise AdapterError(
                f"adapter version {version} is not newer than the newest installed, "
                f"{self._resident[-1]}"
            )
        held = [v for v in self._resident if self._holders[v]]
        if len(held) + 1 > self.slots:
            leases = ", ".join(f"v{v}: {self._holders[v]} requests" for v in held)
            raise AdapterError(
                f"adapter version {version} cannot be installed: all {self.slots} adapter slots "
                f"hold versions still in use ({leases}). Fix: give the engine more adapter slots "
                "than the sampler's staleness bound + 1, or abort requests on old versions at "
                "the refit (the sampler's in_flight_at_refit)"
            )
        return held

    def lease(self, request: str, version: int | None = None) -> int:
        """``request`` starts on ``version`` (the newest when ``None``) and holds it until
        :meth:`release`. Returns the version.

        Raises:
            AdapterError: no version is installed, ``version`` is not resident (unloaded: the
                request must not be served by another), or ``request`` holds a lease already.
        """
        if request in self._lease:
            raise AdapterError(f"request {request!r} holds adapter v{self._lease[request]} already")
        if version is None:
            version = self.newest
            if version is None:
                raise AdapterError("no adapter version is installed yet: refit before generating")
        elif version not in self._resident:
            raise AdapterError(
                f"request {request!r} needs adapter v{version}, which this engine no longer holds "
                f"(resident: {', '.join(f'v{v}' for v in self._resident) or 'none'}); it is "
                "refused rather than served by another version"
            )
        self._lease[request] = version
        self._holders[version] += 1
        return version

    def release(self, request: str) -> list[int]:
        """``request`` ended (done, failed or aborted): its lease ends. Returns the versions to
        unload now: its version, if no request holds it any more and a newer one is installed.
        A request holding no lease releases nothing."""
        version = self._lease.pop(request, None)
        if version is None:
            return []
        self._holders[version] -= 1
        if self._holders[version]:
            return []
        del self._holders[version]
        if version == self._resident[-1]:
            return []
        self._resident.remove(version)
        return [version]

    def problems(self) -> list[str]:
        """Every broken invariant (none: ``[]``); for tests."""
        out = []
        if len(self._resident) > self.slots:
            out.append(f"{len(self._resident)} versions resident, {self.slots} slots")
        if self._resident != sorted(set(self._resident)):
            out.append(f"resident versions {self._resident} are not increasing")
        if Counter(self._lease.values()) != +self._holders:
            out.append("the leases per version disagree with the requests' leases")
        stray = [v for v in self._lease.values() if v not in self._resident]
        if stray:
            out.append(f"requests hold versions {sorted(set(stray))} that are not resident")
        idle = [v for v in self._resident[:-1] if not self._holders[v]]
        if idle:
            out.append(f"versions {idle} are resident with no lease and a newer one installed")
        return out
