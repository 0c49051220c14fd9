"""The memory plan against hand computations: what each trainer rank (its state, and the
activations of its longest micro-batch) and engine holds, per GPU, and the refusals with
their fixes (the plugins' own ``gpu_memory``, as the controller loads them)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from asyncrl.cli import main
from asyncrl.config import from_dict
from asyncrl.errors import ConfigError
from asyncrl.procs.gpu_memory import CUDA_CONTEXT_BYTES, GiB, ModelShape
from asyncrl.run.preflight import memory_plan

# Qwen2.5's published shapes and parameter counts (a tied embedding counted once)
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)  # fmt: skip
P_1_5B = 1_543_714_304
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)  # fmt: skip
P_7B = 7_615_616_512


def model(tmp_path: Path, shape: dict, parameters: int) -> Path:
    """A model directory that says its shape and size (a safetensors header of one tensor of
    ``parameters`` elements, without the bytes: only headers are read)."""
    d = tmp_path / f"m{parameters}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", **shape}))
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(d / "tokenizer.json"))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [parameters],
                               "data_offsets": [0, 2 * parameters]}}).encode()  # fmt: skip
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return d


def config(path: Path, **sections):
    base = {"model": {"path": str(path)}, "environment": {"name": "arithmetic"},
            "trainer": {"backend": "fsdp2"}, "generator": {"backend": "vllm"}}  # fmt: skip
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return from_dict(base)


def test_the_shape_is_read_from_config_json_and_the_headers(tmp_path: Path) -> None:
    shape = ModelShape.of(str(model(tmp_path, QWEN_1_5B, P_1_5B)))
    assert shape == ModelShape(P_1_5B, 28, 1536, 2, 128, 151936, intermediate=8960)


def test_full_weights_on_one_rank_hold_18_bytes_a_parameter(tmp_path: Path) -> None:
    """FSDP2, one rank: float32 weights, gradients (4 + 4) and AdamW's moments (8), and an
    eighth of that working memory: 18 bytes a parameter. The engine beside it holds
    gpu_memory_utilization of the GPU."""
    cfg = config(model(tmp_path, QWEN_1_5B, P_1_5B), cluster={"rollout_gpus": [0]},
                 generator={"options": {"gpu_memory_utilization": 0.3}})  # fmt: skip
    plan = memory_plan(cfg, [80 * GiB])
    trainer, engine = plan.processes
    assert (trainer.gpu, engine.gpu) == (0, 0)
    assert dict(trainer.need.parts)["AdamW moments float32"] == 8 * P_1_5B
    assert trainer.need.total == 18 * P_1_5B
    assert engine.need.total == int(0.3 * 80 * GiB)
    assert plan.need(0) == 18 * P_1_5B + int(0.3 * 80 * GiB) + 2 * CUDA_CONTEXT_BYTES
    assert plan.problems() == []
    assert plan.trainer_bytes() == 18 * P_1_5B  # what each step's record sets beside its peaks


def test_sharded_and_whole_weights_over_two_ranks(tmp_path: Path) -> None:
    """Two trainer ranks: FSDP2 and ZeRO-3 shard everything (9 bytes a parameter each);
    ZeRO-2 keeps the whole float32 weights on each (4 + 12 / 2 = 10, + the eighth)."""
    path = model(tmp_path, QWEN_1_5B, P_1_5B)
    two = {"trainer_ranks": 2, "rollout_gpus": [2]}
    fsdp = memory_plan(config(path, cluster=two), [80 * GiB] * 3)
    z3 = memory_plan(config(path, cluster=two, trainer={
        "backend": "deepspeed", "options": {"zero_stage": 3}}), [80 * GiB] * 3)  # fmt: skip
    z2 = memory_plan(config(path, cluster=two, trainer={
        "backend": "deepspeed", "options": {"zero_stage": 2}}), [80 * GiB] * 3)  # fmt: skip
    assert [p.gpu for p in fsdp.processes] == [0, 1, 2]
    assert fsdp.processes[0].need.total == z3.processes[0].need.total == 9 * P_1_5B
    assert z2.processes[1].need.total == int(10 * P_1_5B * 1.125)


def test_ranks_over_tcp_get_no_verdict(tmp_path: Path) -> None:
    """Several nodes: trainer rank 8 is on another node's GPU 0, not on a ninth GPU here."""
    nodes = {"trainer_ranks": 16, "rollout_ranks": 2, "rollout_gpus": [7, 7], "network": "tcp"}
    cfg = config(model(tmp_path, QWEN_1_5B, P_1_5B), cluster=nodes)
    plan = memory_plan(cfg, [80 * GiB] * 8)
    assert plan.problems() == [] and plan.gpus is None
    assert any("several nodes" in line for line in plan.lines())


