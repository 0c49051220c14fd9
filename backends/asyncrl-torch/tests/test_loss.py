"""asyncrl_torch.loss and asyncrl_torch.batches against hand computations in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from asyncrl_torch.loss import ppo_clip_loss  # noqa: E402
from asyncrl.policy.packing import check_packed, micro_batch_bounds  # noqa: E402
from asyncrl_torch.batches import (  # noqa: E402
    dummy_micro_batch,
    make_micro_batch,
    response_logprobs,
)

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.3, 2.0
F64 = torch.float64


def _hand_token(lp: float, beh: float, adv: float, prox: float | None) -> tuple[float, float, bool]:
    """(loss, d loss / d lp, clipped) for one token, written out case by case."""
    p = beh if prox is None else prox
    w = min(math.exp(p - beh), CAP)
    r = math.exp(lp - p)
    r_clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
    unclipped_term, clipped_term = r * adv, r_clipped * adv
    if unclipped_term <= clipped_term:
        return -w * unclipped_term, -w * adv * r, False
    return -w * clipped_term, 0.0, True


# (lp, behaviour, advantage, proximal or None) and what each case exercises
CASES = [
    (-1.0, -1.1, 1.0, None),  # A > 0, r = 1.105 inside the clip range
    (-0.5, -1.0, 2.0, None),  # A > 0, r = 1.649 > 1.3: clipped, no gradient
    (-2.0, -1.5, -1.0, None),  # A < 0, r = 0.607 < 0.8: clipped, no gradient
    (-2.0, -1.5, 1.0, None),  # A > 0, r = 0.607 < 0.8: the min keeps r*A, gradient flows
    (-0.2, -1.0, -0.5, None),  # A < 0, r = 2.23 > 1.3: unclipped (pessimistic side)
    (-1.0, -2.0, 1.0, -1.2),  # proximal: w = exp(0.8) = 2.23 capped at 2, r = 1.221
    (-1.0, -1.2, -2.0, -0.9),  # proximal: w = exp(0.3) = 1.35 (cap inactive), r = 0.905
    (-3.0, -1.0, 1.5, -1.0),  # proximal: w = 1, r = 0.135 < 0.8 with A > 0: not clipped
]


def _run(cases, mask=None):
    lp = torch.tensor([c[0] for c in cases], dtype=F64, requires_grad=True)
    beh = torch.tensor([c[1] for c in cases], dtype=F64)
    adv = torch.tensor([c[2] for c in cases], dtype=F64)
    prox = torch.tensor([c[1] if c[3] is None else c[3] for c in cases], dtype=F64)
    has_prox = any(c[3] is not None for c in cases)
    mask = torch.ones(len(cases), dtype=torch.bool) if mask is None else mask
    loss, stats = ppo_clip_loss(
        lp,
        beh,
        adv,
        mask,
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        is_cap=CAP,
        proximal_logprobs=prox if has_prox else None,
    )
    loss.backward()
    return loss, stats, lp.grad


def test_loss_matches_hand_computation_token_by_token():
    for case in CASES:
        loss, stats, grad = _run([case])
        want_loss, want_grad, want_clipped = _hand_token(*case)
        assert loss.dtype == F64
        assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-15), case
        assert grad.item() == pytest.approx(want_grad, rel=1e-12, abs=1e-15), case
        assert int(stats.clipped_tokens) == int(want_clipped), case


def test_loss_sums_over_masked_tokens_and_reports_stats():
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    loss, stats, grad = _run(CASES, mask)
    hand = [_hand_token(*c) for c in CASES]
    kept = [i for i in range(len(CASES)) if mask[i]]
    assert loss.item() == pytest.approx(sum(hand[i][0] for i in kept), rel=1e-12)
    for i, case in enumerate(CASES):
        assert grad[i].item() == pytest.approx(hand[i][1] if mask[i] else 0.0, abs=1e-14)
    assert int(stats.clipped_tokens) == sum(hand[i][2] for i in kept) == 1
    weights = [
        min(math.exp((c[1] if c[3] is None else c[3]) - c[1]), CAP) for c in CASES
    ]
    assert stats.is_weight_sum.item() == pytest.approx(sum(weights[i] for i in kept), rel=1e-12)
    assert stats.abs_logprob_diff_sum.item() == pytest.approx(
        sum(abs(CASES[i][0] - CASES[i][1]) for i in kept), rel=1e-12
    )


def test_default_proximal_is_behaviour_with_unit_weight():
    cases = CASES[:5]
    loss, stats, _ = _run(cases)
    assert stats.is_weight_sum.item() == pytest.approx(len(cases), rel=1e-15)
    # clipped: case 1 (A>0, r>1.3) and case 2 (A<0, r<0.8)
    assert int(stats.clipped_tokens) == 2


def test_masked_garbage_cannot_poison_loss_or_gradient():
    lp = torch.tensor([-1.0, -1.0], dtype=F64, requires_grad=True)
    beh = torch.tensor([-1.2, float("inf")], dtype=F64)
    adv = torch.tensor([1.0, float("nan")], dtype=F64)
    prox = torch.tensor([-1.1, float("-inf")], dtype=F64)
    loss, _ = ppo_clip_loss(
        lp, beh, adv, torch.tensor([True, False]),
        clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_cap=CAP, proximal_logprobs=prox,
    )
    loss.backward()
    want_loss, want_grad, _ = _hand_token(-1.0, -1.2, 1.0, -1.1)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert lp.grad.tolist() == pytest.approx([want_grad, 0.0], abs=1e-15)


def _numpy_reference(lp, beh, adv, prox, mask):
    """Loss sum and d loss / d lp in numpy float64 over the tokens where ``mask`` is 1 only
    (the others are left out before any arithmetic), written from the formula."""
    keep = np.asarray(mask) == 1
    lp, beh, adv, prox = (np.asarray(a, np.float64)[keep] for a in (lp, beh, adv, prox))
    w = np.minimum(np.exp(prox - beh), CAP)
    r = np.exp(lp - prox)
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    unclipped, clipped = r * adv, np.clip(r, lo, hi) * adv
    takes_clipped = clipped < unclipped
    loss = -(w * np.where(takes_clipped, clipped, unclipped)).sum()
    grad = np.zeros(keep.size)
    grad[keep] = np.where(takes_clipped, 0.0, -w * adv * r)
    return loss, grad, int(takes_clipped.sum())


def _masked_batch(dtype, seed=3, n=64):
    """Random tokens, a mask with runs of masked tokens (inserted observations), and huge
    placeholder behaviour logprobs, proximal logprobs and advantages at the masked ones."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.1, 4.0, n)
    beh = lp + rng.normal(0, 0.05, n)  # near lp: few clips, so most trained grads are nonzero
    prox = lp + rng.normal(0, 0.05, n)
    adv = np.repeat(rng.normal(0, 1, n // 8), 8)
    mask = np.ones(n, np.uint8)
    for start in rng.choice(n - 5, size=5, replace=False):
        mask[start : start + int(rng.integers(1, 5))] = 0
    garbage = np.where(np.arange(n) % 2 == 0, 1e30, -1e30)
    beh, prox, adv = (np.where(mask == 1, a, garbage) for a in (beh, prox, adv))
    as_t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    return lp, beh, adv, prox, mask, as_t


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_prox", [False, True])
def test_masked_loss_matches_numpy_float64_and_masked_grads_are_exactly_zero(dtype, with_prox):
    lp, beh, adv, prox, mask, as_t = _masked_batch(dtype)
    assert 0 < mask.sum() < mask.size
    x = as_t(lp).requires_grad_(True)
    loss, stats = ppo_clip_loss(
        x, as_t(beh), as_t(adv), torch.as_tensor(mask),
        clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_cap=CAP,
        proximal_logprobs=as_t(prox) if with_prox else None,
    )  # fmt: skip
    loss.backward()
    want_loss, want_grad, want_clipped = _numpy_reference(
        x.detach().numpy(), as_t(beh).numpy(), as_t(adv).numpy(),
        as_t(prox if with_prox else beh).numpy(), mask,
    )  # fmt: skip
    grad = x.grad.numpy()
    masked, trained = mask == 0, mask == 1
    assert np.all(grad[masked] == 0.0)  # exactly, not approximately
    assert np.count_nonzero(grad[trained]) == trained.sum() - want_clipped > 0
    assert int(stats.clipped_tokens) == want_clipped
    # relative errors measured over 20 seeds: float64 1.0e-15 (loss) and 4e-16 (gradient);
    # float32 5.0e-7 (the loss, a sum with cancellation) and 1.6e-7 (gradient)
    loss_rtol, grad_rtol = (3e-15, 1.2e-15) if dtype == torch.float64 else (1.5e-6, 5e-7)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=loss_rtol)
    np.testing.assert_allclose(grad, want_grad, rtol=grad_rtol, atol=0)
    assert math.isfinite(float(stats.is_weight_sum)) and math.isfinite(
        float(stats.abs_logprob_diff_sum)
    )


def test_masked_placeholders_change_nothing_bit_for_bit():
    """The same tokens with other placeholders at the masked positions (0.0 instead of
    +-1e30): the loss, its gradient and the stats are identical, bit for bit."""
    lp, beh, adv, prox, mask, as_t = _masked_batch(torch.float32)
    calm = [np.where(mask == 1, a, 0.0) for a in (beh, adv, prox)]
    out = []
    for b, a, p in ((beh, adv, prox), calm):
        x = as_t(lp).requires_grad_(True)
        loss, stats = ppo_clip_loss(
            x, as_t(b), as_t(a), torch.as_tensor(mask), clip_eps_low=EPS_LOW,
            clip_eps_high=EPS_HIGH, is_cap=CAP, proximal_logprobs=as_t(p),
        )  # fmt: skip
        loss.backward()
        out.append((float(loss.detach()), x.grad.clone(), float(stats.is_weight_sum),
                    float(stats.abs_logprob_diff_sum), int(stats.clipped_tokens)))  # fmt: skip
    (l1, g1, *s1), (l2, g2, *s2) = out
    assert l1 == l2 and torch.equal(g1, g2) and s1 == s2


def test_gradcheck_against_finite_differences():
    gen = torch.Generator().manual_seed(0)
    n = 12
    lp = (-torch.rand(n, generator=gen, dtype=F64) * 3).requires_grad_(True)
    beh = lp.detach() + torch.randn(n, generator=gen, dtype=F64) * 0.4
    prox = lp.detach() + torch.randn(n, generator=gen, dtype=F64) * 0.4
    adv = torch.randn(n, generator=gen, dtype=F64)
    mask = torch.rand(n, generator=gen) > 0.2

    def f(x, proximal):
        return ppo_clip_loss(
            x, beh, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_cap=CAP,
            proximal_logprobs=proximal,
        )[0]

    # the loss is piecewise smooth; these random points are away from the kinks
    assert torch.autograd.gradcheck(lambda x: f(x, None), (lp,))
    assert torch.autograd.gradcheck(lambda x: f(x, prox), (lp,))


def test_float32_inputs_give_float32_loss():
    lp = torch.tensor([-1.0, -0.5], requires_grad=True)
    loss, _ = ppo_clip_loss(
        lp, torch.tensor([-1.1, -1.0]), torch.tensor([1.0, 2.0]), torch.ones(2),
        clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_cap=CAP,
    )
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(
        _hand_token(-1.0, -1.1, 1.0, None)[0] + _hand_token(-0.5, -1.0, 2.0, None)[0], rel=1e-6
    )


# --------------------------------------------------------------------------- packing helpers
def _packed():
    seq_lens = np.array([5, 3, 4], dtype=np.int32)
    prompt_lens = np.array([2, 3, 1], dtype=np.int32)  # the second has no response token
    tokens = np.array([1, 7, 8, 9, 2, 1, 4, 5, 1, 6, 6, 2], dtype=np.int32)
    return tokens, seq_lens, prompt_lens


def test_micro_batch_layout_and_response_positions():
    tokens, seq_lens, prompt_lens = _packed()
    assert micro_batch_bounds(3, 2) == [(0, 2), (2, 3)]
    assert micro_batch_bounds(0, 2) == []
    mb = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 2, device=torch.device("cpu"), pad_id=0)
    assert mb.input_ids.tolist() == [[1, 7, 8, 9, 2], [1, 4, 5, 0, 0]]
    # response tokens of sequence 0 are positions 2, 3, 4, predicted from positions 1, 2, 3
    assert mb.rows.tolist() == [0, 0, 0]
    assert mb.cols.tolist() == [1, 2, 3]
    assert mb.targets.tolist() == [8, 9, 2]
    assert mb.response_slice == slice(0, 3)
    assert np.bincount(mb.rows.numpy(), minlength=2).tolist() == [3, 0]  # per sequence
    assert mb.window == (1, 4)  # the positions whose logits predict a response token
    mb2 = make_micro_batch(tokens, seq_lens, prompt_lens, 2, 3, device=torch.device("cpu"))
    assert mb2.input_ids.tolist() == [[1, 6, 6, 2]]
    assert mb2.cols.tolist() == [0, 1, 2] and mb2.targets.tolist() == [6, 6, 2]
    assert mb2.response_slice == slice(3, 6)
    assert mb2.window == (0, 3)
    dummy = dummy_micro_batch(device=torch.device("cpu"))
    assert dummy.input_ids.shape == (1, 2) and len(dummy.targets) == 1
    assert dummy.response_slice == slice(0, 0)


