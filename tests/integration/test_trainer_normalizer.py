"""``FinishStep.normalizer`` (``loss.aggregation``) through the real fsdp2 and deepspeed
trainers, in this process (one gloo rank, a tiny random Qwen2, CPU): the same chunk finished
with the trained-token count and with another divisor reports gradient norms in the inverse
ratio of the divisors (each backend divides the accumulated loss-sum gradient once, before
its norm), and the loss likewise."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncrl.wire.messages import TrainBatch  # noqa: E402
from integration_support import in_fresh_process  # noqa: E402
from test_reference_policy import backend, model_dir, sequences, token_batch  # noqa: E402, F401


@pytest.mark.parametrize("name", ["fsdp2", "deepspeed"])
def test_the_normalizer_replaces_the_token_count_as_the_divisor(
    model_dir, tmp_path, name  # noqa: F811
) -> None:
    in_fresh_process(check_normalizer, model_dir, str(tmp_path), name)


def check_normalizer(model_dir: str, tmp_path: str, name: str) -> None:
    # one backend (DeepSpeed cannot be started twice in a process), two steps on the same
    # chunk; lr 1e-12 leaves the weights, so the gradient, the same to ~1e-12
    b = backend(model_dir, tmp_path, {}, name, {"lr": 1e-12, "max_grad_norm": 0.0})
    results = {}
    try:
        b.start()
        seqs = sequences(b._vocab_size)
        tb = token_batch(seqs)
        n = int((tb.seq_lens - tb.prompt_lens).sum())
        rng = np.random.default_rng(3)
        batch = TrainBatch(tb.tokens, tb.seq_lens, tb.prompt_lens,
                           -rng.random(n).astype(np.float32),
                           rng.normal(size=len(seqs)).astype(np.float32), np.ones(n, np.uint8))  # fmt: skip
        for step, divisor in enumerate((None, 7.0)):
            b.begin_step(step)
            b.train_chunk(step, batch)
            kwargs = {} if divisor is None else {"normalizer": divisor}
            results[divisor] = (b.finish_step(step, n, **kwargs), n)
    finally:
        b.close()
    (plain, n), (scaled, _) = results[None], results[7.0]
    assert plain.grad_norm > 0
    # the same gradient sum over another divisor: float32 rounding apart. Measured rel.
    # errors in the norm 7.7e-9 (fsdp2) and 3.9e-9 (deepspeed) on one 2-core host, 0 and
    # 3.85e-8 on another (a different CPU's kernels round differently), 0 in the loss; the
    # bound is 3x the largest, about float32's epsilon (a normalizer applied twice, or not
    # at all, is off by a factor of n / 7 or more)
    assert scaled.grad_norm * 7.0 == pytest.approx(plain.grad_norm * n, rel=1.2e-7)
    assert scaled.loss * 7.0 == pytest.approx(plain.loss * n, rel=1.2e-7)
