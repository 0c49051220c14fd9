"""Supervised warm start of the tiny model, and the calibration helpers.

The warm start trains on train-split problems only, with the loss on the answer tokens and
EOS (the prompt is context), in one process on the CPU: phase 1 on correct answers until a
target greedy accuracy, phase 2 on a sloppy teacher's answers (see :class:`SFTSettings`). It
is seeded: the same settings and thread count give the same weights.

:func:`evaluate_greedy` and :func:`pass_at_k` measure a policy with plain transformers (no
vLLM), tokenizing and decoding exactly as the controller does: ``tokenizer.json`` encodes the
prompt (BOS prepended), generation stops at EOS, and the completion text is decoded without
EOS and handed to ``env.score``. They exist to calibrate the demo (greedy accuracy low,
pass@k high: the gap is what GRPO learns from), not to replace the controller's evaluation.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.plugin.environment import Environment, Prompt

from .model import EOS_ID, PAD_ID

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

__all__ = [
    "PassAtK",
    "SFTResult",
    "SFTSettings",
    "answer_loss",
    "encode_example",
    "evaluate_greedy",
    "forgot_carry",
    "load_policy",
    "load_tokenizer",
    "pass_at_k",
    "train_sft",
]

IGNORE = -100


@dataclass(frozen=True)
class SFTSettings:
    """The warm-start recipe. The defaults are the calibrated demo recipe (docs/demo-task.md).

    Phase 1 imitates correct answers. The tiny model learns the carry abruptly (a loss
    plateau, then greedy accuracy climbs from ~10% to ~90% within ~150 steps) and *when*
    that happens moves by 100+ steps with the seed, so phase 1 stops as soon as greedy
    accuracy on a slice of the *train* split reaches ``target_train_acc`` instead of after
    a fixed step count.

    Phase 2 imitates a sloppy teacher who forgets the units carry on ``slip_rate`` of the
    problems that have one. The policy then prefers the carry-less answer on carry problems
    (greedy gets them wrong) while still sampling the right one: the gap between greedy
    accuracy and pass@8 that GRPO closes within a few dozen steps. Without phase 2 the
    errors are the model's own missing skill, which 30 GRPO steps barely move (measured in
    docs/demo-task.md).
    """

    max_steps: int = 1200
    """Optimizer steps at most; also the cosine schedule's horizon. (600 ran out before the
    target on two of three machine kinds; with 1200 the shipped build reached it at step 600.)"""
    batch_size: int = 128
    """Problems per step, drawn from the train split in seeded shuffled epochs. (At 64 the
    plateau lasts far longer: 1000 steps gave 8.5% greedy accuracy.)"""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, then cosine decay to 10% at ``max_steps``)."""
    warmup_steps: int = 20
    """Linear warm-up length."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    target_train_acc: float = 0.7
    """Phase 1 stops once greedy accuracy on the first ``check_prompts`` train prompts reaches this
    (checked every ``check_every`` steps); 0 disables the check and runs ``max_steps``."""
    check_every: int = 25
    """Steps between accuracy checks."""
    check_prompts: int = 200
    """Train prompts greedily decoded at each check."""
    slip_steps: int = 60
    """Phase 2: steps imitating the sloppy teacher after phase 1 (0 = no phase 2)."""
    slip_rate: float = 0.75
    """Phase 2: chance that the teacher forgets the units carry/borrow on a problem that
    has one (see :func:`forgot_carry`); other problems are answered correctly."""
    slip_lr: float = 1e-3
    """Phase 2: constant learning rate."""
    max_new_tokens: int = 8
    """Generation limit of the checks."""
    seed: int = 0
    """Seed of the data order (the initial weights come from ``build_model``'s seed)."""
    threads: int = 1
    """``torch.set_num_threads`` for the run."""


@dataclass(frozen=True)
class SFTResult:
    losses: list[float]
    """Mean token loss of each step's batch (answer tokens + EOS)."""
    seconds: float
    """Wall time of the loop, checks included (model load and save excluded)."""
    checks: list[tuple[int, float]]
    """``(step, greedy train accuracy)`` at each check."""
    reached_target: bool
    """Whether phase 1 stopped on ``target_train_acc`` (rather than on ``max_steps``)."""
    phase1_steps: int
    """Steps of phase 1 (correct answers); the rest imitated the sloppy teacher."""

    @property
    def steps(self) -> int:
        return len(self.losses)


@dataclass(frozen=True)
class PassAtK:
    """What :func:`pass_at_k` measured."""

    k: int
    pass_at_k: float
    """Fraction of prompts with at least one correct sample among k."""
    mean_reward: float
    """Fraction of all samples that are correct (the expected reward at this temperature)."""
    mixed_groups: float
    """Fraction of prompts whose k samples are neither all right nor all wrong: the groups
    that give GRPO a non-zero advantage."""


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The raw ``tokenizers`` tokenizer the controller uses."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def load_policy(model_dir: str | Path, dtype: str = "float32") -> Any:
    """Load the model in eval mode (``dtype`` ``"bfloat16"`` approximates the generators)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.eval()


def encode_example(
    tok: Tokenizer, prompt: Prompt, answer: str | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` for one problem: BOS + prompt + answer + EOS, labels masked on
    BOS + prompt so only the answer and EOS are learned. ``answer`` defaults to the right one."""
    prompt_ids = tok.encode(prompt.text).ids
    target = str(prompt.answer) if answer is None else answer
    answer_ids = tok.encode(target, add_special_tokens=False).ids
    ids = prompt_ids + answer_ids + [EOS_ID]
    labels = [IGNORE] * len(prompt_ids) + answer_ids + [EOS_ID]
    return ids, labels


def _collate(batch: Sequence[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return ids, labels, mask


def _token_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def answer_loss(model: Any, tok: Tokenizer, prompts: Sequence[Prompt]) -> float:
    """Mean cross-entropy per answer/EOS token over ``prompts`` (no gradient)."""
    import torch

    ids, labels, mask = _collate([encode_example(tok, p) for p in prompts])
    with torch.no_grad():
        return float(_token_loss(model, ids, labels, mask))


_PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)=$")


def forgot_carry(prompt: Prompt) -> str | None:
    """The sloppy teacher's answer: ``a + b`` without the units carry (``38+45=`` -> ``73``),
    ``a - b`` without the units borrow (``52-18=`` -> ``44``); ``None`` when the problem
    has no carry/borrow (or is a product), so the teacher cannot get it wrong this way."""
    m = _PROBLEM.match(prompt.text)
    if m is None:
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    if op == "+" and a % 10 + b % 10 >= 10:
        return str(a + b - 10)
    if op == "-" and a >= b and a % 10 < b % 10:
        return str(a - b + 10)
    return None


class _Batches:
    """Seeded shuffled epochs over the train split; each draw asks the teacher for targets."""

    def __init__(self, tok: Tokenizer, prompts: Sequence[Prompt], seed: int) -> None:
        self._tok = tok
        self._prompts = list(prompts)
        self._clean = [encode_example(tok, p) for p in self._prompts]
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def draw(self, size: int, slip_rate: float = 0.0) -> list[tuple[list[int], list[int]]]:
        while len(self._order) < size:
            epoch = list(range(len(self._prompts)))
            self._rng.shuffle(epoch)
            self._order.extend(epoch)
        picked, self._order = self._order[:size], self._order[size:]
        out = []
        for i in picked:
            slipped = forgot_carry(self._prompts[i]) if slip_rate > 0 else None
            if slipped is not None and self._rng.random() < slip_rate:
                out.append(encode_example(self._tok, self._prompts[i], slipped))
            else:
                out.append(self._clean[i])
        return out


def _step(model: Any, opt: Any, batch: Sequence[tuple[list[int], list[int]]], lr: float) -> float:
    import torch

    for group in opt.param_groups:
        group["lr"] = lr
    loss = _token_loss(model, *_collate(batch))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def train_sft(
    model_dir: str | Path,
    env: Environment,
    settings: SFTSettings = SFTSettings(),
    *,
    out_dir: str | Path | None = None,
    on_step: Callable[[int, Any, float], None] | None = None,
) -> SFTResult:
    """Warm-start the model in ``model_dir`` on ``env``'s train split and save it.

    Phase 1 learns from correct answers until greedy train accuracy reaches
    ``target_train_acc`` (or ``max_steps``); phase 2 (``slip_steps > 0``) then imitates the
    sloppy teacher for ``slip_steps`` more steps.

    Args:
        model_dir: a directory written by :func:`asyncrl_arith.model.build_model`.
        env: the environment; only ``dataset("train")`` is read.
        settings: the recipe.
        out_dir: where to save (model + tokenizer files); ``model_dir`` when ``None``.
        on_step: called as ``on_step(step, model, loss)`` after each optimizer step (for
            calibration curves; the model is in train mode and must be left so).
    """
    import torch

    cfg = settings
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(model_dir)
    model = load_policy(model_dir).train()
    train = list(env.dataset("train"))
    batches = _Batches(tok, train, cfg.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98)
    )
    step_hook = on_step or (lambda step, model, loss: None)

    start = time.perf_counter()
    losses: list[float] = []
    checks: list[tuple[int, float]] = []
    reached = False
    for step in range(1, cfg.max_steps + 1):
        losses.append(_step(model, opt, batches.draw(cfg.batch_size), _lr_at(cfg, step - 1)))
        step_hook(step, model, losses[-1])
        if cfg.target_train_acc > 0 and step % cfg.check_every == 0:
            acc = _greedy_accuracy(
                model.eval(), tok, env, train[: cfg.check_prompts], cfg.max_new_tokens
            )
            model.train()
            checks.append((step, acc))
            if reached := acc >= cfg.target_train_acc:
                break
    phase1 = len(losses)
    for step in range(phase1 + 1, phase1 + cfg.slip_steps + 1):
        losses.append(_step(model, opt, batches.draw(cfg.batch_size, cfg.slip_rate), cfg.slip_lr))
        step_hook(step, model, losses[-1])
    seconds = time.perf_counter() - start

    _save(model, Path(model_dir), Path(out_dir) if out_dir is not None else Path(model_dir))
    return SFTResult(
        losses=losses, seconds=seconds, checks=checks, reached_target=reached, phase1_steps=phase1
    )


def _lr_at(cfg: SFTSettings, step: int) -> float:
    """Phase 1: linear warm-up, then cosine decay to 10% at ``max_steps`` (a constant rate
    left two of four seeds on the loss plateau for 500 steps)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def _save(model: Any, model_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    if out != model_dir:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            src = model_dir / name
            if src.exists():
                (out / name).write_bytes(src.read_bytes())


def _generate(
    model: Any,
    tok: Tokenizer,
    prompts: Sequence[Prompt],
    *,
    num_samples: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_prompts: int = 64,
) -> list[list[str]]:
    """``num_samples`` completions per prompt (greedy when ``temperature == 0``), decoded
    as the controller decodes them: the tokens before EOS."""
    import torch

    encoded = [tok.encode(p.text).ids for p in prompts]
    # group equal lengths so no padding (and no left-padding subtleties) is involved
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[list[str]] = [[] for _ in prompts]
    gen = torch.Generator().manual_seed(seed)
    for length in sorted(by_len):
        idx = by_len[length]
        for s in range(0, len(idx), batch_prompts):
            chunk = idx[s : s + batch_prompts]
            ids = torch.tensor([encoded[i] for i in chunk]).repeat_interleave(num_samples, 0)
            new = _decode_loop(model, ids, temperature, max_new_tokens, gen)
            for row, i in enumerate(chunk):
                for j in range(num_samples):
                    toks = new[row * num_samples + j].tolist()
                    if EOS_ID in toks:
                        toks = toks[: toks.index(EOS_ID)]
                    out[i].append(tok.decode(toks, skip_special_tokens=True))
    return out


def _decode_loop(
    model: Any, ids: torch.Tensor, temperature: float, max_new_tokens: int, gen: torch.Generator
) -> torch.Tensor:
    """Plain sampling (no top-k/top-p) with a KV cache; the same rule vLLM applies at
    ``top_k=-1, top_p=1``. Rows that emitted EOS keep emitting EOS."""
    import torch

    new = torch.full((ids.shape[0], max_new_tokens), EOS_ID, dtype=torch.long)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    past = None
    step_in = ids
    with torch.no_grad():
        for t in range(max_new_tokens):
            res = model(input_ids=step_in, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
            new[:, t] = nxt
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
            step_in = nxt[:, None]
    return new


def _policy_and_tok(model_or_dir: Any, dtype: str) -> tuple[Any, Tokenizer]:
    if isinstance(model_or_dir, str | Path):
        return load_policy(model_or_dir, dtype), load_tokenizer(model_or_dir)
    model, tok = model_or_dir
    return model, tok


def evaluate_greedy(
    model_dir: str | Path | tuple[Any, Tokenizer],
    env: Environment,
    n: int = 200,
    *,
    split: str = "eval",
    max_new_tokens: int = 8,
    dtype: str = "float32",
) -> float:
    """Greedy accuracy on the first ``n`` prompts of ``split``.

    Args:
        model_dir: a model directory, or an already loaded ``(model, tokenizer)`` pair.
        env: scores the completions.
        n: how many prompts (fewer if the split is smaller).
        split: ``"eval"`` (held out) or ``"train"``.
        max_new_tokens: generation limit, as in the RL config.
        dtype: ``"float32"`` or ``"bfloat16"`` when loading from a directory.
    """
    model, tok = _policy_and_tok(model_dir, dtype)
    prompts = list(env.dataset(split))[:n]  # type: ignore[arg-type]
    return _greedy_accuracy(model, tok, env, prompts, max_new_tokens)


def _greedy_accuracy(
    model: Any, tok: Tokenizer, env: Environment, prompts: Sequence[Prompt], max_new_tokens: int
) -> float:
    texts = _generate(
        model, tok, prompts, num_samples=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=0
    )
    return sum(env.score(p, t[0]).correct for p, t in zip(prompts, texts)) / len(prompts)


def pass_at_k(
    model_dir: str | Path | tuple[Any, Tokenizer],
    env: Environment,
    n: int = 100,
    k: int = 8,
    *,
    temperature: float = 1.0,
    split: str = "eval",
    max_new_tokens: int = 8,
    seed: int = 0,
    dtype: str = "float32",
) -> PassAtK:
    """Sample ``k`` completions for each of the first ``n`` prompts of ``split`` at
    ``temperature`` and report pass@k, the mean reward and the share of mixed groups."""
    model, tok = _policy_and_tok(model_dir, dtype)
    prompts = list(env.dataset(split))[:n]  # type: ignore[arg-type]
    texts = _generate(
        model,
        tok,
        prompts,
        num_samples=k,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    right = [sum(env.score(p, t).correct for t in ts) for p, ts in zip(prompts, texts)]
    return PassAtK(
        k=k,
        pass_at_k=sum(r > 0 for r in right) / len(prompts),
        mean_reward=sum(right) / (k * len(prompts)),
        mixed_groups=sum(0 < r < k for r in right) / len(prompts),
    )
