"""Drives the fsdp2 backend under ``torchrun --nproc-per-node 2`` (gloo, CPU).

Usage: ``torchrun --standalone --nproc-per-node 2 _fsdp_driver.py MODEL_DIR OUT_DIR``.
Each rank writes ``OUT_DIR/rank{r}.json``; rank 0 also runs the single-process float64
reference (plain transformers + torch, no FSDP, one sequence at a time) and records the
differences. ``test_fsdp_backend.py`` asserts on the files.

Three backends run one after the other in the same processes:

A  env:// rendezvous, AdamW, clipping, float32 export; error paths; a step streamed as three
   uneven chunks (a rank with no sequences in one chunk), a discarded step, a one-chunk step.
B  ``dist_store`` rendezvous, plain SGD without clipping (the update is linear in the
   gradient, so weight deltas check the normalized gradient element by element),
   ``proximal_policy = "current"`` (truncated IS weights active).
C  bf16 mixed precision and bf16 export.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.backend import WorkerContext
from asyncrl.config import from_dict
from asyncrl.wire.messages import TokenBatch, TrainBatch
from asyncrl.registry import load

TEMPERATURE = 0.7
LOSS = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "is_cap": 2.0}
MICRO_BATCH_SIZE = 2
NUM_SEQUENCES = 16
# step 0 arrives as three chunks: per chunk, the sequence ids of rank 0 and of rank 1
STEP0_CHUNKS = [([0, 1, 2], [3]), ([], [4, 5, 6, 7, 15]), ([8, 9], [10])]
STEP1_CHUNKS = [([11, 12, 13], [14, 0])]
ADAMW = {"lr": 2e-3, "weight_decay": 0.01, "eps": 1e-6, "max_grad_norm": 0.5}
SGD = {"optimizer": "sgd", "lr": 1.0, "max_grad_norm": 0.0, "proximal_policy": "current"}


# --------------------------------------------------------------------------- data
def make_sequences(vocab_size: int) -> list[dict]:
    """Random sequences (same on every rank); sequence 5 has no response token."""
    rng = np.random.default_rng(1234)
    seqs = []
    for i in range(NUM_SEQUENCES):
        prompt_len = int(rng.integers(1, 7))
        response_len = 0 if i == 5 else int(rng.integers(1, 9))
        tokens = rng.integers(4, vocab_size, size=prompt_len + response_len).astype(np.int32)
        seqs.append({"tokens": tokens, "prompt_len": prompt_len})
    return seqs


def attach_behaviour(seqs: list[dict], ref_logprobs: list[torch.Tensor]) -> None:
    """"Generator" logprobs: the true ones plus noise, so ratios clip and IS weights cap."""
    rng = np.random.default_rng(99)
    for seq, lp in zip(seqs, ref_logprobs):
        noise = rng.normal(0.0, 0.5, size=len(lp))
        seq["behaviour"] = (lp.numpy() + noise).astype(np.float32)
        seq["advantage"] = np.float32(rng.normal())


def token_batch(seqs: list[dict], ids: list[int]) -> TokenBatch:
    chosen = [seqs[i] for i in ids]
    return TokenBatch(
        tokens=np.concatenate([s["tokens"] for s in chosen] or [np.zeros(0, np.int32)]),
        seq_lens=np.array([len(s["tokens"]) for s in chosen], dtype=np.int32),
        prompt_lens=np.array([s["prompt_len"] for s in chosen], dtype=np.int32),
    )


def train_batch(seqs: list[dict], ids: list[int]) -> TrainBatch:
    tb = token_batch(seqs, ids)
    chosen = [seqs[i] for i in ids]
    return TrainBatch(
        tokens=tb.tokens,
        seq_lens=tb.seq_lens,
        prompt_lens=tb.prompt_lens,
        behaviour_logprobs=np.concatenate(
            [s["behaviour"] for s in chosen] or [np.zeros(0, np.float32)]
        ),
        advantages=np.array([s["advantage"] for s in chosen], dtype=np.float32),
        loss_mask=np.ones(num_response_tokens(seqs, ids), np.uint8),
    )


def num_response_tokens(seqs: list[dict], ids: list[int]) -> int:
    return sum(len(seqs[i]["tokens"]) - seqs[i]["prompt_len"] for i in ids)


# --------------------------------------------------------------------------- reference
class Reference:
    """One big batch, float64, plain transformers model, one sequence per forward."""

    def __init__(self, model_dir: str, options: dict) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float64, attn_implementation="eager"
        )
        self.options = options
        params = list(self.model.parameters())
        if options.get("optimizer") == "sgd":
            self.opt = torch.optim.SGD(params, lr=options["lr"])
        else:
            self.opt = torch.optim.AdamW(
                params, lr=options["lr"], eps=options["eps"], weight_decay=options["weight_decay"]
            )

    def logprobs(self, seq: dict) -> torch.Tensor:
        tokens = torch.tensor(seq["tokens"], dtype=torch.long)
        logits = self.model(input_ids=tokens[None]).logits[0]
        out = [
            torch.log_softmax(logits[p - 1] / TEMPERATURE, dim=-1)[tokens[p]]
            for p in range(seq["prompt_len"], len(tokens))
        ]
        return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)

    def step(self, seqs: list[dict]) -> dict:
        self.model.train()
        self.opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        n_tokens = sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
        clipped = capped = 0
        weight_sum = 0.0
        for seq in seqs:
            lp = self.logprobs(seq)
            beh = torch.tensor(seq["behaviour"], dtype=torch.float64)
            adv = float(seq["advantage"])
            prox = lp.detach() if self.options.get("proximal_policy") == "current" else beh
            w = torch.clamp(torch.exp(prox - beh), max=LOSS["is_cap"])
            r = torch.exp(lp - prox)
            lo, hi = 1 - LOSS["clip_eps_low"], 1 + LOSS["clip_eps_high"]
            total = total - (w * torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)).sum()
            clipped += int(((r > hi) & (adv > 0)).sum() + ((r < lo) & (adv < 0)).sum())
            weight_sum += float(w.sum())
            capped += int((torch.exp(prox - beh) > LOSS["is_cap"]).sum())
        loss = total / n_tokens
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = math.sqrt(sum(float((p.grad**2).sum()) for p in params))
        max_norm = self.options.get("max_grad_norm", 1.0)
        if max_norm > 0:
            coef = min(1.0, max_norm / (grad_norm + 1e-6))  # torch's clip_grad_norm_ rule
            for p in params:
                p.grad.mul_(coef)
        self.opt.step()
        return {
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "num_tokens": n_tokens,
            "clipped": clipped,
            "is_weight_sum": weight_sum,
            "capped": capped,
        }

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}


# --------------------------------------------------------------------------- helpers
def make_backend(model_dir: str, run_dir: str, *, export_dtype: str, options: dict, extra: dict):
    options = dict(options)  # proximal_policy is [loss]'s; the Reference reads it from here
    proximal = options.pop("proximal_policy", "behaviour")
    config = from_dict(
        {
            "model": {"path": model_dir, "dtype": export_dtype},
            "environment": {"name": "arithmetic"},
            "grpo": {"temperature": TEMPERATURE},
            "loss": {**LOSS, "proximal_policy": proximal},
            "trainer": {"micro_batch_size": MICRO_BATCH_SIZE, "options": options},
        }
    )
    ctx = WorkerContext(
        group="trainer",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        config=config,
        run_dir=run_dir,
        extra=extra,
    )
    return load("asyncrl.training_backends", "fsdp2")(ctx)


def gather_weights(backend, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Full weights (rank 0) as CPU torch tensors, each copied out before the iterator moves on
    (a yielded tensor may alias its FSDP unit's gathered memory)."""
    out, info = {}, {"names": [], "dtypes": set(), "data_is_none": [], "contiguous": True}
    specs = backend.weight_specs()
    shapes = []
    for wt in backend.iter_weights():
        info["names"].append(wt.name)
        info["dtypes"].add(wt.dtype)
        info["data_is_none"].append(wt.data is None)
        shapes.append(list(wt.shape))
        if wt.data is None:
            continue
        info["contiguous"] &= wt.data.is_contiguous() and str(wt.data.dtype) == f"torch.{wt.dtype}"
        out[wt.name] = wt.data.detach().to("cpu", copy=True).reshape(wt.shape)
    info["specs_match"] = [(t.name, t.dtype, list(t.shape)) for t in specs] == [
        (n, d, s) for n, d, s in zip(info["names"], [specs[0].dtype] * len(shapes), shapes)
    ] and all(t.data is None for t in specs)
    info["dtypes"] = sorted(info["dtypes"])
    return out, info


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def expect_error(fn, record: dict, key: str) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        record[key] = {"type": type(exc).__name__, "message": str(exc)}
    else:
        record[key] = None


