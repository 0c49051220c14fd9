"""The fsdp2 backend's reference policy and refreshed inputs, in this process (one gloo rank,
a tiny random Qwen2, CPU).

* ``loss.kl_coef = 0``: no reference is loaded (one ``from_pretrained``: the policy) and none
  can be run;
* ``kl_coef > 0``: the reference is the initial weights and stays so after optimizer steps;
  a chunk's loss with refreshed proximal logprobs and a k3 term equals a float64 computation
  written here from the formulas, over a plain transformers forward of the same weights.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncrl.backend import WorkerContext  # noqa: E402
from asyncrl.config import from_dict  # noqa: E402
from asyncrl.registry import load  # noqa: E402
from asyncrl.wire.messages import TokenBatch, TrainBatch  # noqa: E402
from integration_support import in_fresh_process  # noqa: E402

CLIP, CAP, COEF = 0.2, 2.0, 0.5
OPTIONS = {  # an update big enough to move the policy's logprobs visibly in one step
    "fsdp2": {"optimizer": "sgd", "lr": 0.5, "max_grad_norm": 0.0},
    "deepspeed": {"lr": 0.05, "max_grad_norm": 0.0},
}


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as torchrun's one rank, for the test alone (left set, the variables made
    a later test's ``python -m asyncrl.launch`` on the same worker take itself for a rank)."""
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from asyncrl_arith.model import build_model

    return str(build_model(tmp_path_factory.mktemp("reference") / "model", seed=0))


def backend(model_dir: str, tmp_path, loss: dict, name: str = "fsdp2", options: dict | None = None):
    """One trainer rank in this process, as torchrun would start it (DeepSpeed reads the
    environment: :func:`one_rank` sets it for this file's tests and takes it back after
    them; in a process of :func:`in_fresh_process`, here. It cannot be started twice in a
    process: use :func:`in_fresh_process`)."""
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    config = from_dict({
        "model": {"path": model_dir}, "environment": {"name": "arithmetic"},
        "loss": {"clip_eps_low": CLIP, "clip_eps_high": CLIP, "is_cap": CAP, **loss},
        "trainer": {"backend": name, "micro_batch_size": 2, "options": options or OPTIONS[name]},
    })  # fmt: skip
    ctx = WorkerContext(group="trainer", rank=0, world_size=1, local_rank=0, config=config,
                        run_dir=str(tmp_path), extra={"dist_store": torch.distributed.HashStore()})  # fmt: skip
    return load("asyncrl.training_backends", name)(ctx)


def sequences(vocab: int) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(5):
        prompt, response = int(rng.integers(1, 5)), int(rng.integers(2, 7))
        out.append((rng.integers(4, vocab, prompt + response).astype(np.int32), prompt))
    return out


def token_batch(seqs) -> TokenBatch:
    return TokenBatch(np.concatenate([t for t, _ in seqs]),
                      np.array([len(t) for t, _ in seqs], np.int32),
                      np.array([p for _, p in seqs], np.int32))  # fmt: skip


def float64_logprobs(model_dir: str, seqs) -> list[list[float]]:
    """Response logprobs by a plain float64 transformers forward, one sequence at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    out = []
    with torch.no_grad():
        for tokens, prompt in seqs:
            ids = torch.tensor(tokens, dtype=torch.long)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            out.append([float(logp[t - 1, tokens[t]]) for t in range(prompt, len(tokens))])
    return out


def test_without_a_kl_term_nothing_is_loaded_or_run(model_dir, tmp_path, monkeypatch) -> None:
    loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    b = backend(model_dir, tmp_path, {})
    try:
        b.start()
        assert loads == [model_dir]  # the policy only
        with pytest.raises(RuntimeError, match="no reference policy is loaded.*kl_coef"):
            b.reference_logprobs(token_batch(sequences(64)), 1.0)
    finally:
        b.close()
    b = backend(model_dir, tmp_path, {"kl_coef": 0.1})
    try:
        b.start()
        assert loads == [model_dir, model_dir, model_dir]  # and now the reference
    finally:
        b.close()


@pytest.mark.parametrize("name", ["fsdp2", "deepspeed"])
def test_k3_in_the_loss_with_refreshed_proximal_logprobs_matches_float64(
    model_dir, tmp_path, name
) -> None:
    in_fresh_process(check_k3_in_the_loss, model_dir, str(tmp_path), name)


def check_k3_in_the_loss(model_dir: str, tmp_path: str, name: str) -> None:
    b = backend(model_dir, tmp_path, {"kl_coef": COEF, "kl_estimator": "k3",
                                      "proximal_policy": "current"}, name)  # fmt: skip
    try:
        b.start()
        seqs = sequences(b._vocab_size)
        tb = token_batch(seqs)
        initial = float64_logprobs(model_dir, seqs)
        flat = np.concatenate(initial)
        # float32 forward vs float64: measured max |diff| 3.8e-7 on this model (bound 1.2e-6)
        np.testing.assert_allclose(b.reference_logprobs(tb, 1.0), flat, atol=1.2e-6)
        rng = np.random.default_rng(11)
        n = flat.size
        behaviour = (flat + rng.normal(0, 0.4, n)).astype(np.float32)
        proximal = (flat + rng.normal(0, 0.2, n)).astype(np.float32)
        reference = (flat + rng.normal(0, 0.3, n)).astype(np.float32)
        advantages = rng.normal(size=len(seqs)).astype(np.float32)
        mask = (rng.random(n) < 0.8).astype(np.uint8)
        batch = TrainBatch(tb.tokens, tb.seq_lens, tb.prompt_lens, behaviour, advantages, mask,
                           proximal_logprobs=proximal, reference_logprobs=reference)  # fmt: skip
        b.begin_step(0)
        chunk = b.train_chunk(0, batch)
        # the float64 objective, token by token
        lengths = [len(t) - p for t, p in seqs]
        adv = np.repeat(advantages.astype(np.float64), lengths)
        loss = kl = 0.0
        for t in range(n):
            if not mask[t]:
                continue
            lp = flat[t]
            w = min(math.exp(proximal[t] - behaviour[t]), CAP)
            r = math.exp(lp - proximal[t])
            loss -= w * min(r * adv[t], min(max(r, 1 - CLIP), 1 + CLIP) * adv[t])
            d = reference[t] - lp
            kl += math.exp(d) - 1 - d
        # float32 vs float64 over 19 tokens: measured rel errors 2.9e-7 (KL), 1.2e-6 (loss)
        assert chunk.kl_sum == pytest.approx(kl, rel=1e-6)
        assert chunk.loss_sum == pytest.approx(loss + COEF * kl, rel=3.6e-6)
        b.finish_step(0, int(mask.sum()))
        # the weights moved; the reference did not
        moved = np.abs(b.compute_logprobs(tb, 1.0) - flat).max()
        assert moved > 1e-3
        np.testing.assert_allclose(b.reference_logprobs(tb, 1.0), flat, atol=1.2e-6)
    finally:
        b.close()
