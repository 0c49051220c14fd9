"""The loss's off-policy corrections and GSPO's sequence ratio (asyncrl_torch.loss) against
float64 implementations written here token by token from the formulas (IcePop's double-sided
mask; a sequence mask on the geometric mean of the trainer/generator ratio; GSPO, Zheng et
al. 2025: s_i = exp(mean_t log(pi/pi_old)), eq. 7), and gradient checks: torch's gradcheck
of the token-level corrections, and GSPO's gradient against finite differences of its
sequence-level objective."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from asyncrl_torch.loss import ppo_clip_loss  # noqa: E402

LOW, HIGH, CAP, E_LOW, E_HIGH = 0.6, 1.5, 2.0, 0.2, 0.28
F64 = torch.float64


def clip(x: float) -> float:
    return min(max(x, 1 - E_LOW), 1 + E_HIGH)


def reference(lp, beh, prox, adv, mask, seqs, correction, level):
    """(loss_sum, d loss / d lp per token, tokens masked by the correction), in plain Python."""
    trained = [t for t in range(len(lp)) if mask[t]]
    by_seq: dict[int, list[int]] = {}
    for t in trained:
        by_seq.setdefault(seqs[t], []).append(t)
    s = {i: math.exp(sum(lp[t] - prox[t] for t in ts) / len(ts)) for i, ts in by_seq.items()}
    geo = {i: math.exp(sum(prox[t] - beh[t] for t in ts) / len(ts)) for i, ts in by_seq.items()}
    loss, grad, masked = 0.0, [0.0] * len(lp), 0
    for t in trained:
        rho = math.exp(prox[t] - beh[t])
        if correction == "tis":
            w = min(rho, CAP)
        elif correction == "none":
            w = 1.0
        elif correction == "token_mask":
            w = rho if LOW <= rho <= HIGH else 0.0
        else:  # sequence_mask
            w = min(rho, CAP) if LOW <= geo[seqs[t]] <= HIGH else 0.0
        masked += correction in ("token_mask", "sequence_mask") and w == 0.0
        r = s[seqs[t]] if level == "sequence" else math.exp(lp[t] - prox[t])
        a = adv[t]
        if r * a <= clip(r) * a:  # the unclipped term is the min: the gradient flows
            loss -= w * r * a
            grad[t] = -w * a * r  # d r / d lp_t = r (token), = s_i (GSPO-token)
        else:
            loss -= w * clip(r) * a
    return loss, grad, masked


def random_batch(rng: random.Random, n_seqs: int):
    lp, beh, prox, adv, mask, seqs = [], [], [], [], [], []
    for i in range(n_seqs):
        a = rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 2.0)
        for _ in range(rng.randint(1, 6)):
            b = -rng.uniform(0.05, 4.0)
            p = b + rng.gauss(0, 0.4)  # the trainer's own: near the generator's
            lp.append(p + rng.gauss(0, 0.2))
            beh.append(b)
            prox.append(p)
            adv.append(a)
            mask.append(rng.random() < 0.85)
            seqs.append(10 * i + 3)  # any labels, equal within a sequence
    return lp, beh, prox, adv, mask, seqs


def run(batch, correction, level, proximal=True):
    lp, beh, prox, adv, mask, seqs = batch
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    loss, stats = ppo_clip_loss(
        x, torch.tensor(beh, dtype=F64), torch.tensor(adv, dtype=F64), torch.tensor(mask),
        clip_eps_low=E_LOW, clip_eps_high=E_HIGH, is_cap=CAP,
        proximal_logprobs=torch.tensor(prox, dtype=F64) if proximal else None,
        correction=correction, mismatch_low=LOW, mismatch_high=HIGH, ratio_level=level,
        seq_ids=torch.tensor(seqs),
    )  # fmt: skip
    loss.backward()
    return loss.item(), x.grad.tolist(), stats


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", ["tis", "token_mask", "sequence_mask", "none"])
def test_random_batches_against_the_reference(correction: str, level: str) -> None:
    """300 random batches each: loss, gradient and masked-token count. float64 against
    float64: the largest differences measured over all eight were 7.3e-14 (relative, loss)
    and 1.3e-15 (absolute, gradient)."""
    rng = random.Random(f"{correction}-{level}")
    masked_any = 0
    for _ in range(300):
        batch = random_batch(rng, rng.randint(1, 6))
        loss, grad, stats = run(batch, correction, level)
        want_loss, want_grad, want_masked = reference(*batch, correction, level)
        assert loss == pytest.approx(want_loss, rel=2e-13, abs=1e-15)
        assert grad == pytest.approx(want_grad, abs=4e-15)
        if stats.masked_tokens is not None:
            assert int(stats.masked_tokens) == want_masked
            masked_any += want_masked
    if correction in ("token_mask", "sequence_mask"):
        assert masked_any > 0  # the band was reached: the masks were exercised


@pytest.mark.parametrize("correction", ["token_mask", "sequence_mask"])
def test_without_a_proximal_policy_the_masks_change_nothing(correction: str) -> None:
    """rho is 1 when the proximal policy is the behaviour one: nothing is masked."""
    batch = random_batch(random.Random(5), 4)
    loss, grad, stats = run(batch, correction, "token", proximal=False)
    base_loss, base_grad, _ = run(batch, "tis", "token", proximal=False)
    assert int(stats.masked_tokens) == 0
    assert loss == base_loss and grad == base_grad


@pytest.mark.parametrize("correction", ["tis", "token_mask"])
def test_gradcheck_of_the_token_level_corrections(correction: str) -> None:
    """torch's finite-difference gradient check (the weights depend on the proximal and
    behaviour logprobs only, so the loss is smooth in lp away from the clip's corners: the
    points are kept inside the clip band)."""
    rng = random.Random(11)
    n = 12
    beh = torch.tensor([-rng.uniform(0.5, 3) for _ in range(n)], dtype=F64)
    prox = beh + torch.tensor([rng.uniform(-0.7, 0.7) for _ in range(n)], dtype=F64)
    adv = torch.tensor([rng.choice([-1.0, 1.0]) for _ in range(n)], dtype=F64)
    lp = (prox + torch.tensor([rng.uniform(-0.1, 0.1) for _ in range(n)], dtype=F64))
    mask = torch.tensor([i % 5 != 2 for i in range(n)])

    def f(x: torch.Tensor) -> torch.Tensor:
        loss, _ = ppo_clip_loss(x, beh, adv, mask, clip_eps_low=E_LOW, clip_eps_high=E_HIGH,
                                is_cap=CAP, proximal_logprobs=prox, correction=correction,  # type: ignore[arg-type]
                                mismatch_low=LOW, mismatch_high=HIGH)  # fmt: skip
        return loss

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-6, atol=1e-8)


def test_gspo_gradient_against_finite_differences_of_its_sequence_objective() -> None:
    """GSPO's objective per sequence, J_i = -min(s_i A_i, clip(s_i) A_i) with s_i the
    geometric-mean ratio (written here from the paper, as a function of lp); its tokens'
    loss sum is |y_i| J_i, and the gradient the loss gives each token is the derivative of
    |y_i| J_i (GSPO-token's stop-gradients make the value and the gradient agree), checked
    by central differences."""
    rng = random.Random(3)
    lp, beh, prox, adv, mask, seqs = random_batch(rng, 5)
    mask = [True] * len(lp)
    lengths = {i: seqs.count(i) for i in set(seqs)}

    def objective(x: list[float]) -> float:
        total = 0.0
        for i, n in lengths.items():
            ts = [t for t in range(len(x)) if seqs[t] == i]
            s = math.exp(sum(x[t] - prox[t] for t in ts) / n)
            a = adv[ts[0]]
            total += n * -min(s * a, clip(s) * a)
        return total

    _, grad, _ = run((lp, beh, prox, adv, mask, seqs), "none", "sequence")
    h = 1e-6
    for t in range(len(lp)):
        up, down = list(lp), list(lp)
        up[t] += h
        down[t] -= h
        numeric = (objective(up) - objective(down)) / (2 * h)
        assert grad[t] == pytest.approx(numeric, abs=3.5e-9), t  # measured: 1.2e-9


def test_the_mismatch_stats_against_the_reference() -> None:
    """max |lp - behaviour| and k3 = exp(d) - 1 - d summed over trained tokens (KL(generator ||
    trainer) estimated on the generator's samples), masked tokens left out."""
    lp, beh, prox, adv, mask, seqs = random_batch(random.Random(9), 6)
    _, _, stats = run((lp, beh, prox, adv, mask, seqs), "tis", "token")
    d = [lp[t] - beh[t] for t in range(len(lp)) if mask[t]]
    assert float(stats.abs_logprob_diff_max) == max(abs(x) for x in d)
    assert float(stats.mismatch_k3_sum) == pytest.approx(math.fsum(math.expm1(x) - x for x in d), rel=1e-14)


def test_masking_needs_the_trainers_own_proximal(tmp_path) -> None:
    """The config's side; the bigram engine's refusal of the rest is the example backend's
    (tests/unit/test_bigram_backend.py)."""
    from asyncrl.config import from_dict
    from asyncrl.errors import ConfigError
    from asyncrl_torch.options import TrainerOptions, parse_options

    (tmp_path / "config.json").write_text('{"vocab_size": 8}')
    (tmp_path / "tokenizer.json").write_text("{}")

    def cfg(loss: dict, **more: dict):
        return from_dict({"model": {"path": str(tmp_path)}, "environment": {"name": "repeat-digit"},
                          "loss": loss, **more})  # fmt: skip

    with pytest.raises(ConfigError, match="loss.proximal_policy = \"current\""):
        cfg({"correction": "token_mask"})
    cfg({"correction": "token_mask", "proximal_policy": "current"})
    cfg({"ratio_level": "sequence"})  # GSPO: either proximal
    # the option's old home says where it went, with the value to set
    with pytest.raises(ConfigError, match="moved to \\[loss\\].*loss.proximal_policy = 'current'"):
        parse_options({"proximal_policy": "current"}, TrainerOptions, "docs")
    with pytest.raises(ConfigError, match="loss.mismatch_low"):
        cfg({"mismatch_low": 1.2})