def run_step(backend, step: int, seqs: list[dict], chunks, rank: int, *, begin=True) -> dict:
    """Stream ``chunks`` (this rank's share of each) into step ``step`` and finish it."""
    if begin:
        backend.begin_step(step)
    results = [backend.train_chunk(step, train_batch(seqs, chunk[rank])) for chunk in chunks]
    result = backend.finish_step(step, num_response_tokens(seqs, step_ids(chunks)))
    fields = ("num_sequences", "num_loss_tokens", "loss_sum", "clipped_tokens",
              "is_weight_sum", "abs_logprob_diff_sum")
    return {
        "step": result.step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "num_loss_tokens": result.num_loss_tokens,
        "lr": result.lr,
        "seconds": result.seconds,
        "chunks": [{f: getattr(r, f) for f in fields} for r in results],
    }


def step_ids(chunks) -> list[int]:
    return [i for c in chunks for i in c[0] + c[1]]


# --------------------------------------------------------------------------- scenarios
def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    t_start = time.monotonic()
    rec: dict = {"rank": rank}

    from safetensors.torch import load_file

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    probe = Reference(model_dir, {"lr": 1.0, "optimizer": "sgd"})
    vocab = probe.model.config.vocab_size
    seqs = make_sequences(vocab)
    with torch.no_grad():
        ref_lp0 = [probe.logprobs(s) for s in seqs]
    attach_behaviour(seqs, ref_lp0)
    del probe
    rec["timing_setup_s"] = time.monotonic() - t_start

    # ---- backend A
    t0 = time.monotonic()
    a = make_backend(model_dir, str(out_dir), export_dtype="float32", options=ADAMW, extra={})
    rec["A_caps"] = a.start()
    rec["timing_A_start_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    w0, info = gather_weights(a, rank)
    rec["timing_iter_weights_s"] = time.monotonic() - t0
    rec["A_weights_info"] = info
    if rank == 0:
        rec["A_w0_names_equal_checkpoint"] = sorted(w0) == sorted(checkpoint)
        rec["A_w0_vs_checkpoint_max_abs"] = max_diff(w0, checkpoint)

    # compute_logprobs: uneven shares, one rank empty, then the other way round
    lp_diffs = []
    for share in (([0, 1, 2, 3, 4], []), ([5], list(range(6, 16)))):
        got = a.compute_logprobs(token_batch(seqs, share[rank]), TEMPERATURE)
        want = torch.cat([ref_lp0[i] for i in share[rank]] or [torch.zeros(0)]).numpy()
        assert got.dtype == np.float32 and got.shape == want.shape, (got.shape, want.shape)
        lp_diffs.append(float(np.abs(got - want).max()) if len(got) else 0.0)
    rec["A_logprobs_max_abs"] = max(lp_diffs)

    # error paths (every rank sees the same calls, so every rank must raise the same)
    errs: dict = {}
    some = train_batch(seqs, [0])
    expect_error(lambda: a.train_chunk(0, some), errs, "chunk_without_step")
    expect_error(lambda: a.finish_step(0, 5), errs, "finish_without_step")
    a.begin_step(0)
    expect_error(lambda: a.begin_step(1), errs, "second_begin")
    expect_error(lambda: a.train_chunk(7, some), errs, "wrong_step_id")
    bad = train_batch(seqs, [1, 2])
    if rank == 1:  # malformed on rank 1 only: behaviour logprobs one short
        bad = TrainBatch(bad.tokens, bad.seq_lens, bad.prompt_lens,
                         bad.behaviour_logprobs[:-1], bad.advantages, bad.loss_mask)
    expect_error(lambda: a.train_chunk(0, bad), errs, "malformed_on_rank1")
    expect_error(lambda: a.compute_logprobs(token_batch(seqs, [0]), 0.0), errs, "zero_temperature")
    rec["A_errors"] = errs

    # step 0, streamed into the step opened above (it survived the refused calls)
    rec["A_step0"] = run_step(a, 0, seqs, STEP0_CHUNKS, rank, begin=False)
    w1, _ = gather_weights(a, rank)

    # step 1 with a wrong token count: refused, discarded, weights unchanged
    a.begin_step(1)
    a.train_chunk(1, train_batch(seqs, STEP1_CHUNKS[0][rank]))
    n1 = num_response_tokens(seqs, step_ids(STEP1_CHUNKS))
    expect_error(lambda: a.finish_step(1, n1 + 1), errs, "wrong_num_loss_tokens")
    w1b, _ = gather_weights(a, rank)
    if rank == 0:
        rec["A_discarded_step_changed_weights"] = max_diff(w1, w1b)
    # a refit abandoned after three tensors (kept referenced, not closed) must not change
    # how the next step trains: grad mode is thread-local
    abandoned = a.iter_weights()
    for _ in range(3):
        next(abandoned)
    rec["A_step1"] = run_step(a, 1, seqs, STEP1_CHUNKS, rank)
    del abandoned
    w2, _ = gather_weights(a, rank)
    own = {n: p.full_tensor() for n, p in a._module.named_parameters()}  # noqa: SLF001
    if rank == 0:
        rec["A_w2_vs_own_params_max_abs"] = max_diff(w2, own)
    a.close()
    a.close()
    expect_error(lambda: a.begin_step(2), errs, "after_close")
    rec["A_pg_destroyed"] = not dist.is_initialized()

    # ---- backend B: dist_store rendezvous, SGD, proximal = current
    t0 = time.monotonic()
    store = dist.FileStore(str(out_dir / "store_b"), 2)
    b = make_backend(model_dir, str(out_dir), export_dtype="float32", options=SGD,
                     extra={"dist_store": store})
    b.start()
    rec["timing_B_start_s"] = time.monotonic() - t0
    bw0, _ = gather_weights(b, rank)
    rec["B_step0"] = run_step(b, 0, seqs, STEP0_CHUNKS, rank)
    bw1, _ = gather_weights(b, rank)
    b.close()

    # ---- backend C: bf16 compute, bf16 export
    store = dist.FileStore(str(out_dir / "store_c"), 2)
    c = make_backend(model_dir, str(out_dir), export_dtype="bfloat16",
                     options={"mixed_precision": "bf16"}, extra={"dist_store": store})
    c.start()
    cw0, cinfo = gather_weights(c, rank)
    rec["C_weights_info"] = cinfo
    got = c.compute_logprobs(token_batch(seqs, list(range(8 * rank, 8 * rank + 8))), TEMPERATURE)
    want = torch.cat([ref_lp0[i] for i in range(8 * rank, 8 * rank + 8)]).numpy()
    rec["C_logprobs_max_abs"] = float(np.abs(got - want).max())
    rec["C_step0"] = run_step(c, 0, seqs, STEP0_CHUNKS, rank)
    c.close()
    rec["timing_backends_total_s"] = time.monotonic() - t_start

    # ---- rank 0: references
    if rank == 0:
        t0 = time.monotonic()
        bf16 = {k: v.to(torch.bfloat16) for k, v in checkpoint.items()}
        rec["C_w0_equals_checkpoint_bf16"] = sorted(cw0) == sorted(bf16) and all(
            torch.equal(cw0[k], bf16[k]) for k in bf16
        )

        ref = Reference(model_dir, ADAMW)
        rec["A_ref_step0"] = ref.step([seqs[i] for i in step_ids(STEP0_CHUNKS)])
        rec["A_w1_vs_ref_max_abs"] = max_diff(w1, ref.weights())
        rec["A_update1_max_abs"] = max_diff(w1, w0)
        rec["A_ref_step1"] = ref.step([seqs[i] for i in step_ids(STEP1_CHUNKS)])
        rec["A_w2_vs_ref_max_abs"] = max_diff(w2, ref.weights())

        ref = Reference(model_dir, SGD)
        rec["B_ref_step0"] = ref.step([seqs[i] for i in step_ids(STEP0_CHUNKS)])
        ref_w = ref.weights()
        ref_delta = {k: ref_w[k] - checkpoint[k].double() for k in ref_w}
        delta = {k: bw1[k].double() - bw0[k].double() for k in bw1}
        rec["B_delta_vs_ref_max_abs"] = max_diff(delta, ref_delta)
        rec["B_ref_delta_max_abs"] = max(float(v.abs().max()) for v in ref_delta.values())
        rec["timing_reference_s"] = time.monotonic() - t0

    rec["timing_total_s"] = time.monotonic() - t_start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rec, indent=1, default=str))


