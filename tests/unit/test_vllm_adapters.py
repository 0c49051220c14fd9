"""The vLLM backend's ``[lora]`` logic without vLLM: the manifest check, the engine's LoRA
arguments, the config refusals, and the refit's calls into the workers (a recording worker
that keeps the registered adapters as vLLM's manager would, and fails as told)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncrl.config import from_dict
from asyncrl.errors import ConfigError, RefitError
from asyncrl.policy.adapter_leases import AdapterError
from asyncrl.wire.messages import TensorEntry
from asyncrl_vllm.adapters import (
    EngineAdapters,
    adapter_manifest_problems,
    check_adapter_config,
    lora_engine_args,
)
from asyncrl_vllm.options import parse_options

SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": [64, 64],
    "model.layers.0.self_attn.v_proj.weight": [32, 64],
    "model.layers.0.mlp.down_proj.weight": [64, 160],
    "model.layers.0.input_layernorm.weight": [64],
    "model.embed_tokens.weight": [8, 64],
}
TARGETS = ("q_proj", "v_proj", "down_proj")


def manifest(rank: int = 4, dtype: str = "bfloat16") -> list[TensorEntry]:
    out = []
    for name, (o, i) in ((n, s) for n, s in SHAPES.items() if n.endswith("proj.weight")):
        module = "base_model.model." + name.removesuffix(".weight")
        out.append(TensorEntry(f"{module}.lora_A.weight", dtype, [rank, i], 0, 0))
        out.append(TensorEntry(f"{module}.lora_B.weight", dtype, [o, rank], 0, 0))
    return out


def test_an_adapter_manifest_of_the_models_targets_fits() -> None:
    assert adapter_manifest_problems(manifest(), SHAPES, rank=4, targets=TARGETS,
                                     dtype="bfloat16") == []  # fmt: skip


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        (manifest(rank=8), "wrong shape: base_model.model.model.layers.0.self_attn.q_proj.lora_A"),
        (manifest(dtype="float32"), "not bfloat16"),
        (manifest()[1:], "missing from the refit: base_model.model.model.layers.0.self_attn.q_proj"),
        ([*manifest(), TensorEntry("base_model.model.lm_head.lora_A.weight", "bfloat16", [4, 64],
                                   0, 0)], "not a LoRA tensor of a target module: "),  # fmt: skip
        ([TensorEntry("model.layers.0.self_attn.q_proj.weight", "bfloat16", [64, 64], 0, 0)],
         "not a LoRA tensor"),  # a full-weight refit sent to an adapter engine
    ],
)
def test_each_wrong_manifest_is_named(entries: list[TensorEntry], problem: str) -> None:
    found = adapter_manifest_problems(entries, SHAPES, rank=4, targets=TARGETS, dtype="bfloat16")
    assert any(problem in p for p in found), found


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 8}))
    (d / "tokenizer.json").write_text("{}")
    return d


def config(model_dir: Path, rank: int = 4, **options: Any) -> Any:
    return from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "x"},
        "lora": {"rank": rank, "target_modules": list(TARGETS)},
        "generator": {"options": options},
        "pipeline": {"sampler": {"name": "gated", "max_staleness_versions": 2}},
    })  # fmt: skip


def test_engine_arguments_hold_the_rank_and_the_slots(model_dir: Path) -> None:
    cfg = config(model_dir, rank=20)
    # slots: the staleness bound 2 + 2; one more registered for the version being installed
    assert lora_engine_args(cfg, parse_options({})) == {
        "enable_lora": True, "max_loras": 4, "max_cpu_loras": 5, "max_lora_rank": 32,
    }  # fmt: skip
    assert lora_engine_args(cfg, parse_options({"lora_slots": 7}))["max_loras"] == 7


@pytest.mark.parametrize(
    ("rank", "options", "field"),
    [
        (1024, {}, "lora.rank"),
        (8, {"lora_slots": 1}, "generator.options.lora_slots"),
        (8, {"kv_cache_dtype": "fp8"}, "generator.options.kv_cache_dtype"),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_before_it_starts(
    model_dir: Path, rank: int, options: dict[str, Any], field: str
) -> None:
    cfg = config(model_dir, rank=rank, **options)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_adapter_config(cfg, parse_options(options))


class Worker:
    """What the refit asks of the engine's workers, and a registry of adapter ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.registered: set[int] = set()
        self.staged = 0
        self.refuse = False

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        if method == "asyncrl_stage_adapter":
            transport, handle, entries, first, *install = args
            self.staged = (0 if first else self.staged) + len(entries)
            if install:
                (lora_id, _peft), remove = install
                self.registered -= set(remove)
                if self.refuse:
                    raise ValueError("rank 64 is greater than max_lora_rank 32")
                self.registered.add(lora_id)
                return [{"seconds": 0.001, "staged": self.staged,
                         "added": {"seconds": 0.0005}}]  # fmt: skip
            return [{"seconds": 0.001, "staged": self.staged}]
        if method == "asyncrl_remove_adapters":
            self.registered -= set(args[0])
            return [sorted(self.registered)]
        return [None]


