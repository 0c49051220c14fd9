"""``[lora]``: train a LoRA adapter on a frozen base instead of the full weights (docs/lora.md).

Its checks sit with it; :func:`asyncrl.config.problems` gathers them. The model family's
default target modules are read from ``model.path``'s ``config.json`` (no torch), so a family
without defaults is named before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from asyncrl.config.section import Section, fail
from asyncrl.errors import ConfigError

if TYPE_CHECKING:
    from asyncrl.config.setup import ModelConfig

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "MemoryEstimate", "model_type"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    family: _ATTENTION + _MLP
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite")
}
"""``lora.target_modules`` when empty, by ``config.json``'s ``model_type``: every linear layer
of attention and MLP, and never the embedding or ``lm_head`` (vLLM serves no adapter there).
Every projection rather than attention alone: LoRA on the MLP layers too is what matches full
fine-tuning in RL at small ranks (Thinking Machines, "LoRA Without Regret", 2025)."""


class LoraConfig(Section):
    rank: int = 0
    """The adapter's rank ``r``; 0 trains the full weights. With a rank, the base weights stay
    frozen in ``model.dtype`` and only the adapter (float32, with its optimizer state) trains;
    after each step only the adapter moves to the generators, as a new adapter version served
    beside the older ones (docs/lora.md). Set it (8 to 128) to train a model whose full
    weights and optimizer state do not fit."""
    alpha: float = 32.0
    """The adapter's scale is ``alpha / rank``. Keep it when changing the rank (the learning
    rate that works then stays about the same); LoRA usually wants a learning rate about 10x
    the full fine-tune's."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training. In RL it makes the trainer's logprobs
    noisier than the generator's (the importance weights see it); leave it at 0 unless the
    task overfits."""
    target_modules: list[str] = []
    """The linear layers that get an adapter, by module name (``q_proj``...). Empty: every
    attention and MLP projection of the model's family (``DEFAULT_TARGETS``). Set it for a
    family without defaults, or to adapt fewer layers."""
    init_path: str = ""
    """A PEFT adapter directory (``adapter_config.json`` and its weights) to start from, e.g.
    an SFT adapter; its rank, alpha and target modules must be this section's. Empty: a fresh
    adapter (``lora_B`` zero, so the first policy is the base). Relative paths are resolved
    against the config file's directory; a Hugging Face Hub id is found in the local cache, as
    ``model.path``'s is."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def targets(self, model_dir: str) -> tuple[str, ...]:
        """The target modules: the set ones, else the family's defaults.

        Raises:
            ConfigError: no target modules are set and the family has no defaults.
        """
        if self.target_modules:
            return tuple(self.target_modules)
        family = model_type(Path(model_dir))
        if family not in DEFAULT_TARGETS:
            raise fail(
                "lora.target_modules",
                f"is empty, and the model at {model_dir} (model_type {family!r}) has no default "
                f"targets (defaults for: {', '.join(sorted(DEFAULT_TARGETS))})",
                "list the model's linear layers to adapt, e.g. lora.target_modules = "
                '["q_proj", "v_proj"]',
            )
        return DEFAULT_TARGETS[family]

    def trainable_parameters(self, model_dir: str) -> int | None:
        """The adapter's parameters on the model at ``model_dir``: ``rank * (in + out)`` over
        every adapted layer, from ``config.json``; ``None`` when that cannot be read or a
        target is not one of the usual projections.

        Raises:
            ConfigError: as :meth:`targets`.
        """
        return _adapter_parameters(Path(model_dir), self.targets(model_dir), self.rank)

    def peft_config(self, model_dir: str) -> dict[str, object]:
        """The ``adapter_config.json`` of this adapter on the model at ``model_dir`` (PEFT's
        LoRA fields; PEFT and vLLM default the others)."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": self.dropout,
            "target_modules": sorted(self.targets(model_dir)), "bias": "none",
            "use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
            "modules_to_save": None, "base_model_name_or_path": model_dir,
            "inference_mode": True,
        }  # fmt: skip

    def problems(self, model_dir: str = "") -> list[ConfigError]:
        """Every broken invariant of ``[lora]``; with ``model_dir``, also its targets and its
        initial adapter against that model."""
        out: list[ConfigError] = []
        if self.rank < 0:
            out.append(fail("lora.rank", f"must be >= 0, got {self.rank}",
                            "use 0 to train the full weights, or a rank such as 32"))  # fmt: skip
        if not self.enabled:
            if self.init_path:
                out.append(fail("lora.init_path", "is set but lora.rank is 0 (full weights)",
                                "set lora.rank to the adapter's rank, or leave init_path empty"))  # fmt: skip
            return out
        if not self.alpha > 0:
            out.append(fail("lora.alpha", f"must be > 0, got {self.alpha}",
                            "set it to e.g. 32 (the scale is alpha / rank)"))  # fmt: skip
        if not 0 <= self.dropout < 1:
            out.append(fail("lora.dropout", f"must lie in [0, 1), got {self.dropout}",
                            "use 0 (no dropout)"))  # fmt: skip
        bad = [m for m in self.target_modules if m in ("embed_tokens", "lm_head") or not m]
        if bad:
            out.append(fail("lora.target_modules", f"names {bad}: vLLM serves adapters on "
                            "linear layers inside the decoder only", "remove them"))  # fmt: skip
        if model_dir and model_type(Path(model_dir)):  # else model.path's checks say
            try:
                targets = self.targets(model_dir)
            except ConfigError as exc:
                return out + [exc]
            if self.init_path:
                out += self._init_problems(targets)
        return out

    def _init_problems(self, targets: tuple[str, ...]) -> list[ConfigError]:
        """``init_path`` is a PEFT LoRA adapter of this section's shape that asyncrl can serve."""
        config_file = Path(self.init_path) / "adapter_config.json"
        try:
            peft = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            return [fail("lora.init_path", f"{config_file} cannot be read as a PEFT adapter "
                         f"config ({exc})", "point it at a directory written by PEFT's "
                         "save_pretrained, or by asyncrl export of a LoRA run")]  # fmt: skip
        theirs = {
            "rank": peft.get("r"), "alpha": peft.get("lora_alpha"),
            "target_modules": sorted(peft.get("target_modules") or []),
        }  # fmt: skip
        ours = {"rank": self.rank, "alpha": self.alpha, "target_modules": sorted(targets)}
        out = [
            fail(f"lora.{key}", f"is {ours[key]!r} but the initial adapter at {self.init_path} "
                 f"has {theirs[key]!r}", f"set lora.{key} = {theirs[key]!r}")
            for key in ours
            if theirs[key] != ours[key]
        ]  # fmt: skip
        unsupported = {
            "peft_type": peft.get("peft_type", "LORA") != "LORA",
            "use_dora": bool(peft.get("use_dora")),
            "use_rslora": bool(peft.get("use_rslora")),
            "bias": peft.get("bias", "none") != "none",
            "lora_bias": bool(peft.get("lora_bias")),
            "modules_to_save": bool(peft.get("modules_to_save")),
            "rank_pattern": bool(peft.get("rank_pattern")),
            "alpha_pattern": bool(peft.get("alpha_pattern")),
        }
        named = [key for key, bad in unsupported.items() if bad]
        if named:
            out.append(fail("lora.init_path", f"the adapter at {self.init_path} uses "
                            f"{', '.join(named)} (adapter_config.json), which asyncrl does not "
                            "train or serve (docs/lora.md, 'Not supported')",
                            "start from a plain LoRA adapter, or a fresh one"))  # fmt: skip
        return out


