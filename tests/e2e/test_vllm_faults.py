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

from asyncrl import plugins  # noqa: E402
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny", seed=3)


@pytest.mark.asyncio
@pytest.mark.parametrize("victim", ["EngineCore", "Worker"])
async def test_engine_death_during_a_refit_is_seen_at_once(
    victim: str, model_dir: Path, tmp_path: Path
) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    backend = plugins.load("asyncrl.generation_backends", "vllm")(make_ctx(model_dir, tmp_path))
    await backend.start()
    pids = backend.engine_pids()
    ipc_dir = backend._ipc_dir
    assert os.listdir(ipc_dir), "vLLM's ipc sockets are not in the backend's private directory"
    try:
        target = next(p for p in pids if victim in psutil.Process(p).name())
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        manifest = [
            TensorEntry(n, "bfloat16", list(p.shape), 0, 0) for n, p in ref.named_parameters()
        ]
        await backend.begin_weight_update(1, manifest)  # paused, as in a refit
        error: BaseException | None = None
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal error
                    try:
                        await backend.watch()
                    except EngineDeadError as exc:
                        error = exc

                tg.start_soon(watch)
                await anyio.sleep(0.5)
                killed_at = time.monotonic()
                os.kill(target, signal.SIGKILL)
        seen_after = time.monotonic() - killed_at
        assert error is not None
        message = str(error)
        assert "vLLM engine process" in message and "exited with code" in message
        if victim == "EngineCore":  # our own child: its exit code is readable
            assert f"pid {target}) exited with code -9" in message, message
        print(f"{victim} killed: watch fired after {seen_after:.2f} s: {message}")
        assert seen_after < 5
    finally:
        t0 = time.monotonic()
        await backend.close()
        closed_in = time.monotonic() - t0
    print(f"close() after the engine died: {closed_in:.1f} s")
    assert closed_in < 15
    assert alive(pids) == []
    assert not os.path.exists(ipc_dir), "the engine's ipc socket directory was left behind"
    # vLLM's shared-memory message queues (psm_*) belong to the engine: the backend removes
    # them. multiprocessing semaphores (sem.mp-*) belong to this process's resource tracker,
    # which unlinks them when this process exits (a rollout worker exits right after this;
    # the launch-mode fault matrix checks /dev/shm after whole runs).
    leaked = [n for n in orphan_shm(shm_before) if not n.startswith("sem.mp-")]
    assert leaked == []