class Bucket:
    def __init__(self, version: int, index: int, entries: list[TensorEntry], last: bool) -> None:
        self.version, self.index, self.entries, self.last = version, index, entries, last
        self.transport, self.handle = "shm", b"h"


class Log:
    def info(self, *a: Any, **k: Any) -> None: ...

    def warning(self, *a: Any, **k: Any) -> None: ...


async def install(adapters: EngineAdapters, version: int, buckets: int = 2) -> None:
    entries = manifest()
    adapters.begin(version, entries, SHAPES)
    for b in range(buckets):
        await adapters.load(Bucket(version, b, entries[b::buckets], b == buckets - 1))
    await adapters.finish(version)


def test_an_adapter_refit_adds_in_the_last_call_and_removes_only_what_nobody_holds(
    model_dir: Path,
) -> None:
    async def main() -> None:
        worker = Worker()
        adapters = EngineAdapters(config(model_dir), parse_options({"lora_slots": 3}),
                                  worker.rpc, Log())  # fmt: skip
        await install(adapters, 1)  # each install gets the next engine id: v1 is 1, v2 is 2...
        assert [m for m, _ in worker.calls] == ["asyncrl_stage_adapter"] * 2
        assert worker.registered == {1} and adapters.leases.versions() == (1,)
        version, request = adapters.lease("a")  # a request holds v1 across the next refits
        assert version == 1 and request.lora_int_id == 1
        await install(adapters, 2)
        assert worker.registered == {1, 2} and adapters.leases.versions() == (1, 2)
        # v2 was the newest at v3's last call (a request could still lease it): let go at
        # the install, removed at the next refit's call
        await install(adapters, 3)
        assert worker.registered == {1, 2, 3} and adapters.leases.versions() == (1, 3)
        await adapters.release("a")  # v1's last request ends: removed at once
        assert worker.registered == {2, 3}
        await install(adapters, 4)
        assert worker.registered == {3, 4} and adapters.leases.versions() == (4,)
        assert len(worker.registered) <= adapters.leases.slots + 1
        assert [m for m, _ in worker.calls].count("asyncrl_stage_adapter") == 8  # 2 per refit

    anyio.run(main)


def test_a_refused_or_partial_adapter_leaves_the_versions_serving(model_dir: Path) -> None:
    async def main() -> None:
        worker = Worker()
        adapters = EngineAdapters(config(model_dir), parse_options({}), worker.rpc, Log())
        await install(adapters, 1)
        worker.refuse = True
        entries = manifest()
        adapters.begin(2, entries, SHAPES)
        with pytest.raises(RefitError, match="the engine refused the adapter of v2: rank 64"):
            await adapters.load(Bucket(2, 0, entries, True))
        await adapters.abort(2)
        assert adapters.leases.versions() == (1,) and worker.registered == {1}
        worker.refuse = False
        adapters.begin(3, entries, SHAPES)  # a bucket never arrives: nothing is added
        with pytest.raises(RefitError, match="arrived only in part"):
            await adapters.load(Bucket(3, 1, entries[1:], True))
        with pytest.raises(RefitError, match="never added"):
            await adapters.finish(3)
        assert adapters.leases.versions() == (1,) and worker.registered == {1}
        assert adapters.lease("b")[0] == 1

    anyio.run(main)


class FrontEnd:
    """vLLM's front end over the recording worker: ``collective_rpc`` answers as the worker
    does, except the adapter's last call while ``wedged`` (the workers register the adapter,
    and the answer never comes); ``abort`` records the request ids."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.wedged, self.aborted = worker, False, []

    async def collective_rpc(self, method: str, timeout: float, args: tuple = ()) -> list:
        answers = await self.worker.rpc(method, *args)
        if self.wedged and method == "asyncrl_stage_adapter" and len(args) > 4:
            await anyio.sleep_forever()
        return answers

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


def lora_backend(model_dir: Path, worker: Worker, rpc_timeout_s: float) -> Any:
    """The vLLM backend's refit path with ``[lora]``, around the recording worker (the
    backend's own ``_rpc``: bounded by ``rpc_timeout_s``)."""
    from types import SimpleNamespace

    from asyncrl_vllm.backend import VLLMBackend
    from asyncrl_vllm.death import EngineDeath
    from asyncrl_vllm.turns import EngineTurn

    b = VLLMBackend.__new__(VLLMBackend)
    cfg = config(model_dir)
    b.ctx, b.options = SimpleNamespace(config=cfg), parse_options({"rpc_timeout_s": rpc_timeout_s})
    b._llm, b._death, b._reaper, b._shapes = FrontEnd(worker), EngineDeath(), None, SHAPES
    b._requests, b._aborted, b._moving, b._log = {}, set(), set(), Log()
    b._inside, b._turn, b.version = {}, EngineTurn(), 0
    b._adapters = EngineAdapters(cfg, b.options, b._rpc, Log())
    return b


async def refit(b: Any, version: int, *, reprefill: bool = False, job: str = "") -> None:
    entries = manifest()
    await b.begin_weight_update(version, entries, job=job)
    await b.load_weight_bucket(Bucket(version, 0, entries, True))
    if reprefill:
        await b.reprefill_in_flight()
    await b.finish_weight_update(version, reset_prefix_cache=True, job=job)