def test_a_full_fine_tune_that_cannot_fit_is_refused_with_lora_among_the_fixes(
    tmp_path: Path,
) -> None:
    """A 7B model's full fine-tune on one 80 GiB GPU: its state alone is ~128 GiB."""
    cfg = config(model(tmp_path, QWEN_7B, P_7B), cluster={"rollout_gpus": [1]})
    (problem,) = memory_plan(cfg, [80 * GiB, 80 * GiB]).problems()
    message = str(problem)
    # 18 bytes a parameter: 137.1e9 bytes, 127.7 GiB, and a CUDA context of 0.5
    assert message.startswith("cluster.trainer_gpus: GPU 0 has 80.0 GiB, and its processes "
                              "hold 128.2 GiB (trainer:0 127.7 GiB")  # fmt: skip
    assert "train a LoRA adapter instead" in message and "cluster.trainer_ranks" in message


def test_an_engine_at_vllms_default_beside_a_trainer_is_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    path = model(tmp_path, QWEN_1_5B, P_1_5B)
    (problem,) = memory_plan(config(path), [80 * GiB]).problems()  # both on GPU 0
    assert "lower generator.options.gpu_memory_utilization (now 0.9" in str(problem)
    assert "put the trainer and the engines on different GPUs" in str(problem)
    assert memory_plan(config(path, cluster={"rollout_gpus": [1]}),
                       [80 * GiB] * 2).problems() == []  # fmt: skip
    (beyond,) = memory_plan(config(path, cluster={"rollout_gpus": [1]}), [80 * GiB]).problems()
    assert str(beyond).startswith("cluster.rollout_gpus: places a process on GPU 1, but this "
                                  "node shows 1")  # fmt: skip


def test_lora_on_a_7b_model_fits_one_gpu_beside_its_engine(tmp_path: Path) -> None:
    """The frozen base in bf16 (2 bytes a parameter), the rank-32 adapter's float32 state,
    and the engine's registered versions: fits one 80 GiB GPU beside a 0.4 engine."""
    path = model(tmp_path, QWEN_7B, P_7B)
    cfg = config(path, lora={"rank": 32}, cluster={"rollout_gpus": [0]},
                 generator={"options": {"gpu_memory_utilization": 0.4}})  # fmt: skip
    plan = memory_plan(cfg, [80 * GiB])
    trainer, engine = plan.processes
    adapter = 28 * 32 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    assert dict(trainer.need.parts)["base bfloat16"] == 2 * P_7B
    assert dict(trainer.need.parts)["adapter, gradient, AdamW moments float32"] == 16 * adapter
    assert dict(engine.need.parts)["4 adapter versions"] == 4 * 2 * adapter  # slots 3, + 1
    assert plan.problems() == []
    jobs = memory_plan(config(path, lora={"rank": 32}, cluster={"rollout_gpus": [0]},
                              generator={"options": {"gpu_memory_utilization": 0.4}},
                              trainer={"options": {"job_slots": 8}}), [80 * GiB])  # fmt: skip
    parts = dict(jobs.processes[0].need.parts)  # docs/jobs.md: each job its adapter's state
    assert parts["8 job adapters, gradients, AdamW moments float32"] == 8 * 16 * adapter


