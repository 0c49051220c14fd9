"""An engine that takes turns with a trainer (``cluster.placement = "take_turns"``) on the real
vLLM CPU build: it sleeps, a refit wakes it, and no request is lost or hangs across the
transitions, however they interleave with requests.

The CPU build has no sleep mode to release memory (vLLM's sleep pauses its scheduler and clears
the prefix cache there); what runs here is everything around it: requests stopped and held at a
sleep, requests arriving while the engine falls asleep, sleeps and wakes up, the wake through
the refit in the order the GPU needs (weights, the load, the KV cache), and each moved sample's
tokens checked against an independent reference of the weights that generated them. The GPU
run of the same calls is ``tests/gpu/test_vllm_gpu.py``'s.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from asyncrl import registry
from asyncrl.backend import WorkerContext, generate_all
from asyncrl.config import from_dict
from asyncrl.wire.messages import GenRequest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")
from asyncrl_arith.model import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_backend import (  # noqa: E402
    ENGINE_OPTIONS, TOL, hf_model, perturbed, ref_logprobs, refit, write_buckets,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
]
module_loop = pytest.mark.asyncio(loop_scope="module")

CYCLES = int(os.environ.get("ASYNCRL_TURN_CYCLES", "100"))
"""Sleep/wake cycles of the main test (the issue asks for at least 100)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("model") / "tiny", seed=7)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = from_dict({
        "model": {"path": str(model_dir)},
        "environment": {"name": "arithmetic"},
        "cluster": {"placement": "take_turns"},
        "generator": {"backend": "vllm", "options": ENGINE_OPTIONS},
    })  # fmt: skip
    ctx = WorkerContext("rollout", 0, 1, 0, config, str(tmp_path_factory.mktemp("run")))
    backend = registry.load("asyncrl.generation_backends", "vllm")(ctx)
    await backend.start()
    yield backend
    await backend.close()


def group(name: str, n: int, seed: int) -> GenRequest:
    # sampled answers of this random model end by EOS after about 50 tokens (3 ms each)
    return GenRequest(group_id=name, prompt_ids=[1, 8, 3], n=n, max_tokens=120, seed=seed)


@module_loop
async def test_no_request_is_lost_or_hangs_across_sleeps_and_wakes(backend, model_dir, tmp_path):
    """``CYCLES`` times: groups in flight, a sleep with more groups arriving as it begins and
    while the engine sleeps, then the refit that wakes it with more arriving during it. Every
    group comes back whole: each sample ends by EOS or its length, its tokens labelled with
    non-decreasing versions. Samples stopped by a sleep went on from their tokens on the next
    version, and their tokens match a float32 reference of the weights of their own version."""
    states = [perturbed(model_dir, seed=s) for s in (21, 22)]  # version v runs states[v % 2]
    tasks: list[asyncio.Task] = []
    held = waited = 0
    loop = asyncio.get_running_loop()
    start = loop.time()

    def send(tag: str, n: int = 2) -> None:
        name = f"{tag}-{len(tasks)}"
        tasks.append(asyncio.create_task(generate_all(backend, group(name, n, len(tasks)))))

    for cycle in range(1, CYCLES + 1):
        send("before", 4)
        await asyncio.sleep(0.01 * (cycle % 4))  # from nothing yet in the engine to tokens in
        sleeping = asyncio.create_task(backend.sleep())
        send("falling-asleep")  # arrives as the sleep begins
        facts = await sleeping
        held += facts["held"]
        assert backend._turn.state == "asleep"
        send("asleep")
        await asyncio.sleep(0)
        waited = max(waited, backend._turn.waiting)
        views = write_buckets(tmp_path, cycle, states[cycle % 2], count=2, in_place=True)
        waking = asyncio.create_task(refit(backend, views, cycle))
        send("waking")  # arrives while the weights load
        await waking
        assert backend._turn.state == "awake" and backend.last_refit["woke"] is True
    samples = [s for t in await asyncio.wait_for(asyncio.gather(*tasks), 120) for s in t]
    print(f"{CYCLES} cycles in {loop.time() - start:.1f} s: {len(tasks)} groups, "
          f"{len(samples)} samples, {held} stops by a sleep, at most {waited} held at the door")  # fmt: skip
    moved = []
    for s in samples:
        versions = s.versions.tolist()
        assert s.finish_reason in ("stop", "length"), s.finish_reason
        assert len(versions) == len(s.token_ids) == len(s.logprobs) > 0
        assert versions == sorted(versions), versions
        if len(set(versions)) > 1:
            moved.append(s)
    assert held > 0 and waited > 0 and moved, (held, waited, len(moved))

    # the moved samples' tokens, each under the weights of its own version
    models = [hf_model(model_dir, {k: v.float() for k, v in st.items()}) for st in states]
    worst = 0.0
    for s in moved[:8]:
        tokens = [1, 8, 3, *s.token_ids.tolist()]
        refs = [ref_logprobs(m, tokens, 3) for m in models]
        for i, v in enumerate(s.versions.tolist()):
            if v == 0:  # the checkpoint's weights: no refit yet
                continue
            worst = max(worst, abs(float(s.logprobs[i]) - refs[v % 2][i]))
    print(f"{len(moved)} samples went on after a sleep; max |engine - reference| {worst:.4f}")
    assert worst < TOL
    assert backend._llm.get_num_unfinished_requests() == 0


@module_loop
async def test_a_sleep_while_asleep_does_nothing_and_a_refit_wakes_it(backend, model_dir, tmp_path):
    first = await backend.sleep()
    again = await backend.sleep()
    assert again == {"sleep_s": 0.0, "held": 0} and first["held"] == 0
    task = asyncio.create_task(generate_all(backend, group("held", 2, 0)))
    await asyncio.sleep(0.05)
    assert not task.done() and backend._turn.waiting == 2  # its two samples
    version = backend.version + 1
    await refit(backend, write_buckets(tmp_path, version, perturbed(model_dir, 3), 1), version)
    samples = await asyncio.wait_for(task, 30)
    assert all(set(s.versions.tolist()) == {version} for s in samples)
