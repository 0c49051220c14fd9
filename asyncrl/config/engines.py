"""``[refit]``, ``[trainer]`` and ``[generator]``: the two engines and how weights move
between them.

The backends' and the weight transfer's own options stay opaque here; each plugin checks its
own (``asyncrl run``'s preflight). Each section's checks sit with it;
:func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

from typing import Any

from asyncrl import registry
from asyncrl.config.section import Section, at_least_one, fail, not_negative
from asyncrl.errors import ConfigError

__all__ = ["DRAIN_TIMEOUT_S", "GeneratorConfig", "RefitConfig", "TrainerConfig"]


DRAIN_TIMEOUT_S = 60.0
"""With ``refit.drain``: the longest a drain before a refit waits for the samples in flight;
after it the refit goes ahead with what is still running (counted in the step's
``drain_timeouts``). A sample of ``grpo.max_new_tokens`` finishes in seconds on a serving
engine; a minute only cuts off a stuck one. Once the config key ``refit.drain_timeout_s``
(issue 50)."""


class RefitConfig(Section):
    transport: str = "shm"
    """How weights travel to the generators: a weight transfer plugin (entry point group
    ``asyncrl.weight_transfers``). ``shm``: buckets in shared-memory files (one host, any
    device). ``cuda_ipc``: buckets in the trainer's GPU memory, mapped by the engine through
    CUDA IPC handles (one node; trainer and engine on the same GPU or on different ones).
    ``nccl``: each bucket broadcast over a collective group of the trainer and the engines
    (NCCL between GPUs, e.g. engines on other GPUs without IPC; gloo when the trainer is on
    the CPU). Buckets are announced over ZeroMQ (ipc://, or tcp:// with
    ``cluster.network = "tcp"``). Change it for GPUs (``cuda_ipc`` on one node, ``nccl``
    across nodes) or when ``/dev/shm`` is too small for the model."""
    bucket_size_mb: int = 1024
    """Size of one transfer bucket; tensors larger than this travel in a bucket of their own.
    Every bucket costs a round of messages between trainer, rollout worker and engine (~0.9 ms
    on an H200 host): a 7B refit took 40 ms in 1 GiB buckets and 120 ms in 256 MiB ones, and
    26 ms in 4 GiB ones (docs/refit.md). The trainer keeps 2 staging buffers
    (``asyncrl.transfers.STAGING_BUFFERS``), each at most this large (smaller for a small
    model). Lower it when the trainer's device (or ``/dev/shm`` with ``shm``) has no room for
    two buckets; raise it where memory is plentiful and refits of a large model should be
    faster."""
    drain: bool = False
    """Before each refit, stop dispatching and wait for every sample in flight to finish
    (for a minute at most: ``DRAIN_TIMEOUT_S``), so no sample is generated
    by two weight versions (slower: generation idles while the last samples finish). Without
    it, samples in flight continue across the weight update (their per-token logprobs say
    which version produced each token). Turn it on when every sample must come from one
    weight version."""
    timeout_s: float = 300.0
    """Upper bound on one bucket hand-off between trainer and generator; past it the refit
    fails. Raise it only for a transfer that legitimately takes longer per bucket (a slow
    link between nodes)."""
    verify_every_steps: int = 10
    """Verify the first refits (``asyncrl.policy.verify.VERIFY_FIRST_STEPS``, 3) and then
    every this many weight versions: right after the refit, the generators and the trainer
    score a fixed probe batch (sequences of the first trained step) and the run stops with a
    ``RefitError`` if they disagree far beyond what they did before any update (the margins:
    ``asyncrl.policy.verify``; docs/refit.md, 'Refit verification'). ``0``: no verification at
    all, not even the baseline (a benchmark, or a model whose two sides disagree by more than
    the check allows). Lower it (1: every refit) while bringing up a new backend or transfer;
    0 saves the probe's forwards."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[refit]``, and whether its transport is installed."""
        out = at_least_one({"refit.bucket_size_mb": self.bucket_size_mb})
        transfers = registry.available("asyncrl.weight_transfers")
        if self.transport not in transfers:
            out.append(
                fail(
                    "refit.transport",
                    f"no weight transfer named {self.transport!r} is installed",
                    f"use one of: {', '.join(sorted(transfers)) or 'none (reinstall asyncrl)'}",
                )
            )
        return out + not_negative({"refit.verify_every_steps": self.verify_every_steps})


class TrainerConfig(Section):
    backend: str = "fsdp2"
    """Training backend (entry point group ``asyncrl.training_backends``): ``fsdp2``,
    ``deepspeed``, or ``frozen`` (the model's weights served unchanged: a generation-only
    run through the whole pipeline, docs/backends/fsdp.md). Change it to train with DeepSpeed,
    or to serve the model unchanged."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank (when ``max_tokens_per_micro_batch`` is 0).
    Lower it when a forward/backward runs out of memory; raise it to use the device better."""
    max_tokens_per_micro_batch: int = 0
    """Cut micro-batches by tokens instead: each rank sorts its sequences by length and packs
    as many into a forward as fit ``count x longest <= max_tokens_per_micro_batch`` (a longer
    sequence goes alone); ``micro_batch_size`` is then not used. For long-tailed lengths
    this removes the padding a few long samples force on fixed-size micro-batches. The
    gradient is the same (only the order of a sum changes). With ``pack_sequences`` the
    sequences keep their order and their lengths are summed instead. 0: off. Set it when
    completion lengths vary a lot."""
    pack_sequences: bool = False
    """With ``max_tokens_per_micro_batch``: lay each micro-batch's sequences end to end in
    one row of at most that many tokens, positions starting again at 0 for each, instead of
    padding them (no sorting, no padding at all). The model's attention must honour the
    sequence boundaries that the positions mark (transformers does for sdpa, eager, flex and
    flash attention); the trainer checks at start that a packed row gives the logprobs its
    sequences give one by one, and refuses to start otherwise. Turn it on to remove the padding
    altogether."""
    options: dict[str, Any] = {}
    """Backend-specific options, validated by the backend. Set the optimizer, learning rate and
    parallelism there (docs/backends/)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[trainer]`` (the backend checks its ``options``)."""
        problems = at_least_one({"trainer.micro_batch_size": self.micro_batch_size})
        problems += not_negative(
            {"trainer.max_tokens_per_micro_batch": self.max_tokens_per_micro_batch},
            "use 0 to cut micro-batches by trainer.micro_batch_size sequences",
        )
        if self.pack_sequences and self.max_tokens_per_micro_batch == 0:
            problems.append(fail(
                "trainer.pack_sequences", "packs rows of trainer.max_tokens_per_micro_batch "
                "tokens, which is 0 (off)", "set trainer.max_tokens_per_micro_batch, e.g. "
                "8192, or pack_sequences = false",
            ))  # fmt: skip
        return problems


class GeneratorConfig(Section):
    backend: str = "vllm"
    """Generation backend (entry point group ``asyncrl.generation_backends``). Change it for
    another engine plugin (``bigram`` is the example backend's, for tests)."""
    options: dict[str, Any] = {}
    """Backend-specific options, validated by the backend. Set the engine's own settings there
    (vLLM: memory, context, quantization...; docs/backends/vllm.md)."""

    def problems(self) -> list[ConfigError]:
        """None: the backend checks its ``options`` (``asyncrl run``'s preflight)."""
        return []
