"""The training-backend contract suite: run it against your backend with a few lines of pytest.

::

    from asyncrl_torch.contract.suite import TrainingBackendContract

    class TestMyBackend(TrainingBackendContract):
        backend = "my-backend"      # the asyncrl.training_backends entry-point name
        world_size = 2              # ranks, started with torchrun (gloo on CPU)
        options = {"my_knob": 3}    # extra [trainer.options]

The suite builds a tiny random Qwen2 model, runs the backend under ``torchrun`` through
:mod:`asyncrl_torch.contract.rank` (the scenario is in its docstring), and compares what the
ranks saw with an independent single-process **float64** reference written here: plain
transformers, one sequence per forward, the same loss written out token by token, the
gradient clipped by hand and AdamW applied by hand. It checks that

- logprobs equal the reference forward, also with uneven and empty shards;
- loss and grad norm of a step streamed as three uneven chunks (some ranks empty) equal one
  big batch of the reference (grad norm within 1e-4 relative: an engine that averages over
  ranks or accumulation steps once too often is off by 2x and fails);
- the updated weights equal the reference's AdamW step;
- the same step sent as one chunk gives the same weights as the streamed one;
- a step discarded by a wrong token count leaves no gradient behind;
- a batch malformed on one rank only makes every rank raise (none hangs in a collective),
  and the open step stays usable;
- exported weights (``iter_weights``) equal the model's, and ``weight_specs`` lists them;
- save -> load -> step equals step, in the same processes and in fresh ones;
- with ``state_to_host`` and ``state_to_device`` (:class:`~asyncrl.plugin.backend.StateOffload`):
  a step after the state went to the host and back, or after a checkpoint saved while it was
  there, equals the step without, bit for bit; the weights stay meanwhile (export, logprobs);
  on CUDA the device memory drops by what ``state_to_host`` reports, at least the AdamW
  moments; an open step is refused;
- the ``loss_mask``: a step whose mask leaves tokens out (a whole sequence, runs inside
  others; a chunk that trains nothing) equals the reference's step over the trained tokens
  alone, normalized by their count, and ``num_loss_tokens`` is that count; the same step with
  huge placeholder behaviour logprobs and advantages where nothing trains gives the same
  result and weights. Every other step sends a mask of all ones, against the unmasked
  reference: a mask of all ones is the step without a mask;
- with ``lora`` set (``[lora]``): all of the above for the adapter alone, against the LoRA
  math in float64 (from an adapter whose ``lora_A`` and ``lora_B`` are both random), the export
  a PEFT directory that PEFT loads, and a base that gets no gradient and keeps its bits.

The backend must accept the shared hyperparameter names of
:class:`asyncrl_torch.options.TrainerOptions` (``lr``, ``betas``, ``eps``, ``weight_decay``,
``max_grad_norm``, ``attn_implementation``, ``num_threads``); override
:meth:`TrainingBackendContract.backend_options` to map them onto other names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from asyncrl_torch.contract.rank import (
    FULLY_MASKED,
    MASKED_CHUNKS,
    NUM_SEQUENCES,
    STEP0_CHUNKS,
    STEP1,
    contract_loss_mask,
    contract_sequences,
    launch_ranks,
    num_tokens,
    shard_chunk,
)

__all__ = [
    "ContractRun", "Reference", "TrainingBackendContract", "build_tiny_qwen2", "write_adapter",
]

HYPERPARAMETERS: dict[str, Any] = {
    "lr": 2e-3,
    "betas": [0.9, 0.999],
    "eps": 1e-3,  # well above float32 gradient noise: the update stays well conditioned
    "weight_decay": 0.01,
    "max_grad_norm": 0.5,  # below the grad norm (~1.5): the clip is active
    "attn_implementation": "eager",
    "num_threads": 1,
}
LOSS = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "is_cap": 2.0}
TEMPERATURE = 0.7
MICRO_BATCH_SIZE = 2

# Tolerances: about 3x the largest error measured over fsdp2 (1, 2 ranks) and deepspeed
# ZeRO-2/3 (1, 2 ranks) on CPU, float32 against the float64 reference. A backend of another
# numerical make may loosen them per class (see TrainingBackendContract), never the grad norm
# beyond the 1e-4 that the suite promises.
LOGPROB_ATOL = 1e-6  # measured 3.3e-7
LOSS_RTOL = 5e-7  # measured 1.5e-7
GRAD_NORM_RTOL = 5e-7  # measured 1.6e-7; a rank-averaging or accumulation bug is off by 2x
# Weights after one and two AdamW steps (each moves a weight by up to lr = 2e-3; eps = 1e-3
# keeps the update well conditioned where a gradient entry is near zero): measured 1.5e-7.
WEIGHT_ATOL = 5e-7
# Two float32 runs of the same step that differ only in chunking or in where the state came
# from (summation order only): measured 7.5e-9 on CPU and 1.2e-7 on an H200 (one float32 ulp
# of a layer-norm weight near 1); 0 after save/load on both.
SAME_ATOL = 4e-7
GRAD_NORM_RTOL_CEILING = 1e-4
OFFLOAD_SLACK_BYTES = 64 << 10
"""How far the device memory ``state_to_host`` frees may fall short of what it reports
(allocations of its own while it runs)."""


def build_tiny_qwen2(path: Path, *, seed: int = 0) -> Path:
    """A random tiny Qwen2 causal LM (tied embeddings, 2 layers, vocab 48) at ``path``, with a
    word-level ``tokenizer.json`` of the same vocabulary (a run config requires one)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


