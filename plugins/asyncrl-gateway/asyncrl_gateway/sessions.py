"""The gateway's sessions: one per episode, their keys, the lobby, and what passes between an
HTTP call and the episode's task (no HTTP here).

::

    episode task                          SessionTable                       HTTP handlers
    Gateway.run_episode ──open()──► WAITING in the lobby ◄──claim()── POST /rl/sessions (admin)
       serve_with(its serve)        (managed: claimed at once)    ──► ACTIVE: id + key to agent
       first_call() ◄───────────── Session.take(call) + serve(call) ◄── /s/<id>/v1/chat/...
         none in time: reoffer() ──► WAITING again, new id + key   runs the episode's serve
                                     (the old ones: tombstones)     in the handler's task
         next() ◄── Finish ◄────── Session.finish() ◄──────────── POST /rl/sessions/<id>/reward
    run_episode returns ──close()──► ENDED (a tombstone: later calls get 410)

A session is one conversation: one call at a time (a second one while the first runs is a
409). Each episode the scheduler dispatches is a session. Its calls are served in their
handlers' tasks with the episode's serve function: the reply leaves as soon as it is made,
with no hand-over to another task (each one is a wait for the loop, behind every other call
woken with it). The episode's task meanwhile waits in :meth:`Session.next` for the session's
end, its idle deadline, or what a call raised that ends the episode (a turn limit); when the
episode ends (or the run cancels it), the call in progress is cancelled with it, its engine
requests aborted, and waited for.

Deadlines, each counted from the session's hand-out (its claim): the first call's (the
episode task's :meth:`Session.first_call`: a session taken and dropped goes back to the lobby,
:meth:`SessionTable.reoffer`), the idle one between calls (:meth:`Session.next`), and the whole
session's (the episode's task).

Keys: the admin key (made per run) creates sessions and ends them; each session has its own
key, which reaches that session only. Keys are compared in constant time
(:func:`hmac.compare_digest`), and a key is looked up by its SHA-256, never by the key itself.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncrl.plugin.environment import Prompt
from asyncrl_gateway.schema import GatewayError

__all__ = ["HttpCall", "Finish", "Session", "SessionTable", "digest", "make_key"]

TOMBSTONES = 8192
"""Ended sessions remembered (their ids answer 410 rather than 404)."""
END_WAIT_S = 10.0
"""How long an ending episode waits for its cancelled call to unwind (its engine request's
abort)."""


def make_key() -> str:
    """A new secret key (256 random bits, URL-safe)."""
    return "sk-arl-" + secrets.token_urlsafe(32)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def digest(key: str) -> bytes:
    """A key's SHA-256: what keys are looked up and compared by."""
    return _digest(key)


@dataclass(eq=False)
class HttpCall:
    """One HTTP call of a session, served in its handler's task (:meth:`Session.serve`)."""

    kind: str
    """``"chat"`` or ``"completion"``."""
    request: Any
    result: Any = None
    error: GatewayError | None = None
    raised: BaseException | None = None
    """What ended the session's episode while serving it (an :class:`EpisodeLimit`, a bug):
    the episode's task raises it."""
    finished: anyio.Event = field(default_factory=anyio.Event)
    _scope: anyio.CancelScope | None = None
    _cancelled: GatewayError | None = None
    size: int = 0
    """The request body's bytes (a big one is recorded off the event loop)."""

    def answer(self, result: Any) -> None:
        if self.result is None and self.error is None:
            self.result = result

    def fail(self, error: GatewayError) -> None:
        if self.result is None and self.error is None:
            self.error = error

    def serving(self, scope: anyio.CancelScope) -> bool:
        """It starts under ``scope``; ``False``: cancelled already."""
        self._scope = scope
        return self._cancelled is None

    @property
    def cancelled(self) -> GatewayError | None:
        """Why it was cancelled (``None``: it was not)."""
        return self._cancelled

    def cancel(self, why: GatewayError) -> None:
        """Stop serving it (its caller left, its session or episode ended): it fails with
        ``why``."""
        if self._cancelled is None:
            self._cancelled = why
        if self._scope is not None:
            self._scope.cancel()


@dataclass(frozen=True)
class Finish:
    """The session ends: with ``reward`` (and ``rewards`` as components), or scored by the
    environment (``reward`` is ``None``); ``abandon``: given back without a score (the
    episode fails and its group runs again)."""

    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    correct: bool | None = None
    abandon: str = ""