def solo() -> None:
    """One rank (no unit is gathered: ``iter_weights`` reads the local shards): the exported
    weights equal the checkpoint (float32, and rounded to bf16) and, after a step, the live
    parameters, bit for bit; the names and shapes are the specs'."""
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    rec: dict = {}
    a = make_backend(model_dir, str(out_dir), export_dtype="float32", options=ADAMW, extra={})
    a.start()
    w0, info = gather_weights(a, 0)
    rec["weights_info"] = info
    rec["w0_vs_checkpoint_max_abs"] = max_diff(w0, checkpoint)
    seqs = make_sequences(len(load_file(os.path.join(model_dir, "model.safetensors"))
                              ["model.embed_tokens.weight"]))
    probe = Reference(model_dir, ADAMW)
    with torch.no_grad():
        attach_behaviour(seqs, [probe.logprobs(s) for s in seqs])
    run_step(a, 0, seqs, [(c[0] + c[1], []) for c in STEP0_CHUNKS], 0)  # both shares
    w1, _ = gather_weights(a, 0)
    live = {n: p.full_tensor().detach().cpu() for n, p in a._module.named_parameters()}
    rec["w1_vs_live_max_abs"] = max_diff(w1, live)
    rec["w1_moved"] = max_diff(w1, w0) > 0
    a.close()
    c = make_backend(model_dir, str(out_dir), export_dtype="bfloat16",
                     options={"mixed_precision": "bf16"}, extra={})
    c.start()
    cw0, cinfo = gather_weights(c, 0)
    c.close()
    rec["bf16_dtypes"] = cinfo["dtypes"]
    rec["bf16_equals_checkpoint"] = all(
        torch.equal(cw0[k], v.to(torch.bfloat16)) for k, v in checkpoint.items()
    )
    (out_dir / "solo.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    try:
        solo() if sys.argv[3:] == ["solo"] else main()
    except BaseException:
        traceback.print_exc()
        raise