def test_response_logprobs_match_per_position_log_softmax():
    tokens, seq_lens, prompt_lens = _packed()
    mb = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 3, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 10, generator=gen, dtype=F64)
    temperature = 0.7
    got = response_logprobs(logits, mb, temperature)
    want = []
    offset = 0
    for i in range(3):
        seq = tokens[offset : offset + seq_lens[i]]
        offset += seq_lens[i]
        for p in range(prompt_lens[i], seq_lens[i]):
            row = logits[i, p - 1] / temperature
            want.append(row[seq[p]].item() - math.log(sum(math.exp(v) for v in row.tolist())))
    assert got.dtype == F64
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert response_logprobs(logits.float(), mb, temperature).dtype == torch.float32


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, s, p, b, a: (t[:-1], s, p, b, a), "sum(seq_lens)"),
        (lambda t, s, p, b, a: (t, s, np.array([0, 3, 1], np.int32), b, a), "prompt_len"),
        (lambda t, s, p, b, a: (t, s, np.array([2, 4, 1], np.int32), b, a), "prompt_len"),
        (lambda t, s, p, b, a: (t * 0 + 99, s, p, b, a), "token ids"),
        (lambda t, s, p, b, a: (t, s, p, b[:-1], a), "behaviour_logprobs"),
        (lambda t, s, p, b, a: (t, s, p, b, a[:2]), "advantages"),
        (lambda t, s, p, b, a: (t, s, p, b * np.nan, a), "non-finite"),
    ],
)
def test_check_packed_names_the_problem(change, message):
    tokens, seq_lens, prompt_lens = _packed()
    beh = np.zeros(6, np.float32)
    adv = np.zeros(3, np.float32)
    assert check_packed(
        tokens, seq_lens, prompt_lens, vocab_size=10,
        per_token={"behaviour_logprobs": beh}, per_sequence={"advantages": adv},
    ) is None
    t, s, p, b, a = change(tokens, seq_lens, prompt_lens, beh, adv)
    problem = check_packed(
        t, s, p, vocab_size=10, per_token={"behaviour_logprobs": b}, per_sequence={"advantages": a}
    )
    assert problem is not None and message in problem


@pytest.mark.parametrize(
    "mask, message",
    [
        (np.ones(5, np.uint8), "loss_mask has shape (5,); expected one value per response token"),
        (np.ones(6, np.float32), "loss_mask has dtype float32; expected uint8"),
        (np.ones(6, np.bool_), "loss_mask has dtype bool; expected uint8"),
        (np.array([1, 0, 2, 1, 1, 1], np.uint8), "loss_mask holds 2; expected only 0"),
    ],
)
def test_check_packed_refuses_a_bad_loss_mask(mask, message):
    tokens, seq_lens, prompt_lens = _packed()
    problem = check_packed(tokens, seq_lens, prompt_lens, loss_mask=mask)
    assert problem is not None and message in problem, problem


def test_check_packed_accepts_masks_that_train_some_or_no_token():
    tokens, seq_lens, prompt_lens = _packed()
    for mask in ([1] * 6, [0, 1, 1, 0, 0, 1], [0] * 6):
        mask = np.array(mask, np.uint8)
        assert check_packed(tokens, seq_lens, prompt_lens, loss_mask=mask) is None