# Activations a token of Qwen2.5-1.5B's shape keeps in bf16, by hand (asyncrl_torch.memory):
# per layer 10 hidden-wide and 4 MLP-wide tensors of 2 bytes, 28 layers; the logits in bf16 and
# 2 float32 copies. With activation checkpointing: each layer's bf16 input and one layer whole.
LAYER_1_5B = 2 * (10 * 1536 + 4 * 8960)
LOGITS_1_5B = 151936 * (2 + 2 * 4)
TOKEN_1_5B = 28 * LAYER_1_5B + LOGITS_1_5B
TOKEN_1_5B_CHECKPOINTED = 28 * 2 * 1536 + LAYER_1_5B + LOGITS_1_5B


@pytest.mark.parametrize(
    "trainer, longest, tokens, per_token",
    [
        # 4 sequences padded to the longest, 1,024 tokens
        ({"micro_batch_size": 4}, 1024, 4 * 1024, TOKEN_1_5B),
        # a micro-batch is never more than a rank's share of the step (2 x 2 samples here)
        ({"micro_batch_size": 64}, 1024, 4 * 1024, TOKEN_1_5B),
        # a token budget bounds it, unless one sequence is longer (it goes alone)
        ({"max_tokens_per_micro_batch": 3000}, 1024, 3000, TOKEN_1_5B),
        ({"max_tokens_per_micro_batch": 3000}, 5000, 5000, TOKEN_1_5B),
        ({"micro_batch_size": 4, "options": {"mixed_precision": "bf16",
                                             "activation_checkpointing": True}},
         1024, 4 * 1024, TOKEN_1_5B_CHECKPOINTED),  # fmt: skip
    ],
)
def test_activations_are_planned_for_the_longest_micro_batch(
    tmp_path: Path, trainer: dict, longest: int, tokens: int, per_token: int
) -> None:
    trainer = {**trainer, "options": {"mixed_precision": "bf16", **trainer.get("options", {})}}
    cfg = config(model(tmp_path, QWEN_1_5B, P_1_5B), trainer=trainer,
                 grpo={"prompts_per_step": 2, "samples_per_prompt": 2})  # fmt: skip
    plan = memory_plan(cfg, [80 * GiB], longest_sequence=longest)
    need = plan.processes[0].need
    assert dict(need.parts)[f"activations of {tokens:,} tokens (estimated)"] == tokens * per_token
    assert need.transient == tokens * per_token
    assert need.total == 18 * P_1_5B + tokens * per_token
    assert plan.trainer_bytes() == need.total  # what each step's record sets beside its peaks


@pytest.mark.parametrize("mixed_precision, layer", [
    # a float32 adapter on the bf16 base: PEFT's float32 copies of the projections' inputs,
    # 11.5 hidden-wide and 0.5 MLP-wide units more (asyncrl_torch.memory.LORA_HIDDEN, _MLP)
    ("none", 2 * (21.5 * 1536 + 4.5 * 8960)),
    ("bf16", LAYER_1_5B),  # the adapter computes in bf16: nothing more
])  # fmt: skip
def test_lora_activations_count_the_adapters_float32_inputs(
    tmp_path: Path, mixed_precision: str, layer: float
) -> None:
    cfg = config(model(tmp_path, QWEN_1_5B, P_1_5B), lora={"rank": 16},
                 trainer={"micro_batch_size": 4, "options": {"mixed_precision": mixed_precision}})
    need = memory_plan(cfg, [80 * GiB], longest_sequence=512).processes[0].need
    assert need.transient == 4 * 512 * (28 * int(layer) + LOGITS_1_5B)


def test_activations_need_the_longest_sequence_or_a_token_budget(tmp_path: Path) -> None:
    """Without the longest sequence (planning from the config alone) only a token budget
    bounds a micro-batch; the plan says what it could not count."""
    path = model(tmp_path, QWEN_1_5B, P_1_5B)
    plan = memory_plan(config(path), [80 * GiB])
    assert plan.processes[0].need.total == 18 * P_1_5B
    assert any("activations are counted only to" in line for line in plan.lines())
    budget = memory_plan(config(path, trainer={"max_tokens_per_micro_batch": 2048}), [80 * GiB])
    assert budget.processes[0].need.transient == 2048 * (28 * 2 * LAYER_1_5B
                                                         + 151936 * (4 + 2 * 4))  # float32


