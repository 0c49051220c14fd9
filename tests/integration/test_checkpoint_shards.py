"""A flipped block in a real trainer shard is refused on resume, before anything loads it.

The issue: 4 KiB flipped in the middle of FSDP2's ``trainer/__0_0.distcp`` resumed without an
error, into NaN weights. Here the trainer's part of a checkpoint is written by the real
backend (FSDP2's torch distributed checkpoint; DeepSpeed ZeRO-2's model and optimizer files)
under torchrun with one rank, after one optimizer step (``_save_state_driver.py``: ~25 s per
backend on a 2-core host, the cheapest way to a real shard), and committed with
:func:`asyncrl.checkpoints.directory.commit` as the checkpointer does. The resume goes through the
embedded controller, whose check comes before any worker exists (the generator is the bigram
one: nothing of it starts).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("asyncrl_arith", reason="pip install -e plugins/asyncrl-arith")
pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.checkpoints import directory as ckpt  # noqa: E402
from asyncrl.checkpoints.saving import open_resume, run_fingerprints  # noqa: E402
from asyncrl.config import from_dict, to_dict  # noqa: E402
from asyncrl.run.preflight import make_environment  # noqa: E402
from integration_support import run_torchrun_driver  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

DRIVER = Path(__file__).with_name("_save_state_driver.py")
BLOCK = 4096
BACKENDS = {
    "fsdp2": ("fsdp2", {}),
    "deepspeed-zero2": ("deepspeed", {"zero_stage": 2}),
}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("shards") / "model", seed=0)


def _write_trainer_state(spec: dict, tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    run_torchrun_driver(DRIVER, [str(spec_path)], ranks=1)


@pytest.mark.parametrize("name", sorted(BACKENDS))
async def test_a_flipped_block_in_a_trainer_shard_is_refused_on_resume(
    name: str, qwen_dir: Path, tmp_path: Path
) -> None:
    backend, options = BACKENDS[name]
    for module in {"fsdp2": ("asyncrl_fsdp",), "deepspeed": ("asyncrl_deepspeed", "deepspeed")}[
        backend
    ]:  # looked up, not imported (deepspeed's import is slow and noisy)
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    cfg = from_dict({
        "model": {"path": str(qwen_dir)},
        "environment": {"name": "arithmetic"},
        "run": {"output_dir": str(tmp_path / "run"), "num_steps": 4},
        "trainer": {"backend": backend, "micro_batch_size": 2,
                    "options": {"num_threads": 1, **options}},
        "generator": {"backend": "bigram"},
        "eval": {"num_prompts": 0},
    })  # fmt: skip
    tmp = ckpt.start_save(cfg.checkpoint.dir, 1)
    vocab_size = json.loads((qwen_dir / "config.json").read_text())["vocab_size"]
    _write_trainer_state(
        {"config": to_dict(cfg), "vocab_size": vocab_size, "run_dir": str(tmp_path),
         "trainer_dir": str(tmp / ckpt.TRAINER_DIR), "model_dir": str(tmp / ckpt.MODEL_DIR)},
        tmp_path,
    )  # fmt: skip
    prompts = make_environment(cfg).dataset("train")
    state = ckpt.ControllerState(step=1, finished=False, scheduler={}, groups=[])
    path = ckpt.commit(
        tmp, state=ckpt.encode_state(state), step=1, finished=False,
        config=to_dict(cfg), fingerprints=run_fingerprints(cfg, prompts),
        has_model=True,
    )  # fmt: skip
    shards = sorted(
        (p for p in (path / ckpt.TRAINER_DIR).rglob("*") if p.is_file() and p.suffix != ".py"),
        key=lambda p: p.stat().st_size,
    )
    shard = shards[-1]  # the largest: FSDP2's __0_0.distcp, DeepSpeed's optimizer states
    rel = str(shard.relative_to(path))
    if backend == "fsdp2":
        assert rel == "trainer/__0_0.distcp"
    else:
        assert re.fullmatch(r"trainer/.+/zero_pp_rank_0_mp_rank_00_optim_states\.pt", rel), rel
    assert rel in ckpt.open_checkpoint(path).manifest["files"]
    # intact, the same checkpoint passes every check of a resume
    resume = open_resume(cfg, "latest", train_prompts=prompts)
    assert resume is not None and resume.checkpoint.path == path

    # 4 KiB flipped in the middle of the shard, as the issue did
    data = bytearray(shard.read_bytes())
    start = len(data) // 2
    data[start : start + BLOCK] = bytes(b ^ 0xFF for b in data[start : start + BLOCK])
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"checkpoint {re.escape(str(path))} is corrupt: {re.escape(rel)} does not match "
        r"its sha256 in the manifest\. Fix: start the run again without --resume$",
    ):
        async with asyncrl.Controller(cfg, resume="latest"):
            pass
    assert not (Path(cfg.run.output_dir) / "metrics.jsonl").exists()  # nothing was started

