"""A refit is right on every CPU GEMM kernel the installed vLLM CPU build can choose.

vLLM's CPU build runs linear layers through closures built from the weights (oneDNN handles,
sgl-kernel packed copies on AMX, plain ``F.linear`` as the fallback); which one a layer gets
depends on the CPU and the weight's size, so a green run on one machine proves one path. Each
case here forces one kernel (``cpu_gemm_kernel``), refits perturbed weights in several buckets
and compares the engine's logprobs with a float32 transformers forward pass of the same bf16
weights (the trainer's computation, sharing no code with vLLM). A kernel this CPU lacks is
skipped with the reason. The tiny model ties ``lm_head`` to the embedding: the layer that went
stale before the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from asyncrl import registry  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_backend import (  # noqa: E402
    TOL,
    hf_model,
    make_ctx,
    perturbed,
    ref_logprobs,
    refit,
    token_batch,
    write_buckets,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
]


def _skip_reason(kernel: str) -> str | None:
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the CPU's own build (_C, _C_AVX512 or _C_AVX2)

    if kernel == "sgl" and not torch.cpu._is_amx_tile_supported():
        return "this CPU has no AMX (amx_tile): vLLM never picks the sgl-kernel path here"
    if kernel == "onednn" and not getattr(ops, "_supports_onednn", False):
        return "this vLLM build has no oneDNN GEMM"
    return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("model") / "tiny", seed=11)


CASES = [
    pytest.param("onednn", True, id="onednn-eager"),
    pytest.param("sgl", True, id="sgl-eager"),
    pytest.param("torch", True, id="torch-eager"),
    # torch.compile traces through the GEMM closures: new closures must still be used
    pytest.param("auto", False, id="auto-compiled"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("kernel", "eager"), CASES)
async def test_refit_matches_the_trainer_on_each_cpu_kernel(
    kernel: str, eager: bool, model_dir: Path, tmp_path: Path
) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU GEMM kernels exist on the CPU build only")
    reason = _skip_reason(kernel)
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(1)
    sequences = [([1] + rng.integers(4, 51, n - 1).tolist(), p) for p, n in [(6, 30), (14, 40)]]
    batch = token_batch(sequences)
    backend = registry.load("asyncrl.generation_backends", "vllm")(
        make_ctx(model_dir, tmp_path, cpu_gemm_kernel=kernel, enforce_eager=eager)
    )
    try:
        caps = await backend.start()
        kernels = caps["cpu_gemm_kernels"]
        if kernel != "auto":
            assert set(kernels) == {kernel}, kernels
        for version, seed in ((1, 5), (2, 6)):  # two refits: the second replaces refit weights
            state = perturbed(model_dir, seed=seed)
            await refit(backend, write_buckets(tmp_path, version, state, count=3), version)
            got = await backend.score(batch, 1.0)
            ref = hf_model(model_dir, {k: v.float() for k, v in state.items()})
            expected = np.concatenate([ref_logprobs(ref, s, p) for s, p in sequences])
            err = float(np.abs(got - expected).max())
            print(f"{kernel} eager={eager} v{version}: max |engine - trainer| = {err:.4f}")
            assert err < TOL, f"{kernel}: the engine does not serve weights v{version} ({err:.3f})"
        (after,) = await backend._rpc("asyncrl_gemm_kernels")
        assert sorted(set(after.values())) == sorted(kernels), (kernels, after)
    finally:
        await backend.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt", [[1], [1, 5]], ids=["1-token", "2-token"])
async def test_a_fresh_engines_first_short_prompt_on_amx(
    prompt: list[int], model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's sgl kernel runs a prompt of one or two tokens straight on AMX tiles: in a
    process that never asked Linux for AMX state that is SIGILL (the engine's worker died
    with exit code -4 on an AMX host before asyncrl_vllm.ext requested it). A fresh engine
    whose first request is such a prompt must serve it."""
    from asyncrl.backend import generate_all
    from asyncrl.wire.messages import GenRequest

    if torch.cuda.is_available():
        pytest.skip("CPU GEMM kernels exist on the CPU build only")
    reason = _skip_reason("sgl")
    if reason:
        pytest.skip(reason)
    backend = registry.load("asyncrl.generation_backends", "vllm")(
        make_ctx(model_dir, tmp_path, cpu_gemm_kernel="sgl")
    )
    caps = await backend.start()
    try:
        assert set(caps["cpu_gemm_kernels"]) == {"sgl"}, caps["cpu_gemm_kernels"]
        (sample,) = await generate_all(
            backend, GenRequest(group_id="short", prompt_ids=prompt, n=1, max_tokens=3)
        )
        assert 1 <= len(sample.token_ids) <= 3
    finally:
        await backend.close()