class Session:
    """One episode's session (see the module docstring). Built by :class:`SessionTable`."""

    def __init__(self, sid: str, prompt: Prompt, episode: str, evaluation: bool) -> None:
        self.id = sid
        self.episode = episode
        """The episode's id (``<group>/<index>``: the run's logs and timeline name it)."""
        self.group = episode.rpartition("/")[0]
        self.key = make_key()
        self.key_digest = _digest(self.key)
        self.prompt, self.evaluation = prompt, evaluation
        self.answered = 0
        """Calls answered with a reply (a session with none has nothing to train)."""
        self._claimed = anyio.Event()
        self._called = anyio.Event()
        """Set by the first call taken, or the session's end (:meth:`first_call`)."""
        self._serve: Callable[[HttpCall], Awaitable[None]] | None = None
        self._busy: HttpCall | None = None
        self._finish: Finish | None = None
        self._raised: BaseException | None = None
        self._changed = anyio.Event()
        self._last = anyio.current_time()
        """When a call last started or ended (or the session was handed out): the idle
        deadline counts from it."""
        self.claimed_at = self._last
        """When the session was handed out (opened, until it is): its deadlines count from
        it."""
        self._ended = False

    def _wake(self) -> None:
        """Wake the episode's task (:meth:`next`): the session ended, or a call raised."""
        self._changed.set()
        self._changed = anyio.Event()

    # ------------------------------------------------------------------ the episode's side
    def serve_with(self, serve: Callable[[HttpCall], Awaitable[None]]) -> None:
        """Calls are served by ``serve`` (which answers or fails each, and raises nothing but
        its task's cancellation)."""
        self._serve = serve

    async def wait_claimed(self) -> None:
        await self._claimed.wait()

    async def first_call(self, within_s: float) -> bool:
        """Whether a call came (or the session ended) within ``within_s`` of its hand-out;
        waits until one does or that time passes."""
        with anyio.CancelScope(deadline=self.claimed_at + within_s):
            await self._called.wait()
        return self._called.is_set()  # looked at again: a call taken as the deadline passed

    async def next(self, idle_s: float) -> Finish | None:
        """Wait for the session's end (its :class:`Finish`, once no call runs); ``None``
        when ``idle_s`` pass with no call running.

        Raises:
            BaseException: what a call raised that ends the episode (:attr:`HttpCall.raised`).
        """
        while True:  # woken by the end or a raise only, not by every call: it looks again
            if self._raised is not None:  # at the idle deadline
                raised, self._raised = self._raised, None
                raise raised
            if self._busy is None and self._finish is not None:
                return self._finish
            changed, wait_s = self._changed, idle_s  # a call runs: not idle, look again later
            if self._busy is None:
                wait_s = self._last + idle_s - anyio.current_time()
                if wait_s <= 0:
                    return None
            with anyio.move_on_after(wait_s):
                await changed.wait()

    async def end(self, why: GatewayError) -> None:
        """The episode is over: no more calls. A call running is cancelled with ``why`` and
        waited for (up to ``END_WAIT_S``: it uses the episode's record until it unwinds)."""
        self._ended = True
        self._claimed.set()  # a claim racing the end sees it ended
        busy = self._busy
        if busy is not None:
            busy.cancel(why)
            with anyio.CancelScope(shield=True), anyio.move_on_after(END_WAIT_S):
                await busy.finished.wait()
        self._serve = None  # it holds this session: a cycle the collector would have to find

    # ------------------------------------------------------------------ the HTTP side
    @property
    def claimed(self) -> bool:
        return self._claimed.is_set()

    @property
    def ended(self) -> bool:
        return self._ended

    def claim(self) -> None:
        """Hand the session out: its deadlines start now."""
        self.claimed_at = self._last = anyio.current_time()
        self._claimed.set()

    def reissue(self, sid: str) -> None:
        """The session, never called, goes back to the lobby as ``sid`` with a new key (what
        its first agent was given reaches it no more)."""
        assert not self._called.is_set() and not self._ended
        self.id = sid
        self.key = make_key()
        self.key_digest = _digest(self.key)
        self._claimed = anyio.Event()
        self.claimed_at = self._last = anyio.current_time()

    def take(self, call: HttpCall) -> None:
        """``call`` is the session's one call now; :meth:`serve` it next.

        Raises:
            GatewayError: 409 while another call of the session runs; 410 once it ended.
        """
        if self._ended:
            raise GatewayError(410, f"session {self.id} has ended", code="session_ended")
        if self._busy is not None:
            raise GatewayError(409, f"session {self.id} is serving another call: a session is "
                               "one conversation, one call at a time (open another session "
                               "for a parallel branch)", code="session_busy")  # fmt: skip
        assert self._serve is not None, "serve_with() comes first"
        self._busy = call
        self._last = anyio.current_time()
        self._called.set()

    async def serve(self, call: HttpCall) -> None:
        """Serve ``call`` (taken) in this task: it is answered or failed when this returns."""
        assert self._busy is call and self._serve is not None
        try:
            await self._serve(call)
        finally:
            if call.result is not None:
                self.answered += 1
            if call.raised is not None:
                self._raised = call.raised
            self._busy = None
            self._last = anyio.current_time()
            call.finished.set()
            if self._raised is not None or self._finish is not None:
                self._wake()

    def finish(self, finish: Finish) -> None:
        """End the session (its reward, or given back); a call in progress is cancelled.

        Raises:
            GatewayError: 410 once it ended; 409 when it was never claimed.
        """
        if self._ended:
            raise GatewayError(410, f"session {self.id} has ended", code="session_ended")
        if not self.claimed:
            raise GatewayError(409, f"session {self.id} was not handed out")
        if self._busy is not None:
            self._busy.cancel(GatewayError(410, f"session {self.id} was ended while this call "
                                           "ran", code="session_ended"))  # fmt: skip
        self._ended = True
        self._finish = finish
        self._called.set()
        self._wake()


