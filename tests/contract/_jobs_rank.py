"""One trainer rank of tests/contract/test_trainer_jobs.py (run under torchrun): the fsdp2
backend with job slots, driven through the backend's own API, its adapters saved by rank 0."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def main(spec_path: str) -> None:
    from asyncrl.plugin.backend import WorkerContext
    from asyncrl.plugin.common import from_dict, load
    from asyncrl_torch.contract.rank import _leave_together as leave_together
    from asyncrl_torch.contract.rank import contract_sequences, train_batch

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = from_dict(spec["config"])
    ctx = WorkerContext("trainer", rank, world, int(os.environ["LOCAL_RANK"]), config,
                        spec["out"])  # fmt: skip
    backend = load("asyncrl.training_backends", "fsdp2")(ctx)
    backend.start()
    seqs = contract_sequences(int(spec["vocab_size"]))
    n = len(seqs)
    rng = np.random.default_rng(5)
    responses = sum(len(t) - p for t, p in seqs)
    behaviour = (-2.0 + 0.3 * rng.normal(size=responses)).astype(np.float32)
    adv = {job: np.random.default_rng(seed).normal(size=n).astype(np.float32)
           for job, seed in (("a", 11), ("b", 12))}  # fmt: skip
    out: dict[str, list] = {"results": []}
    for job, seed, lr in spec["open"]:
        backend.open_job(job, seed=seed, lr=lr)

    def tokens(ids: list[int]) -> int:
        return int(sum(len(seqs[i][0]) - seqs[i][1] for i in ids))

    open_steps: dict[str, list[list[int]]] = {}
    for op in spec["ops"]:  # ["begin", job, step] / ["chunk", job, step, ids] / ["finish", ...]
        kind, job, step = op[0], op[1], op[2]  # / ["save" or "load", job, directory]
        if kind in ("save", "load"):
            method = backend.save_state if kind == "save" else backend.load_state
            method(str(Path(spec["out"]) / step), job=job)
        elif kind == "begin":
            backend.begin_step(step, job=job)
            open_steps[job] = []
        elif kind == "chunk":
            ids = op[3]
            mine = ids[rank::world]
            backend.train_chunk(step, train_batch(seqs, mine, behaviour, adv[job]), job=job)
            open_steps[job].append(ids)
        else:
            total = sum(tokens(ids) for ids in open_steps.pop(job))
            res = backend.finish_step(step, total, job=job)
            out["results"].append([job, step, res.loss, res.grad_norm, res.lr])
    adapters = {}
    for job in ["", *(j for j, _, _ in spec["open"])]:
        specs = backend.weight_specs(job=job)
        tensors = {w.name: w.data.float().cpu().numpy() for w in backend.iter_weights(job=job)
                   if w.data is not None}  # fmt: skip
        adapters[job or "run"] = tensors
        out.setdefault("names", {})[job or "run"] = [w.name for w in specs]
    if rank == 0:
        for job, tensors in adapters.items():
            np.savez(Path(spec["out"]) / f"{spec['tag']}-{job}.npz", **tensors)
        Path(spec["out"], f"{spec['tag']}.json").write_text(json.dumps(out))
    leave_together()  # as the contract's ranks do: see there why
    backend.close()


if __name__ == "__main__":
    from asyncrl_torch.contract.rank import _exit_now as exit_now

    main(sys.argv[1])
    exit_now(0)  # the results are on disk: no interpreter teardown (gloo's can abort)
