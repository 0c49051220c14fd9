"""A vLLM engine process dying is seen at once, even in the middle of a refit.

vLLM's own front end notices a dead engine core only when it next needs it, and
``pause_generation`` on a dead engine never returns: a refit would wait for
``refit.timeout_s`` and then blame the trainer. The backend's ``watch()`` waits on a pidfd
of every engine process and raises ``EngineDeadError`` naming the process and its exit code;
``close()`` then leaves no process, no ipc socket file and no shared memory behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
import psutil  # noqa: E402
import transformers  # noqa: E402

from asyncrl import registry  # noqa: E402
from asyncrl.config import FailuresConfig  # noqa: E402
from asyncrl.errors import EngineDeadError  # noqa: E402
from asyncrl.wire.messages import TensorEntry  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import alive  # noqa: E402
from test_vllm_backend import make_ctx, orphan_shm  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


@pytest.fixture(autouse=True)
def collect_the_engines_garbage() -> object:
    """vLLM's front end over a dead or hung engine leaves its ZeroMQ context to the garbage
    collector: collect it inside the test, where the ResourceWarning filter above applies,
    not at the end of the session, where pytest turns it into an error."""
    import gc

    yield
    gc.collect()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny", seed=3)


async def _signal_while_watched(
    backend: object, target: int, sig: int, after_s: float, within_s: float
) -> tuple[EngineDeadError | None, float]:
    """Run the backend's watch; ``after_s`` later (no verdict yet) send ``sig`` to ``target``;
    the watch's ``EngineDeadError`` (within ``within_s``) and when the signal went."""
    error: EngineDeadError | None = None

    async def watch() -> None:
        nonlocal error
        try:
            await backend.watch()
        except EngineDeadError as exc:
            error = exc

    with anyio.fail_after(within_s):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await anyio.sleep(after_s)
            assert error is None, error
            sent_at = time.monotonic()
            os.kill(target, sig)
    return error, sent_at


@pytest.mark.asyncio
async def test_engine_death_during_a_refit_is_seen_at_once(model_dir: Path, tmp_path: Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    backend = registry.load("asyncrl.generation_backends", "vllm")(make_ctx(model_dir, tmp_path))
    await backend.start()
    pids = backend.engine_pids()
    ipc_dir = backend._ipc_dir
    assert os.listdir(ipc_dir), "vLLM's ipc sockets are not in the backend's private directory"
    try:
        names = {p: psutil.Process(p).name() for p in pids}
        target = next(p for p in pids if "EngineCore" in names[p])
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        manifest = [
            TensorEntry(n, "bfloat16", list(p.shape), 0, 0) for n, p in ref.named_parameters()
        ]
        await backend.begin_weight_update(1, manifest)  # paused, as in a refit
        error, killed_at = await _signal_while_watched(backend, target, signal.SIGKILL, 0.5, 20)
        seen_after = time.monotonic() - killed_at
        assert error is not None
        message = str(error)
        # the process killed, by the kernel's name for it (comm: 15 characters at most); which
        # of several engine processes is named when they die together: the unit tests'
        # stand-ins (test_generation_failures.py), since this engine has one
        assert f"vLLM engine process {names[target][:15]} (pid {target}) exited with code -9" in (
            message
        ), message
        print(f"engine core killed: watch fired after {seen_after:.2f} s: {message}")
        # at once (docs/failures.md): the pidfd fires as the process exits; without the watch
        # nothing would (pause_generation on a dead engine never returns)
        assert seen_after < 5
    finally:
        t0 = time.monotonic()
        await backend.close()
        closed_in = time.monotonic() - t0
    print(f"close() after the engine died: {closed_in:.1f} s")
    assert closed_in < 15  # a hang guard: close() kills what is left after 1 s
    assert alive(pids) == []
    assert not os.path.exists(ipc_dir), "the engine's ipc socket directory was left behind"
    # vLLM's shared-memory message queues (psm_*) belong to the engine: the backend removes
    # them. multiprocessing semaphores (sem.mp-*) belong to this process's resource tracker,
    # which unlinks them when this process exits (a rollout worker exits right after this;
    # the launch-mode fault matrix checks /dev/shm after whole runs).
    leaked = orphan_shm(shm_before)
    assert leaked == []


PROBE_TIMEOUT_S = 3.0
PROBE_INTERVAL_S = FailuresConfig(heartbeat_timeout_s=PROBE_TIMEOUT_S).heartbeat_interval_s
"""The probe interval derived from that timeout: 0.25 s (a twelfth of it)."""


def probed_ctx(model_dir: Path, run_dir: Path):
    """``make_ctx`` with a short heartbeat: the engine probe runs on its settings."""
    from asyncrl.backend import WorkerContext
    from asyncrl.config import from_dict

    base = make_ctx(model_dir, run_dir)
    raw = {
        "model": {"path": str(model_dir)},
        "environment": {"name": "arithmetic"},
        "generator": {"backend": "vllm", "options": dict(base.config.generator.options)},
        "failures": {"heartbeat_timeout_s": PROBE_TIMEOUT_S},
    }
    return WorkerContext("rollout", 0, 1, 0, from_dict(raw), str(run_dir))


@pytest.mark.asyncio
async def test_a_stopped_engine_behind_a_live_worker_is_named_by_its_probe(
    model_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP one engine process: it does not exit, and the worker's own loop still answers
    the controller's heartbeat. The watch's liveness probe of the engine core names the hang
    within ``failures.heartbeat_timeout_s``, and close() kills the stopped processes."""
    backend = registry.load("asyncrl.generation_backends", "vllm")(probed_ctx(model_dir, tmp_path))
    await backend.start()
    pids = backend.engine_pids()
    ipc_dir = backend._ipc_dir
    try:
        target = next(p for p in pids if "EngineCore" in psutil.Process(p).name())
        # first, answered probes: no verdict before the stop (the helper checks)
        error, stopped_at = await _signal_while_watched(
            backend, target, signal.SIGSTOP, 2 * PROBE_INTERVAL_S, 30
        )
        named_after = time.monotonic() - stopped_at
        message = str(error)
        assert "answered no liveness probe in 3 s (failures.heartbeat_timeout_s)" in message
        assert "EngineCor" in message, message  # the core (comm name cut at 15 chars), whoever stalls it
        print(f"engine core stopped: named after {named_after:.2f} s: {message}")
        # not before the timeout (the probes were answered until the stop); how long after it
        # is the event loop's on a busy machine (about one interval: 3.01 s measured), and
        # _signal_while_watched's 30 s the hang guard
        assert named_after >= PROBE_TIMEOUT_S
    finally:
        t0 = time.monotonic()
        await backend.close()
        closed_in = time.monotonic() - t0
    print(f"close() with a stopped engine process: {closed_in:.1f} s")
    assert closed_in < 20  # a hang guard: close() SIGKILLs the stopped processes
    assert alive(pids) == []
    assert not os.path.exists(ipc_dir)