ADAPTER_PREFIX = "base_model.model."
"""PEFT's saved names of an adapter's tensors start with it, then the module's path."""


def write_adapter(
    model_dir: Path, out: Path, lora: dict[str, Any], *, seed: int = 1
) -> Path:
    """A PEFT LoRA adapter at ``out`` for the model at ``model_dir`` with ``lora``'s rank,
    alpha and target modules, and random ``lora_A`` *and* ``lora_B`` (float32): unlike a fresh
    adapter (``lora_B`` zero), both get a gradient from the first step."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from asyncrl.plugin.common import LoraConfig

    config = LoraConfig(**lora)
    targets = config.targets(str(model_dir))
    hf = AutoConfig.from_pretrained(model_dir)
    shapes = _linear_shapes(hf)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf.num_hidden_layers):
        for path, (out_features, in_features) in shapes.items():
            if path.rsplit(".", 1)[-1] not in targets:
                continue
            name = f"{ADAPTER_PREFIX}model.layers.{layer}.{path}"
            a = torch.randn(config.rank, in_features, generator=generator) * 0.1
            b = torch.randn(out_features, config.rank, generator=generator) * 0.1
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config.peft_config(str(model_dir))))
    return out


def _linear_shapes(hf: Any) -> dict[str, tuple[int, int]]:
    """``(out, in)`` features of a Qwen2-shaped decoder layer's linear layers, by path."""
    head = hf.hidden_size // hf.num_attention_heads
    kv = hf.num_key_value_heads * head
    h, i = hf.hidden_size, hf.intermediate_size
    return {
        "self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }  # fmt: skip


# --------------------------------------------------------------------------- reference
class Reference:
    """One big batch in float64: plain transformers, one sequence per forward, the loss
    written out per token, clipping and AdamW by hand (torch.optim.AdamW's update rule).

    With ``adapter`` (a PEFT directory): the LoRA math written out, ``W x + (alpha / r) B A
    x`` on each adapted layer, the base frozen; only ``A`` and ``B`` train, and
    :meth:`weights` are theirs, under PEFT's saved names."""

    def __init__(self, model_dir: Path, hp: dict[str, Any], adapter: Path | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float64, attn_implementation="eager"
        )
        self.lora: dict[str, Any] = {}
        if adapter is not None:
            self.lora = _attach_lora(self.model, adapter)
        self.hp = hp
        self.moments: dict[str, tuple[Any, Any]] = {}
        self.t = 0

    def logprobs(self, tokens: np.ndarray, prompt_len: int) -> Any:
        torch = self.torch
        ids = torch.as_tensor(tokens, dtype=torch.long)
        logits = self.model(input_ids=ids[None]).logits[0]
        out = [
            torch.log_softmax(logits[p - 1] / TEMPERATURE, dim=-1)[ids[p]]
            for p in range(prompt_len, len(ids))
        ]
        return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)

    def step(
        self,
        seqs: list[tuple[np.ndarray, int]],
        ids: list[int],
        behaviour: list[np.ndarray],
        adv: np.ndarray,
        masks: list[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """One step over sequences ``ids``; with ``masks`` (per sequence, as ``behaviour``)
        only the tokens whose mask is 1 enter the loss and the count."""
        torch = self.torch
        self.model.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        lo, hi = 1 - LOSS["clip_eps_low"], 1 + LOSS["clip_eps_high"]
        n = 0
        for i in ids:
            keep = np.ones(len(behaviour[i]), bool) if masks is None else masks[i] == 1
            n += int(keep.sum())
            lp = self.logprobs(*seqs[i])[torch.as_tensor(keep)]
            beh = torch.as_tensor(behaviour[i][keep], dtype=torch.float64)
            r = torch.exp(lp - beh)  # proximal policy = behaviour: IS weight 1
            a = float(adv[i])
            total = total - torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum()
        (total / n).backward()
        params = [(k, p) for k, p in self.model.named_parameters() if p.grad is not None]
        norm = math.sqrt(sum(float((p.grad**2).sum()) for _, p in params))
        coef = min(1.0, self.hp["max_grad_norm"] / (norm + 1e-6))
        self.t += 1
        b1, b2 = self.hp["betas"]
        lr, eps, wd = self.hp["lr"], self.hp["eps"], self.hp["weight_decay"]
        with torch.no_grad():
            for k, p in params:
                g = p.grad * coef
                m, v = self.moments.get(k, (torch.zeros_like(p), torch.zeros_like(p)))
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                self.moments[k] = (m, v)
                p.mul_(1 - lr * wd)
                m_hat, v_hat = m / (1 - b1**self.t), v / (1 - b2**self.t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + eps))
        return {"loss": float(total.detach()) / n, "grad_norm": norm, "num_loss_tokens": n}

    def weights(self) -> dict[str, np.ndarray]:
        if self.lora:
            return {k: p.detach().numpy().copy() for k, p in self.lora.items()}
        return {k: v.detach().numpy().copy() for k, v in self.model.named_parameters()}


def _attach_lora(model: Any, adapter: Path) -> dict[str, Any]:
    """Freeze ``model`` and put the adapter at ``adapter`` on its layers, in float64; returns
    the adapter's parameters by saved name."""
    import torch
    from safetensors.torch import load_file

    class LoraLinear(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor,
                     scale: float) -> None:  # fmt: skip
            super().__init__()
            self.base, self.scale = base, scale
            self.lora_A = torch.nn.Parameter(a.to(torch.float64))
            self.lora_B = torch.nn.Parameter(b.to(torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.scale * ((x @ self.lora_A.T) @ self.lora_B.T)

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    model.requires_grad_(False)
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[len(ADAPTER_PREFIX) : -len(".lora_A.weight")]
        parent, leaf = path.rsplit(".", 1)
        b_key = key.replace(".lora_A.", ".lora_B.")
        layer = LoraLinear(model.get_submodule(path), tensors[key], tensors[b_key], scale)
        setattr(model.get_submodule(parent), leaf, layer)
        out[key], out[b_key] = layer.lora_A, layer.lora_B
    return out


# --------------------------------------------------------------------------- running it
@dataclass
class ContractRun:
    """What the ranks wrote, and the reference's view of the same scenario."""

    out: Path
    ranks: list[dict[str, Any]]
    resumed: list[dict[str, Any]]
    model_dir: Path
    behaviour: np.ndarray
    advantages: np.ndarray
    reference_logprobs: list[np.ndarray]
    reference_steps: list[dict[str, float]]
    reference_weights: list[dict[str, np.ndarray]]
    initial_weights: dict[str, np.ndarray]
    loss_mask: np.ndarray
    """The masked step's mask, flat over every sequence's response tokens."""
    reference_masked_step: dict[str, float]
    """Step 1 from the state after step 0, over the trained tokens only."""
    reference_masked_weights: dict[str, np.ndarray]
    vocab_size: int
    lora: bool
    """The scenario trained an adapter (``[lora]``): exports are the adapter's."""

    def weights(self, tag: str) -> dict[str, np.ndarray]:
        with np.load(self.out / f"weights-{tag}.npz") as f:
            return {k: f[k] for k in f.files}

    def result(self, tag: str, rank: int = 0) -> dict[str, Any]:
        source = self.resumed if tag.endswith("resumed") else self.ranks
        return source[rank][tag]["result"]


STUCK_TIMEOUT_S = 3.0
"""``failures.collective_timeout_s`` of the ``stuck`` phase."""
STUCK_SLEEP_S = STUCK_TIMEOUT_S + 5
"""How long the last rank stays away in the ``stuck`` phase: a collective that does not time
out completes once it is back."""


def run_stuck(
    backend: str, options: dict[str, Any], world_size: int, work: Path, timeout: float
) -> list[dict[str, Any]]:
    """Phase ``stuck`` (one rank sleeps past ``STUCK_TIMEOUT_S`` while the others enter a
    collective): every rank's report."""
    model_dir = build_tiny_qwen2(work / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out, run_dir = work / "out", work / "run"
    for d in (out, run_dir):
        d.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "environment": {"name": "contract"},
        "grpo": {"temperature": TEMPERATURE},
        "trainer": {"backend": backend, "micro_batch_size": MICRO_BATCH_SIZE, "options": options},
        "failures": {"collective_timeout_s": STUCK_TIMEOUT_S},
    }
    spec = {
        "backend": backend, "config": config, "vocab_size": vocab_size, "out": str(out),
        "states": str(work), "run_dir": str(run_dir), "phase": "stuck",
        "sleep_s": STUCK_SLEEP_S,
    }  # fmt: skip
    launch_ranks(spec, world_size, timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_contract(
    backend: str,
    options: dict[str, Any],
    world_size: int,
    work: Path,
    *,
    model_dir: Path | None = None,
    timeout: float = 300.0,
    trainer: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
    state_offload: bool = True,
) -> ContractRun:
    """Run both phases of the scenario and the reference; see :class:`ContractRun`."""
    import torch

    model_dir = model_dir or build_tiny_qwen2(work / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out, states, run_dir = work / "out", work / "states", work / "run"
    for d in (out, states, run_dir):
        d.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "environment": {"name": "contract"},
        "grpo": {"temperature": TEMPERATURE},
        "loss": LOSS,
        "trainer": {"backend": backend, "micro_batch_size": MICRO_BATCH_SIZE, "options": options,
                    **(trainer or {})},  # fmt: skip
    }
    adapter = write_adapter(model_dir, work / "adapter", lora) if lora else None
    if adapter is not None:
        config["lora"] = {**(lora or {}), "init_path": str(adapter)}
    spec = {
        "backend": backend, "config": config, "vocab_size": vocab_size, "out": str(out),
        "states": str(states), "run_dir": str(run_dir), "state_offload": state_offload,
    }  # fmt: skip
    launch_ranks({**spec, "phase": "main"}, world_size, timeout)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    resumed_out = work / "resumed"
    resumed_out.mkdir(exist_ok=True)
    launch_ranks({**spec, "phase": "resume", "out": str(resumed_out)}, world_size, timeout)
    resumed = [json.loads((resumed_out / f"rank{r}.json").read_text()) for r in range(world_size)]
    for f in resumed_out.glob("weights-*.npz"):
        f.rename(out / f.name)

    hp = {**HYPERPARAMETERS, **{k: v for k, v in options.items() if k in HYPERPARAMETERS}}
    seqs = contract_sequences(vocab_size)
    behaviour_flat = np.load(out / "behaviour.npy")
    advantages = np.load(out / "advantages.npy")
    lens = [len(t) - p for t, p in seqs]
    bounds = np.concatenate([[0], np.cumsum(lens)])
    behaviour = [behaviour_flat[bounds[i] : bounds[i + 1]] for i in range(NUM_SEQUENCES)]
    mask_flat = contract_loss_mask(seqs)
    masks = [mask_flat[bounds[i] : bounds[i + 1]] for i in range(NUM_SEQUENCES)]
    ref = Reference(model_dir, hp, adapter)
    initial = ref.weights()
    with torch.no_grad():
        ref_lp = [ref.logprobs(t, p).numpy() for t, p in seqs]
    steps, weights = [], []
    for ids in ([i for c in STEP0_CHUNKS for i in c], STEP1):
        steps.append(ref.step(seqs, ids, behaviour, advantages))
        weights.append(ref.weights())
    masked_ref = Reference(model_dir, hp, adapter)  # the masked step starts where step 1 does
    masked_ref.step(seqs, [i for c in STEP0_CHUNKS for i in c], behaviour, advantages)
    masked_step = masked_ref.step(seqs, STEP1, behaviour, advantages, masks)
    return ContractRun(
        out=out, ranks=ranks, resumed=resumed, model_dir=model_dir, behaviour=behaviour_flat,
        advantages=advantages, reference_logprobs=ref_lp, reference_steps=steps,
        reference_weights=weights, initial_weights=initial, loss_mask=mask_flat,
        reference_masked_step=masked_step, reference_masked_weights=masked_ref.weights(),
        vocab_size=vocab_size, lora=adapter is not None,
    )  # fmt: skip


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str]:
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    worst = max(((float(np.abs(a[k] - b[k]).max()), k) for k in a), default=(0.0, ""))
    return worst


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------- the suite
class TrainingBackendContract:
    """Subclass with ``backend`` (and optionally ``world_size``, ``options``, ``trainer``) set."""

    backend: ClassVar[str]
    world_size: ClassVar[int] = 1
    options: ClassVar[dict[str, Any]] = {}
    trainer: ClassVar[dict[str, Any]] = {}
    """Other ``[trainer]`` fields of the scenario, e.g. ``max_tokens_per_micro_batch``."""
    lora: ClassVar[dict[str, Any]] = {}
    """``[lora]`` of the scenario (rank, alpha, target modules): the backend trains an adapter
    that starts from random ``lora_A`` and ``lora_B`` (:func:`write_adapter`), against the
    float64 LoRA math, and must leave the base untouched."""
    collective_timeout: ClassVar[bool] = True
    """Run the stuck-collective test (two ranks or more). Its scenario takes ``backend``,
    ``options`` and ``world_size`` only: a class that varies only ``trainer`` fields of
    another class in the same suite repeats it exactly, and can leave it to that class."""
    state_offload: ClassVar[bool] = True
    """Run the state-offload steps (if the backend has them). They do not depend on
    ``trainer`` fields: a class that varies only those of another class in the same suite
    repeats them, and can leave them to that class."""
    timeout: ClassVar[float] = 300.0
    # tolerances (see the module constants for what they were measured at)
    logprob_atol: ClassVar[float] = LOGPROB_ATOL
    loss_rtol: ClassVar[float] = LOSS_RTOL
    grad_norm_rtol: ClassVar[float] = GRAD_NORM_RTOL
    weight_atol: ClassVar[float] = WEIGHT_ATOL
    same_atol: ClassVar[float] = SAME_ATOL

    @classmethod
    def backend_options(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        """``[trainer.options]`` for the contract's hyperparameters (override to rename)."""
        return {**hyperparameters, **cls.options}

    @pytest.fixture(scope="class")
    @classmethod
    def contract(cls, tmp_path_factory: pytest.TempPathFactory) -> ContractRun:
        if not 0 < cls.grad_norm_rtol <= GRAD_NORM_RTOL_CEILING:
            raise ValueError(
                f"grad_norm_rtol = {cls.grad_norm_rtol}: the contract allows at most "
                f"{GRAD_NORM_RTOL_CEILING}"
            )
        work = tmp_path_factory.mktemp(f"contract-{cls.backend}-{cls.world_size}")
        return run_contract(
            cls.backend,
            cls.backend_options(dict(HYPERPARAMETERS)),
            cls.world_size,
            work,
            timeout=cls.timeout,
            trainer=cls.trainer,
            lora=cls.lora or None,
            state_offload=cls.state_offload,
        )

    def test_a_rank_missing_from_a_collective_fails_within_the_timeout(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """One rank stops joining collectives (stuck in its compute, as a deadlock would
        leave it): the others' call fails after ``failures.collective_timeout_s``, not after
        torch's default 10 or 30 minutes, with the error the worker runtime turns into a
        ``CollectiveTimeoutError`` (its event loop still answers the heartbeat, so nothing
        else would see the hang)."""
        from asyncrl.plugin.backend import collective_timed_out

        if self.world_size < 2:
            pytest.skip("one rank: no collective to be stuck in")
        if not self.collective_timeout:
            pytest.skip("the same scenario as another class of the suite (collective_timeout)")
        work = tmp_path_factory.mktemp(f"stuck-{self.backend}-{self.world_size}")
        reports = run_stuck(self.backend, self.backend_options(dict(HYPERPARAMETERS)),
                            self.world_size, work, self.timeout)  # fmt: skip
        for report in reports[:-1]:
            seen = report["stuck"]
            assert seen["error"] is not None, "the collective completed without the last rank"
            assert collective_timed_out(RuntimeError(seen["error"])), seen["error"]
            # at the timeout, not before, and not because the last rank came back (3.0 s
            # measured for gloo); torch's own timeout would be 10 or 30 minutes
            assert STUCK_TIMEOUT_S <= seen["seconds"] < STUCK_SLEEP_S, seen

    # ---------------------------------------------------------------- forward
    def test_logprobs_match_float64_reference(self, contract: ContractRun) -> None:
        rank0 = contract.ranks[0]
        shards = rank0["logprob_shards"]
        got = np.concatenate(
            [np.load(contract.out / f"logprobs-rank{r}.npy") for r in range(len(shards))]
        )
        order = [i for shard in shards for i in shard]
        want = np.concatenate([contract.reference_logprobs[i] for i in order])
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.abs(got - want).max() < self.logprob_atol, np.abs(got - want).max()
        # the behaviour logprobs came from each rank scoring the whole batch itself
        full = np.concatenate(contract.reference_logprobs)
        assert np.abs(contract.behaviour - full).max() < 3.0  # noise of sd 0.5 on top

    # ---------------------------------------------------------------- one step
    def test_streamed_step_matches_float64_reference(self, contract: ContractRun) -> None:
        got, want = contract.result("stream"), contract.reference_steps[0]
        assert got["num_loss_tokens"] == want["num_loss_tokens"]
        assert _rel(got["grad_norm"], want["grad_norm"]) < self.grad_norm_rtol, (got, want)
        assert _rel(got["loss"], want["loss"]) < self.loss_rtol, (got, want)
        clip = self.backend_options(dict(HYPERPARAMETERS))["max_grad_norm"]
        assert want["grad_norm"] > clip  # the clip mattered
        diff, name = _max_diff(contract.weights("stream"), contract.reference_weights[0])
        assert diff < self.weight_atol, f"{name} differs by {diff:.3g} from the reference update"

    def test_second_step_matches_float64_reference(self, contract: ContractRun) -> None:
        got, want = contract.result("step1"), contract.reference_steps[1]
        assert _rel(got["grad_norm"], want["grad_norm"]) < self.grad_norm_rtol, (got, want)
        assert _rel(got["loss"], want["loss"]) < self.loss_rtol, (got, want)
        diff, name = _max_diff(contract.weights("step1"), contract.reference_weights[1])
        assert diff < self.weight_atol, f"{name} differs by {diff:.3g} from the reference update"

    def test_chunks_with_uneven_and_empty_shards_add_up(self, contract: ContractRun) -> None:
        seqs = contract_sequences(contract.vocab_size)
        for r, report in enumerate(contract.ranks):
            for c, (ids, chunk) in enumerate(zip(STEP0_CHUNKS, report["stream"]["chunks"])):
                mine = shard_chunk(ids, c, self.world_size)[r]
                assert chunk["num_sequences"] == len(mine)
                assert chunk["num_loss_tokens"] == num_tokens(seqs, mine)
                if not mine:
                    assert chunk["loss_sum"] == 0.0
        total = sum(
            c["loss_sum"] for report in contract.ranks for c in report["stream"]["chunks"]
        )
        want = contract.reference_steps[0]
        assert _rel(total / want["num_loss_tokens"], want["loss"]) < self.loss_rtol

    def test_every_rank_reports_the_same_step(self, contract: ContractRun) -> None:
        for tag in ("stream", "step1", "one"):
            first = contract.result(tag)
            for r in range(1, self.world_size):
                other = contract.result(tag, r)
                for key in ("loss", "grad_norm", "num_loss_tokens"):
                    assert other[key] == first[key], (tag, key, r)

    def test_each_rank_reports_its_memory_peaks_on_cuda(self, contract: ContractRun) -> None:
        """On CUDA each rank's step reports the device memory it held at most (its tensors at
        most what its allocator held); elsewhere 0, not measured."""
        import torch

        for r in range(self.world_size):
            result = contract.result("step1", r)
            allocated, reserved = result["peak_allocated_bytes"], result["peak_reserved_bytes"]
            if torch.cuda.is_available():
                assert 0 < allocated <= reserved, (r, allocated, reserved)
            else:
                assert allocated == reserved == 0, (r, allocated, reserved)

    def test_streamed_chunks_equal_one_chunk(self, contract: ContractRun) -> None:
        one, stream = contract.result("one"), contract.result("stream")
        assert _rel(one["grad_norm"], stream["grad_norm"]) < self.grad_norm_rtol
        diff, name = _max_diff(contract.weights("one"), contract.weights("stream"))
        assert diff < self.same_atol, f"{name}: one chunk vs three differ by {diff:.3g}"

    def test_discarded_step_leaves_nothing_behind(self, contract: ContractRun) -> None:
        for report in contract.ranks:
            message = report["errors"]["wrong_token_count"]
            assert message is not None, "finish_step accepted a wrong token count"
            assert "discarded" in message
        # the retried step after the discarded one equals the reference's first step
        diff, name = _max_diff(contract.weights("one"), contract.reference_weights[0])
        assert diff < self.weight_atol, f"{name} differs by {diff:.3g}: the discarded step leaked"

    def test_malformed_batch_on_one_rank_raises_on_every_rank(self, contract: ContractRun) -> None:
        for r, report in enumerate(contract.ranks):
            message = report["errors"]["malformed_batch"]
            assert message is not None, f"rank {r} accepted a token id outside the vocabulary"
            assert "malformed" in message, message
            # the open step stayed usable: a good chunk after it trained and the step finished
            assert report["after_malformed"]["num_loss_tokens"] > 0

    # ---------------------------------------------------------------- weights
    def test_exported_weights_equal_the_model(self, contract: ContractRun) -> None:
        diff, name = _max_diff(contract.weights("init"), contract.initial_weights)
        assert diff == 0.0, f"{name} exported {diff:.3g} away from the model file"
        for r, report in enumerate(contract.ranks):
            export = report["exports"]["init"]
            specs = [(s["name"], s["dtype"], s["shape"]) for s in export["specs"]]
            yielded = [(y["name"], y["dtype"], y["shape"]) for y in export["yielded"]]
            assert specs == yielded, "weight_specs() and iter_weights() disagree"
            if r == 0:
                assert all(y["has_data"] for y in export["yielded"])
        shapes = {k: list(v.shape) for k, v in contract.initial_weights.items()}
        assert {s["name"]: s["shape"] for s in contract.ranks[0]["exports"]["init"]["specs"]} == (
            shapes
        )

    def test_hugging_face_export_loads_and_matches_the_trainer(
        self, contract: ContractRun
    ) -> None:
        """The export after step 1 loads with transformers as it is (several shards and an
        index); its weights are the trainer's bit for bit and its logprobs the trainer's. An
        adapter's export is a PEFT directory that PEFT loads on the base."""
        from safetensors.numpy import load_file

        export = contract.out / "hf-step1"
        if contract.lora:
            saved = load_file(str(export / "adapter_model.safetensors"))
            diff, name = _max_diff(saved, contract.weights("step1"))
            assert diff == 0.0, f"{name} is {diff:.3g} off the trainer's adapter"
            assert not (export / "config.json").exists()  # the adapter alone, not a model
            worst = _worst_logprob_diff(contract, export, "logprobs-step1")
            assert worst < self.logprob_atol, f"export vs trainer logprobs: {worst:.3g}"
            return
        index = json.loads((export / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1
        saved = {k: v for shard in shards for k, v in load_file(str(export / shard)).items()}
        diff, name = _max_diff(saved, contract.weights("step1"))
        assert diff == 0.0, f"{name} is {diff:.3g} off the trainer's weights"
        assert (export / "tokenizer.json").is_file()
        worst = _worst_logprob_diff(contract, export, "logprobs-step1")
        assert worst < self.logprob_atol, f"export vs trainer logprobs: {worst:.3g}"

    def test_scoring_as_sent_rounds_the_weights_and_puts_them_back(
        self, contract: ContractRun
    ) -> None:
        """``sent_logprobs`` (if the backend has it) scores the step-1 weights rounded to
        bfloat16, as a float64 forward of the rounded export does; the weights afterwards are
        the trainer's bit for bit, and so are its logprobs."""
        if not contract.ranks[0].get("sent_logprobs"):
            pytest.skip(
                "the backend has no sent_logprobs (asyncrl.plugin.backend.SentWeightsScoring)"
            )
        export = contract.out / "hf-step1"
        rounded = _worst_logprob_diff(contract, export, "sent-step1", round_to="bfloat16")
        unrounded = _worst_logprob_diff(contract, export, "sent-step1")
        assert rounded < self.logprob_atol, f"sent vs rounded reference: {rounded:.3g}"
        # the rounding moves logprobs far beyond the tolerance: measured 2.9e-3 (fsdp2 and
        # ZeRO-2/3 alike), and 3.6e-7 to 4.9e-7 against the rounded reference
        assert unrounded > 100 * self.logprob_atol, unrounded
        diff, name = _max_diff(contract.weights("after-sent"), contract.weights("step1"))
        assert diff == 0.0, f"{name} is {diff:.3g} off after scoring as sent"
        for r in range(len(contract.ranks)):
            before = np.load(contract.out / f"logprobs-step1-rank{r}.npy")
            after = np.load(contract.out / f"after-sent-step1-rank{r}.npy")
            assert np.array_equal(before, after), f"rank {r}: logprobs changed by scoring as sent"

    # ---------------------------------------------------------------- LoRA
    def test_an_adapter_run_never_touches_the_base(self, contract: ContractRun) -> None:
        """``[lora]``: no frozen parameter holds a gradient after any step's chunks (FSDP2
        keeps ``.grad`` on parameters; ZeRO keeps its own partitions), every rank's part of
        the base is the same bits at the end of both phases as at their start (steps,
        discards, loads and scoring as sent), and the trainer counts the adapter's
        parameters alone as trainable."""
        if not contract.lora:
            pytest.skip("full weights: the base trains")
        for report in (*contract.ranks, *contract.resumed):
            assert report.get("base_gradients", []) == [], report["base_gradients"][:5]
            assert report["base_before"] == report["base_after"], "the frozen base changed"
        adapter = sum(v.size for v in contract.initial_weights.values())
        assert contract.ranks[0]["capabilities"]["trainable_parameters"] == adapter

    # ---------------------------------------------------------------- state
    def test_load_restores_the_saved_weights(self, contract: ContractRun) -> None:
        diff, name = _max_diff(contract.weights("loaded"), contract.weights("init"))
        assert diff == 0.0, f"{name} differs by {diff:.3g} after load_state"

    def test_save_load_step_equals_step(self, contract: ContractRun) -> None:
        want = contract.result("step1")
        for tag in ("step1-reloaded", "step1-resumed"):
            got = contract.result(tag)
            assert _rel(got["grad_norm"], want["grad_norm"]) < self.grad_norm_rtol, (tag, got)
            diff, name = _max_diff(contract.weights(tag), contract.weights("step1"))
            # a lost optimizer state (AdamW moments, step count) moves weights by ~lr
            assert diff < self.same_atol, f"{tag}: {name} is {diff:.3g} off the uninterrupted step"

    # ---------------------------------------------------------------- state offload
    def _offload_reports(self, contract: ContractRun) -> list[dict[str, Any]]:
        """Each rank's ``offload`` report, or skip the test."""
        if not contract.ranks[0]["state_offload"]:
            pytest.skip("the backend has no state_to_host (asyncrl.plugin.backend.StateOffload)")
        if not self.state_offload:
            pytest.skip("the same state-offload steps as another class (state_offload)")
        return [report["offload"] for report in contract.ranks]

    def test_state_to_host_and_back_changes_no_bit(self, contract: ContractRun) -> None:
        """Step 1 after ``state_to_host`` -> ``state_to_device``, and step 1 from a checkpoint
        saved while the state was on the host (brought back by ``begin_step``), equal step 1
        without either (all from ``load_state``), bit for bit: loss, grad norm, weights. A
        second call of either moves nothing; off CUDA no call does."""
        import torch

        reports = self._offload_reports(contract)
        for tag in ("step1-offloaded", "step1-host-saved"):
            for r in range(self.world_size):
                got, want = contract.result(tag, r), contract.result("step1-reloaded", r)
                for key in ("loss", "grad_norm", "num_loss_tokens"):
                    assert got[key] == want[key], (tag, key, r, got[key], want[key])
            diff, name = _max_diff(contract.weights(tag), contract.weights("step1-reloaded"))
            assert diff == 0.0, f"{tag}: {name} is {diff:.3g} off the step without the moves"
        for r, moves in enumerate(reports):
            assert moves["host_again"] == moves["device_again"] == 0, (r, moves)
            if not torch.cuda.is_available():
                assert moves["to_host"] == moves["to_device"] == 0, (r, moves)

    def test_state_to_host_leaves_the_weights(self, contract: ContractRun) -> None:
        """With the state on the host, the export (a refit's source) is step 0's weights bit
        for bit, and a forward gives the logprobs of before the move."""
        reports = self._offload_reports(contract)
        diff, name = _max_diff(contract.weights("on-host"), contract.weights("stream"))
        assert diff == 0.0, f"{name} exported {diff:.3g} off step 0's with the state on the host"
        for r, moves in enumerate(reports):
            assert moves["logprobs_unchanged"], f"rank {r}: logprobs changed with the state moved"

    def test_state_to_host_frees_what_it_reports(self, contract: ContractRun) -> None:
        """On CUDA, ``state_to_host`` after a step reports at least the AdamW moments (two
        float32 per trained parameter, over all ranks), the device memory allocated drops by
        at least what it reports, and ``state_to_device`` brings as much back."""
        import torch

        reports = self._offload_reports(contract)
        if not torch.cuda.is_available():
            pytest.skip("CUDA only: on the CPU the state stays where it is")
        trained = contract.ranks[0]["capabilities"]["trainable_parameters"]
        assert sum(m["to_host"] for m in reports) >= 8 * trained, (trained, reports)
        for r, moves in enumerate(reports):
            before, on_host, back = moves["allocated"]
            assert moves["to_host"] > 0, (r, moves)
            assert before - on_host >= moves["to_host"] - OFFLOAD_SLACK_BYTES, (r, moves)
            assert moves["to_device"] == moves["to_host"], (r, moves)
            assert back - on_host >= moves["to_device"] - OFFLOAD_SLACK_BYTES, (r, moves)

    def test_state_to_host_refuses_an_open_step(self, contract: ContractRun) -> None:
        """``state_to_host`` while a step is open raises on every rank and moves nothing (the
        step, begun again, equals the reference: ``test_discarded_step_leaves_nothing_behind``)."""
        if not contract.ranks[0]["state_offload"]:
            pytest.skip("the backend has no state_to_host (asyncrl.plugin.backend.StateOffload)")
        for r, report in enumerate(contract.ranks):
            message = report["errors"]["offload_open_step"]
            assert message is not None, f"rank {r}: state_to_host moved the state of an open step"
            assert "is open" in message, message

    # ---------------------------------------------------------------- loss mask
    def test_masked_step_matches_float64_reference(self, contract: ContractRun) -> None:
        """Only the tokens the mask selects train, and the step is normalized by their count
        (with 0.0 placeholders at the masked ones, as the controller writes them)."""
        seqs = contract_sequences(contract.vocab_size)
        got, want = contract.result("masked"), contract.reference_masked_step
        trained = num_tokens(seqs, STEP1, contract.loss_mask)
        assert 0 < trained < num_tokens(seqs, STEP1)  # the mask leaves tokens out
        assert got["num_loss_tokens"] == want["num_loss_tokens"] == trained
        assert _rel(got["grad_norm"], want["grad_norm"]) < self.grad_norm_rtol, (got, want)
        assert _rel(got["loss"], want["loss"]) < self.loss_rtol, (got, want)
        diff, name = _max_diff(contract.weights("masked"), contract.reference_masked_weights)
        assert diff < self.weight_atol, f"{name} differs by {diff:.3g} from the masked reference"

    def test_masked_chunks_count_trained_tokens_only(self, contract: ContractRun) -> None:
        """Each rank's ``ChunkResult`` counts its share's trained tokens; a chunk whose mask
        trains nothing (a fully masked sequence) is accepted and adds nothing."""
        seqs = contract_sequences(contract.vocab_size)
        for report in contract.ranks:
            for tag in ("masked", "masked-garbage"):
                for ids, chunk in zip(report[tag]["shares"], report[tag]["chunks"]):
                    assert chunk["num_loss_tokens"] == num_tokens(seqs, ids, contract.loss_mask)
                    if ids == [FULLY_MASKED]:
                        assert chunk["num_loss_tokens"] == 0 and chunk["loss_sum"] == 0.0
                        assert chunk["clipped_tokens"] == 0 and chunk["is_weight_sum"] == 0.0
        assert MASKED_CHUNKS[0] == [FULLY_MASKED]

    def test_masked_tokens_change_nothing(self, contract: ContractRun) -> None:
        """Huge placeholder behaviour logprobs (+-1e30) and a huge advantage where nothing
        trains give the step of 0.0 placeholders: same result, same weights (a backend that
        let them in would get an infinite or NaN loss)."""
        for r in range(self.world_size):
            calm, wild = contract.result("masked", r), contract.result("masked-garbage", r)
            assert wild["num_loss_tokens"] == calm["num_loss_tokens"]
            for key in ("loss", "grad_norm"):
                assert math.isfinite(wild[key]), (key, wild)
                assert _rel(wild[key], calm[key]) < self.grad_norm_rtol, (key, wild, calm)
        diff, name = _max_diff(contract.weights("masked-garbage"), contract.weights("masked"))
        assert diff < self.same_atol, f"{name}: masked placeholders moved it by {diff:.3g}"


def _worst_logprob_diff(
    contract: ContractRun, model_dir: Path, prefix: str, *, round_to: str | None = None
) -> float:
    """Largest |difference| between the ranks' saved logprobs ``{prefix}-rank{r}.npy`` (every
    sequence, dealt round-robin) and a float64 forward of the Hugging Face model at
    ``model_dir``, its weights first rounded to ``round_to`` if given."""
    import torch
    from transformers import AutoModelForCausalLM

    adapter = (model_dir / "adapter_config.json").is_file()
    base = contract.model_dir if adapter else model_dir
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    if adapter:  # PEFT loads the export on the base; its layers are rounded apart, then merged
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, model_dir)
    if round_to is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(getattr(torch, round_to)))
    model = model.to(torch.float64).eval()
    if adapter:
        model = model.merge_and_unload()
    seqs = contract_sequences(model.config.vocab_size)
    world = len(contract.ranks)
    trainer = {}
    for r in range(world):
        flat = np.load(contract.out / f"{prefix}-rank{r}.npy")
        ids = list(range(NUM_SEQUENCES))[r::world]
        lens = [len(seqs[i][0]) - seqs[i][1] for i in ids]
        for i, part in zip(ids, np.split(flat, np.cumsum(lens)[:-1])):
            trainer[i] = part
    worst = 0.0
    with torch.no_grad():
        for i, (tokens, prompt_len) in enumerate(seqs):
            if len(tokens) == prompt_len:
                continue
            logits = model(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0]
            lp = torch.log_softmax(logits[:-1] / TEMPERATURE, dim=-1)
            picked = lp[torch.arange(len(tokens) - 1), torch.as_tensor(tokens[1:])]
            got = picked[prompt_len - 1 :].numpy()
            worst = max(worst, float(np.abs(got - trainer[i]).max()))
    return worst