class MemoryEstimate(NamedTuple):
    """What ``asyncrl check-config`` says of a LoRA run's trainer (weights and optimizer only:
    no activations, no engine)."""

    model_parameters: int
    trainable_parameters: int
    base_bytes: int
    """The frozen base in ``model.dtype``."""
    adapter_bytes: int
    """The adapter, its gradient and AdamW's two moments, float32: 16 bytes a parameter."""
    full_bytes: int
    """The same model fully fine-tuned: float32 weights, gradients and moments."""

    @classmethod
    def of(
        cls, lora: LoraConfig, model: ModelConfig, model_parameters: int
    ) -> MemoryEstimate | None:
        """The estimate for ``model`` of ``model_parameters`` (its weight files' count:
        :func:`asyncrl.procs.space.model_size`), or ``None`` when the adapter's size cannot be
        read from ``config.json`` (a target other than the usual projections) or the model's
        is unknown (0).

        Raises:
            ConfigError: as :meth:`LoraConfig.targets`.
        """
        trainable = lora.trainable_parameters(model.path)
        total = model_parameters
        if trainable is None or not total:
            return None
        return cls(total, trainable, total * model.itemsize, trainable * 16, total * 16)


def _adapter_parameters(model_dir: Path, targets: tuple[str, ...], rank: int) -> int | None:
    """``rank * (in + out)`` summed over every adapted layer, from ``config.json``."""
    try:
        hf = json.loads((model_dir / "config.json").read_text())
        hf = hf.get("text_config", hf)
        h, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or h // heads
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    q, kv = heads * head_dim, kv_heads * head_dim
    sides = {
        "q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
        "gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h,
    }  # fmt: skip
    if any(t not in sides for t in targets):
        return None
    return layers * rank * sum(sides[t] for t in targets)


def model_type(model_dir: Path) -> str:
    """``config.json``'s ``model_type`` (``""`` when unreadable: ``model.path``'s own checks
    name that)."""
    try:
        data = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(data.get("model_type", "")) if isinstance(data, dict) else ""