def test_an_adapter_refit_that_times_out_names_the_setting_and_serves_the_old_version(
    model_dir: Path,
) -> None:
    """The last call never answers (the workers did register the adapter): the refit fails
    after ``rpc_timeout_s`` naming that setting, the abort removes what the workers may have
    added, requests go on leasing the old version, and the same version can be installed
    again (a retried refit)."""

    async def main() -> None:
        worker = Worker()
        b = lora_backend(model_dir, worker, rpc_timeout_s=0.2)
        await refit(b, 1)
        b._llm.wedged = True
        await b.begin_weight_update(2, manifest())
        with anyio.fail_after(5), pytest.raises(
            RefitError, match=r"v2: vLLM did not answer collective_rpc\(asyncrl_stage_adapter\) "
            r"within 0.2 s \(generator.options.rpc_timeout_s\)"
        ):  # fmt: skip
            await b.load_weight_bucket(Bucket(2, 0, manifest(), True))
        assert worker.registered == {1, 2}  # added, though the answer never came
        b._llm.wedged = False
        await b.abort_weight_update(2, loaded_any=True)
        assert worker.registered == {1} and b._adapters.leases.versions() == (1,)
        assert b._adapters.lease("r")[0] == 1 and b.version == 1
        await b._adapters.release("r")
        await refit(b, 2)  # under a new engine id: the aborted one is never given again
        assert worker.registered == {1, 3} and b.version == 2  # v1 goes at the next refit

    anyio.run(main)


def test_a_reprefill_refit_moves_only_the_requests_on_older_versions(model_dir: Path) -> None:
    """With ``[lora]``, ``reprefill_in_flight`` moves the requests in flight once the new
    version is installed: the engine aborts those on older versions (a sample aborted by the
    staleness policy stays aborted), and the refit reports how many moved. Outside a refit it
    is refused."""

    async def main() -> None:
        worker = Worker()
        b = lora_backend(model_dir, worker, rpc_timeout_s=5)
        with pytest.raises(RefitError, match="outside a refit"):
            await b.reprefill_in_flight()
        await refit(b, 1)
        for sid in ("g/0", "g/1", "h/0"):  # as _generate_sample leases and tracks them
            b._adapters.lease(sid)
            b._requests.setdefault(sid.split("/")[0], {})[sid] = sid
            b._inside[sid] = (sid, "")  # in the engine (not waiting for a wake)
        b._aborted.add("h/0")
        await refit(b, 2)  # continue: nothing moves
        assert b._llm.aborted == [] and "moved" not in b.last_refit
        b._adapters.lease("g/2")  # started on v2
        b._requests["g"]["g/2"] = "g/2"
        b._inside["g/2"] = ("g/2", "")
        await refit(b, 3, reprefill=True)
        assert sorted(b._llm.aborted) == ["g/0", "g/1", "g/2"]
        assert b._moving == {"g/0", "g/1", "g/2"} and b.last_refit["moved"] == 3

    anyio.run(main)


def test_jobs_share_an_engine_and_each_request_gets_its_own_jobs_adapter(model_dir: Path) -> None:
    """Two jobs on one engine (docs/jobs.md): each refit installs one job's version under an
    engine id of its own; a request leases its job's newest (the bare base before the job's
    first refit), a re-prefill moves only that job's requests, and a closed job's requests are
    refused while its adapters go as their last requests end."""

    async def main() -> None:
        worker = Worker()
        b = lora_backend(model_dir, worker, rpc_timeout_s=5)
        await refit(b, 1, job="a")
        assert b._adapters.lease("b0", "b") == (0, None)  # b has no version yet: the base
        await refit(b, 1, job="b")
        await refit(b, 2, job="a")
        leases = b._adapters.leases
        assert [str(x) for x in leases.resident()] == ["a:v2", "b:v1"]
        assert b.version == 0  # the run's own label moves only with the job ""
        ids = {}
        for sid, job in (("a/0", "a"), ("b/0", "b"), ("b/1", "b")):
            version, request = b._adapters.lease(sid, job)
            ids[sid] = request.lora_int_id
            b._requests.setdefault(sid.split("/")[0], {})[sid] = sid
            b._inside[sid] = (sid, job)
        assert ids["b/0"] == ids["b/1"] != ids["a/0"]
        assert {leases.adapter_of(s).job for s in ("a/0", "b/0", "b/1")} == {"a", "b"}
        await refit(b, 2, job="b", reprefill=True)
        assert sorted(b._llm.aborted) == ["b/0", "b/1"] and b.last_refit["moved"] == 2
        assert b.last_refit["job"] == "b"
        await b.close_job("a")  # "a/0" still holds a:v2
        with pytest.raises(AdapterError, match="which was closed"):
            b._adapters.lease("late", "a")
        assert ids["a/0"] in worker.registered
        await b._adapters.release("a/0")
        assert ids["a/0"] not in worker.registered
        assert [str(x) for x in leases.resident()] == ["b:v1", "b:v2"]

    anyio.run(main)