def test_long_micro_batches_that_cannot_fit_name_checkpointing_and_smaller_batches(
    tmp_path: Path,
) -> None:
    """16 sequences of 8,192 tokens in float32: 131,072 tokens of activations, 0.9 TiB."""
    cfg = config(model(tmp_path, QWEN_1_5B, P_1_5B), cluster={"rollout_gpus": [1]})
    (problem,) = memory_plan(cfg, [80 * GiB] * 2, longest_sequence=8192).problems()
    held = 18 * P_1_5B + 131072 * (28 * 2 * LAYER_1_5B + 151936 * (4 + 2 * 4))
    assert f"trainer:0 {held / GiB:.1f} GiB" in str(problem)
    assert "trainer.options.activation_checkpointing = true" in str(problem)
    assert "trainer.max_tokens_per_micro_batch" in str(problem)


def test_check_config_prints_the_plan_and_refuses_what_cannot_fit(tmp_path: Path, capsys) -> None:
    path = model(tmp_path, QWEN_7B, P_7B)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\npath = "{path}"\n[environment]\nname = "arithmetic"\n'
                    '[cluster]\nrollout_gpus = [1]\n')  # fmt: skip
    assert main(["check-config", str(toml), "--gpu-memory-gib", "80"]) == 2
    out = capsys.readouterr().out
    # the arithmetic prompts' longest plus grpo.max_new_tokens, 16 sequences of it: counted
    assert re.search(r"activations of [\d,]+ tokens \(estimated\)", out), out
    assert "memory plan (" in out and "GPU 0: " in out and " of 80.0 GiB" in out
    assert "1 problem:" in out and "train a LoRA adapter instead" in out
    assert main(["check-config", str(toml), "--gpu-memory-gib", "80", "--set",
                 "lora.rank=16"]) == 0  # fmt: skip
    assert main(["check-config", str(toml)]) == 0  # no GPU here: no verdict
    assert "no GPU seen here: no verdict" in capsys.readouterr().out


