"""What one trainer rank of the ``fsdp2``, ``deepspeed`` and ``frozen`` backends holds on its
GPU at its peak, for the run's memory plan (:mod:`asyncrl.procs.gpu_memory`). Imports no
torch: the controller computes it before any worker starts.

With ``P`` the model's parameters, ``N`` the trainer ranks and ``T`` an adapter's (bytes):

========================  ====================================  ==============================
state                     full weights                          ``[lora]``
========================  ====================================  ==============================
weights                   float32 ``4P``; ZeRO-2 with bf16:     the base in ``model.dtype``,
                          a bf16 copy ``2P`` + master ``4P/N``  the adapter float32 ``4T``
gradients                 float32 ``4P``                        float32 ``4T``
AdamW moments             float32 ``8P`` (SGD: none)            float32 ``8T``
KL reference              ``2P`` (bf16) or ``4P``, unless       none: the base with the adapter
                          ``reference_offload``                 disabled
========================  ====================================  ==============================

FSDP2 and ZeRO-3 shard all of it over the ranks (``/N``); ZeRO-2 shards the gradients and the
optimizer only, each rank keeping the whole model's weights. Working memory (gathers, buffers)
is an eighth of the state on top. Then the activations of the longest micro-batch
(:func:`activation_bytes`), which no sharding divides.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugin.common import Config

__all__ = ["activation_bytes", "micro_batch_tokens", "trainer_need"]

WORKING_SHARE = 0.125
"""Working memory beyond the state, as a share of the state's bytes: on an H200
(``benchmarks/results/trainer-h200-1gpu.jsonl``, Qwen2.5-0.5B's shape, FSDP2, one rank) the
peaks at 2 and 8 sequences of 2,048 tokens extrapolate to 8.4 GiB at no token beside 7.4 GiB
of state: 1.0 GiB (0.135), rounded down, since the plan must not refuse what fits."""

LAYER_HIDDEN = 10
LAYER_MLP = 4
"""What a decoder layer keeps for its backward, per token, in units of the compute dtype:
``LAYER_HIDDEN`` tensors of the hidden width (each RMS norm's float32 input, two units, and
its output; the attention's query, key, value and output; the output projection's input) and
``LAYER_MLP`` of the MLP's (gate, up, the activation and the product). Counted on Qwen2.5's
0.5B and 1.5B shapes in bf16 (``benchmarks/memory_fit.py --count``, the storages autograd
saves): 9.9 and 4.07 units."""
LORA_HIDDEN = 11.5
LORA_MLP = 0.5
"""What ``[lora]`` adds to a layer, in the same units, where the float32 adapter computes in
float32 beside a bf16 base (no ``mixed_precision``): the float32 copies of the projections'
inputs PEFT makes for the adapter. Counted as above with rank 32 on every projection: 11.29
and 0.49. With ``mixed_precision = "bf16"`` the adapter computes in bf16 and a layer keeps
0.95 of what full weights do (counted on the 0.5B shape): nothing is added."""
LOGIT_FLOAT32 = 2
"""Float32 copies of a token's logits alive at the peak (the ``log_softmax`` the logprobs are
taken with, and its gradient), beside the compute dtype's own. Fitted to Qwen2.5-0.5B's shape
on an H200 (``benchmarks/results/trainer-h200-1gpu.jsonl``): 2.81 MB a token between
micro-batches of 2 and 8 sequences of 2,048 tokens, of which the layers' count above is
1.36 MB; the rest is 9.5 bytes a vocabulary entry, 2 of bf16 logits and 2.1 float32 copies
over the 7/8 of positions that predict responses."""


def activation_bytes(
    shape: Any, tokens: int, *, itemsize: int, checkpointing: bool, float32_adapter: bool = False
) -> int:
    """The activations of a micro-batch of ``tokens`` tokens at the backward's start, in
    compute tensors of ``itemsize`` bytes: every decoder layer's (with ``checkpointing``, each
    layer's input and one layer's recomputed whole; with ``float32_adapter``, the adapter's
    float32 inputs) and the logits'."""
    hidden, mlp = LAYER_HIDDEN, LAYER_MLP
    if float32_adapter:
        hidden, mlp = hidden + LORA_HIDDEN, mlp + LORA_MLP
    layer = int(itemsize * (hidden * shape.hidden + mlp * shape.intermediate))
    layers = shape.layers * itemsize * shape.hidden + layer if checkpointing else (
        shape.layers * layer)  # fmt: skip
    return tokens * (layers + shape.vocab * (itemsize + 4 * LOGIT_FLOAT32))