@dataclass(eq=False)  # found in the queue by identity
class _Claim:
    """A ``POST /rl/sessions`` waiting for a session to open."""

    prompt_id: str | None
    arrived: anyio.Event = field(default_factory=anyio.Event)
    session: Session | None = None


class SessionTable:
    """Every session in the run, the lobby of those waiting for an agent, and the keys."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[bytes, str] = {}
        """SHA-256 of each live session's key → its id."""
        self._lobby: OrderedDict[str, Session] = OrderedDict()
        self._claims: list[_Claim] = []
        """Claims waiting for a session, oldest first (each woken only by its own)."""
        self._ended: OrderedDict[str, str] = OrderedDict()
        """Ended sessions' ids → why (the last :data:`TOMBSTONES`)."""
        self._ended_keys: OrderedDict[bytes, str] = OrderedDict()
        """Their keys' SHA-256 (a late call with its own key is told the session ended)."""
        self._closed = False
        self._count = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def counts(self) -> dict[str, int]:
        return {"waiting": len(self._lobby), "active": len(self._sessions) - len(self._lobby)}

    # ------------------------------------------------------------------ the episodes' side
    def open(self, prompt: Prompt, episode: str, *, evaluation: bool, claimed: bool) -> Session:
        """A session for ``episode``: in the lobby, or handed out already (``claimed``: a
        managed agent's)."""
        sid = self._new_id()
        session = Session(sid, prompt, episode, evaluation)
        self._sessions[sid] = session
        self._by_key[_digest(session.key)] = sid
        if claimed:
            session.claim()
        else:
            self._lobby[sid] = session
            self._hand_out(session)
        return session

    async def close(self, session: Session, why: str) -> None:
        """The session's episode is over (``why`` for a late caller); a call still running
        is cancelled and waited for (:meth:`Session.end`)."""
        if self._sessions.pop(session.id, None) is None:
            return
        self._lobby.pop(session.id, None)
        self._bury(session, why)
        await session.end(GatewayError(410, f"session {session.id} has ended: {why}",
                                       code="session_ended"))  # fmt: skip

    def reoffer(self, session: Session, why: str) -> None:
        """``session`` was handed out and never called: back to the front of the lobby under
        a new id and key (:meth:`Session.reissue`); its old id and key get 410 with
        ``why``."""
        if self._sessions.pop(session.id, None) is None:
            return
        self._bury(session, why)
        session.reissue(self._new_id())
        self._sessions[session.id] = session
        self._by_key[session.key_digest] = session.id
        self._lobby[session.id] = session
        self._lobby.move_to_end(session.id, last=False)  # admitted before those behind it
        self._hand_out(session)

    def _bury(self, session: Session, why: str) -> None:
        """Forget ``session``'s id and key, leaving tombstones (410 with ``why``)."""
        self._by_key.pop(session.key_digest, None)
        self._ended[session.id] = why
        self._ended_keys[session.key_digest] = session.id
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)
            self._ended_keys.popitem(last=False)

    def _new_id(self) -> str:
        self._count += 1
        return f"s{self._count:x}-{secrets.token_hex(4)}"

    def shut(self) -> None:
        """The run is ending: claims waiting give up."""
        self._closed = True
        for waiting in self._claims:
            waiting.arrived.set()
        self._claims.clear()

    # ------------------------------------------------------------------ the HTTP side
    async def claim(self, prompt_id: str | None, wait_s: float) -> Session:
        """The oldest session waiting in the lobby (of ``prompt_id`` if given), handed out;
        waits up to ``wait_s`` for one.

        Raises:
            GatewayError: 503 when none came in time (the scheduler admits no more episodes
                now: the staleness bound, ``pipeline.max_inflight_samples``, a refit), or the
                run is ending.
        """
        with anyio.move_on_after(wait_s):
            while not self._closed:
                found = self._take(prompt_id) or await self._wait(prompt_id)
                if found is not None and not found.ended:
                    found.claim()
                    return found
        if self._closed:
            raise GatewayError(503, "the run is ending: no more sessions", code="run_ending")
        which = f" of prompt {prompt_id!r}" if prompt_id is not None else ""
        raise GatewayError(
            503, f"no episode{which} is waiting for an agent after {wait_s:g} s: the scheduler "
            "admits episodes as the staleness bound and pipeline.max_inflight_samples allow "
            "(and not during a refit); try again", code="no_session", headers={"Retry-After": "1"},
        )  # fmt: skip

    def _take(self, prompt_id: str | None) -> Session | None:
        """The oldest session in the lobby (of ``prompt_id``), taken out of it."""
        found = next((s for s in self._lobby.values()
                      if prompt_id is None or s.prompt.id == prompt_id), None)  # fmt: skip
        if found is not None:
            del self._lobby[found.id]
        return found

    async def _wait(self, prompt_id: str | None) -> Session | None:
        """Queue for the next session (of ``prompt_id``) to open; ``None`` when the run is
        ending. A session handed to a claim that is cancelled first goes back to the lobby."""
        waiting = _Claim(prompt_id)
        self._claims.append(waiting)
        try:
            await waiting.arrived.wait()
        except BaseException:
            if waiting.session is not None and not waiting.session.ended:  # handed over as it
                # was cancelled: pass it on (one that ended meanwhile stays out of the lobby)
                self._lobby[waiting.session.id] = waiting.session
                self._lobby.move_to_end(waiting.session.id, last=False)
                self._hand_out(waiting.session)
            raise
        finally:
            if waiting in self._claims:
                self._claims.remove(waiting)
        return waiting.session

    def _hand_out(self, session: Session) -> None:
        """Give ``session`` (in the lobby) to the oldest claim waiting for it, if any: only
        that claim wakes."""
        for i, waiting in enumerate(self._claims):
            if waiting.prompt_id is None or waiting.prompt_id == session.prompt.id:
                del self._claims[i]
                del self._lobby[session.id]
                waiting.session = session
                waiting.arrived.set()
                return

    def get(self, sid: str) -> Session:
        """The live session ``sid``.

        Raises:
            GatewayError: 410 if it ended (recently), 404 if there is no such session.
        """
        session = self._sessions.get(sid)
        if session is not None:
            return session
        why = self._ended.get(sid)
        if why is not None:
            raise GatewayError(410, f"session {sid} has ended: {why}", code="session_ended")
        raise GatewayError(404, f"no session {sid!r}", code="session_not_found")

    def is_session_key(self, key: str) -> bool:
        """Whether ``key`` is some live session's key."""
        return _digest(key) in self._by_key

    def knows_digest(self, key_digest: bytes) -> bool:
        """Whether a key with this SHA-256 is a live session's or a recently ended one's."""
        return key_digest in self._by_key or key_digest in self._ended_keys