def test_a_run_that_cannot_fit_is_refused_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller's preflight (what ``asyncrl run`` does first) on a host whose GPUs are
    80 GiB each, as nvidia-smi would say."""
    import anyio

    from asyncrl.run import preflight

    monkeypatch.setattr(preflight, "gpu_totals", lambda: [80 * GiB, 80 * GiB])
    cfg = config(model(tmp_path, QWEN_7B, P_7B), cluster={"rollout_gpus": [1]})
    with pytest.raises(ConfigError, match=r"^cluster.trainer_gpus: GPU 0 has 80.0 GiB"):
        anyio.run(preflight.check_before_spawn, cfg)
    lora = config(cfg.model.path, lora={"rank": 16}, cluster={"rollout_gpus": [1]})
    done = anyio.run(preflight.check_before_spawn, lora)
    assert done.memory.trainer_bytes() > 2 * P_7B  # the bf16 base and more


def test_taking_turns_plans_each_turn_and_offloads_only_what_does_not_fit(
    tmp_path: Path,
) -> None:
    """``placement = "take_turns"`` on one GPU, 1.5B full weights (18 bytes a parameter, of
    which gradients and moments are 12), the engine at 0.8 of 80 GiB: resident, 27.8 + 64 GiB
    do not fit; taking turns, the engines' turn holds the trainer's 6 bytes a parameter beside
    the engine (the state offloaded, as ``auto`` decides), the trainer's turn the whole 18."""
    path = model(tmp_path, QWEN_1_5B, P_1_5B)
    engine = {"options": {"gpu_memory_utilization": 0.8}}
    resident = memory_plan(config(path, generator=engine), [80 * GiB])
    assert resident.turns(0) == {"resident": 18 * P_1_5B + int(0.8 * 80 * GiB)
                                 + 2 * CUDA_CONTEXT_BYTES}  # fmt: skip
    (refused,) = resident.problems()
    assert 'cluster.placement = "take_turns"' in str(refused)

    turns = memory_plan(config(path, generator=engine, cluster={"placement": "take_turns"}),
                        [80 * GiB])  # fmt: skip
    assert turns.offload and turns.problems() == []
    kept = 18 * P_1_5B - 12 * P_1_5B  # the float32 weights and their working eighth stay
    assert turns.turns(0) == {
        "generating": kept + int(0.8 * 80 * GiB) + 2 * CUDA_CONTEXT_BYTES,
        "stepping": 18 * P_1_5B + 2 * CUDA_CONTEXT_BYTES,
    }
    # a step's activations are the trainer's turn's only (4 x 512 tokens, float32 compute)
    stepping = memory_plan(config(path, generator=engine, cluster={"placement": "take_turns"},
                                  trainer={"micro_batch_size": 4}),
                           [80 * GiB], longest_sequence=512).turns(0)  # fmt: skip
    activations = 4 * 512 * (28 * 2 * LAYER_1_5B + 151936 * (4 + 2 * 4))
    assert stepping == {
        "generating": kept + int(0.8 * 80 * GiB) + 2 * CUDA_CONTEXT_BYTES,
        "stepping": 18 * P_1_5B + activations + 2 * CUDA_CONTEXT_BYTES,
    }
    assert "taking turns" in "\n".join(turns.lines())
    small = {"options": {"gpu_memory_utilization": 0.3}}  # everything fits beside: kept
    assert not memory_plan(config(path, generator=small, cluster={"placement": "take_turns"}),
                           [80 * GiB]).offload  # fmt: skip


def test_taking_turns_refuses_an_engine_share_that_leaves_no_room_and_says_how_much(
    tmp_path: Path,
) -> None:
    """The engines' turn cannot fit when the engine asks for 0.95 of the GPU beside the
    trainer's resident weights: the fix names the largest share that fits."""
    path = model(tmp_path, QWEN_1_5B, P_1_5B)
    cfg = config(path, generator={"options": {"gpu_memory_utilization": 0.95}},
                 cluster={"placement": "take_turns", "trainer_offload": "always"})  # fmt: skip
    (problem,) = memory_plan(cfg, [80 * GiB]).problems()
    room = 80 * GiB - (6 * P_1_5B + 2 * CUDA_CONTEXT_BYTES)  # by hand: 70.4 GiB, 0.88
    assert f"at most {room / GiB:.1f} GiB ({room / (80 * GiB):.2f} of the GPU)" in str(problem)
    assert "gpu_memory_utilization" in str(problem)


@pytest.mark.parametrize(
    "cluster, pipeline, field",
    [
        ({"rollout_gpus": [1], "trainer_gpus": [0]}, {}, "cluster.placement"),
        ({"network": "tcp"}, {}, "cluster.placement"),
        ({}, {"min_groups_for_streaming_train": 2}, "pipeline.min_groups_for_streaming_train"),
    ],
)
def test_taking_turns_refuses_what_it_cannot_do(
    tmp_path: Path, cluster: dict, pipeline: dict, field: str
) -> None:
    """Engines on a GPU without a trainer rank, several hosts, and chunks streamed into a step
    while the engines generate: each refused, naming the field and the fix."""
    with pytest.raises(ConfigError) as err:
        config(model(tmp_path, QWEN_1_5B, P_1_5B), cluster={"placement": "take_turns",
               **cluster}, pipeline=pipeline, grpo={"prompts_per_step": 8})  # fmt: skip
    assert str(err.value).startswith(field) and "Fix:" in str(err.value), str(err.value)


def test_trainer_offload_without_turns_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only placement"):
        config(model(tmp_path, QWEN_1_5B, P_1_5B), cluster={"trainer_offload": "always"})
