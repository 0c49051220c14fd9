"""The KL term to the reference policy (asyncrl_torch.loss.kl_to_reference).

The KL estimators (Schulman, "Approximating KL divergence", 2020; with r = pi_ref / pi and
d = log r: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r) are checked against plain
Python float64 written here from those formulas, the torch term's gradient by torch's
gradcheck and against the formulas' derivatives, and the numpy twin the controller uses for a
KL in the reward against the same Python. (The refresh plan and the mini-batches:
tests/unit/test_kl_and_refresh.py.)
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from asyncrl.policy.loss_inputs import kl_estimate

torch = pytest.importorskip("torch")

from asyncrl_torch.loss import kl_to_reference  # noqa: E402


def kl_python(lp: float, ref: float, estimator: str) -> float:
    log_r = ref - lp
    return {"k1": -log_r, "k2": log_r * log_r / 2, "k3": math.exp(log_r) - 1 - log_r}[estimator]


def kl_grad_python(lp: float, ref: float, estimator: str) -> float:
    """d k / d lp, by hand: k1 -> 1; k2 -> -(ref - lp); k3 -> 1 - exp(ref - lp)."""
    return {"k1": 1.0, "k2": -(ref - lp), "k3": 1.0 - math.exp(ref - lp)}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_against_the_formulas_and_its_gradient(estimator: str) -> None:
    rng = random.Random(3)
    n = 40
    lp = [rng.uniform(-4, -0.01) for _ in range(n)]
    ref = [x + rng.gauss(0, 0.5) for x in lp]
    mask = [rng.random() < 0.8 for _ in range(n)]
    ref_t = torch.tensor(ref, dtype=torch.float64)
    ref_t[~torch.tensor(mask)] = float("nan")  # a token that does not train may hold anything
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    total = kl_to_reference(lp_t, ref_t, torch.tensor(mask), estimator)
    total.backward()
    want = math.fsum(kl_python(a, b, estimator) for a, b, m in zip(lp, ref, mask) if m)
    assert float(total.detach()) == pytest.approx(want, rel=1e-12)
    grads = [kl_grad_python(a, b, estimator) if m else 0.0 for a, b, m in zip(lp, ref, mask)]
    np.testing.assert_allclose(lp_t.grad.numpy(), grads, rtol=1e-12, atol=1e-15)
    # the numpy twin (a KL in the reward) gives the same per-token values
    np.testing.assert_allclose(kl_estimate(np.array(lp), np.array(ref), estimator),
                               [kl_python(a, b, estimator) for a, b in zip(lp, ref)], rtol=1e-12)


def test_k3_is_never_negative_and_gradcheck_passes() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(12, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref = lp.detach() + torch.randn(12, generator=gen, dtype=torch.float64)
    mask = torch.rand(12, generator=gen) < 0.7
    for estimator in ("k2", "k3"):
        assert torch.autograd.gradcheck(lambda x: kl_to_reference(x, ref, mask, estimator), (lp,))
    assert float(kl_to_reference(lp.detach(), ref, mask, "k3")) >= 0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_to_reference(lp, ref, mask, "k4")