def micro_batch_tokens(config: Config, longest: int) -> int:
    """Tokens in the largest micro-batch a trainer rank runs, its sequences at most ``longest``
    tokens (0: not known): ``trainer.max_tokens_per_micro_batch`` (a longer sequence goes
    alone), else ``micro_batch_size`` sequences (at most a rank's share of a step) padded to
    the longest; 0 where neither bounds it."""
    t = config.trainer
    if t.max_tokens_per_micro_batch:
        return max(t.max_tokens_per_micro_batch, longest)
    per_rank = -(-config.grpo.prompts_per_step * config.grpo.samples_per_prompt
                 // max(1, config.cluster.trainer_ranks))  # fmt: skip
    return min(t.micro_batch_size, per_rank) * longest


def trainer_need(
    config: Config, shape: Any, gpu_bytes: int | None, *, backend: str, zero_stage: int = 0,
    bf16: bool = False, optimizer: str = "adamw", reference_offload: bool = False,
    checkpointing: bool = False, job_slots: int = 0,
) -> Any:  # fmt: skip
    """One trainer rank's :class:`~asyncrl.procs.gpu_memory.MemoryNeed` (``backend``:
    ``fsdp2``, ``deepspeed`` (``zero_stage`` 2 or 3; ``bf16``: its bf16 mode or mixed
    precision) or ``frozen``; ``checkpointing``: ``activation_checkpointing``; ``job_slots``:
    adapters held for jobs, each with the run's adapter's state)."""
    from asyncrl.plugin.backend import MemoryNeed

    n = max(1, config.cluster.trainer_ranks)
    p = shape.parameters
    shard = f", 1/{n} each" if n > 1 else ""
    whole_weights = backend == "deepspeed" and zero_stage == 2
    lora = config.lora
    parts: list[tuple[str, int]] = []
    if backend == "frozen":
        parts.append((f"weights float32{shard}", 4 * p // n))
        return MemoryNeed(tuple(parts), ())
    if lora.enabled:
        itemsize = config.model.itemsize
        base = itemsize * p if whole_weights else itemsize * p // n
        t = lora.trainable_parameters(config.model.path) or 0
        parts += [(f"base {config.model.dtype}" + ("" if whole_weights else shard), base),
                  (f"adapter, gradient, AdamW moments float32{shard}", 16 * t // n)]  # fmt: skip
        fixes = ["lower lora.rank"] if 16 * t > base else []
        movable = 12 * t // n
        if job_slots:
            parts.append((f"{job_slots} job adapters, gradients, AdamW moments float32{shard}",
                          16 * t * job_slots // n))  # fmt: skip
            fixes.append("fewer jobs at once (trainer.options.job_slots)")
    else:
        if whole_weights and bf16:
            parts += [("weights bf16 (whole)", 2 * p),
                      (f"master weights float32{shard}", 4 * p // n)]  # fmt: skip
        elif whole_weights:
            parts.append(("weights float32 (whole)", 4 * p))
        else:
            parts.append((f"weights float32{shard}", 4 * p // n))
        parts.append((f"gradients float32{shard}", 4 * p // n))
        movable = 4 * p // n
        if optimizer == "adamw":
            parts.append((f"AdamW moments float32{shard}", 8 * p // n))
            movable += 8 * p // n
        if config.loss.kl_coef > 0 and not reference_offload:
            parts.append((f"KL reference {'bf16' if bf16 else 'float32'}{shard}",
                          (2 if bf16 else 4) * p // n))  # fmt: skip
        fixes = ["train a LoRA adapter instead of every weight ([lora] rank = 16...)"]
        if backend == "deepspeed" and zero_stage == 2:
            fixes.append("shard the weights too (trainer.options.zero_stage = 3)")
        fixes.append("add trainer ranks on other GPUs (cluster.trainer_ranks: the state is "
                     "sharded over them)")  # fmt: skip
        if config.loss.kl_coef > 0 and not reference_offload:
            fixes.append("keep the KL reference in host memory "
                         "(trainer.options.reference_offload = true)")  # fmt: skip
    state = sum(b for _, b in parts)
    parts.append(("working memory (estimated)", int(state * WORKING_SHARE)))
    tokens = micro_batch_tokens(config, shape.longest_sequence)
    itemsize = 2 if bf16 or (lora.enabled and config.model.itemsize == 2) else 4
    activations = activation_bytes(shape, tokens, itemsize=itemsize, checkpointing=checkpointing,
                                   float32_adapter=lora.enabled and not bf16)  # fmt: skip
    if activations:
        parts.append((f"activations of {tokens:,} tokens (estimated)", activations))
        if activations > state // 4:
            fixes.append("a smaller micro-batch (trainer.max_tokens_per_micro_batch, or "
                         "trainer.micro_batch_size)")  # fmt: skip
            if not checkpointing:
                fixes.append("recompute activations in the backward "
                             "(trainer.options.activation_checkpointing = true)")  # fmt: skip
    return MemoryNeed(tuple(parts), tuple(fixes), movable=movable, transient=activations)
