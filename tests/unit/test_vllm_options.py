"""The vLLM backend's pure helpers: options, KV-scale names, prompt-logprob rescaling."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from asyncrl.errors import ConfigError
from asyncrl.wire.messages import TokenBatch
from asyncrl_vllm.kv_scales import resolve_kv_scales
from asyncrl_vllm.options import VLLMOptions, parse_options
from asyncrl_vllm.prompt_logprobs import response_logprobs, split_batch


# --------------------------------------------------------------------------- options
def test_defaults_and_conversion() -> None:
    assert parse_options({}) == VLLMOptions()
    opts = parse_options(
        {"max_model_len": 512, "kv_cache_dtype": "fp8", "cpu_omp_threads_bind": "1"}
    )
    assert (opts.max_model_len, opts.kv_cache_dtype, opts.enable_prefix_caching) == (
        512,
        "fp8",
        True,
    )


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"max_model_lenn": 1}, "max_model_lenn"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"max_num_seqs": 0}, "generator.options.max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"cpu_kvcache_space_gib": 0}, "cpu_kvcache_space_gib"),
        ({"weight_load_mode": "fast"}, "weight_load_mode"),
        ({"cpu_gemm_kernel": "amx"}, "cpu_gemm_kernel"),
        ({"extra_engine_args": {"model": "x", "block_size": 32}}, "model"),
    ],
)
def test_bad_options_name_the_field(raw: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        parse_options(raw)


def test_every_option_has_a_docstring() -> None:
    source = msgspec.inspect.type_info(VLLMOptions)
    import inspect

    text = inspect.getsource(VLLMOptions)
    for field in source.fields:
        after = text.split(f"    {field.name}:", 1)[1].split("\n", 2)
        assert after[1].strip().startswith('"""'), f"{field.name} has no docstring"


# --------------------------------------------------------------------------- KV scales
MODULES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def test_kv_scale_names_in_every_spelling() -> None:
    plan = resolve_kv_scales(
        {
            "model.layers.0.self_attn.k_scale": 0.5,
            "model.layers.0.self_attn.v_scale": 0.25,
            "model.layers.1.self_attn.attn.k_scale": 2,
            "model.layers.1.self_attn.v_proj.v_scale": 3.0,
            "layers.2.self_attn.qkv_proj.q_scale": 4.0,
        },
        MODULES,
    )
    assert plan == {
        MODULES[0]: {"k": 0.5, "v": 0.25},
        MODULES[1]: {"k": 2.0, "v": 3.0},
        MODULES[2]: {"q": 4.0},
    }


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({"model.layers.9.self_attn.k_scale": 1.0}, "unknown attention layers"),
        ({"model.layers.0.self_attn.weight": 1.0}, "must end in"),
        ({"k_scale": 1.0}, "must end in"),
        ({"model.layers.0.self_attn.k_scale": 0.0}, "finite and > 0"),
        ({"model.layers.0.self_attn.k_scale": math.nan}, "finite and > 0"),
        (
            {"model.layers.0.self_attn.k_scale": 1.0, "model.layers.0.self_attn.attn.k_scale": 2.0},
            "already has",
        ),
    ],
)
def test_bad_kv_scales_are_refused(scales: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_kv_scales(scales, MODULES)


# --------------------------------------------------------------------------- scoring
def flat_prompt_logprobs(logits: np.ndarray, tokens: list[int], full: bool):
    """vLLM's FlatLogprobs layout, built by hand: position 0 empty; position p holds the raw
    log-softmax of logits[p-1] for tokens[p] first, then (full) every vocabulary entry."""
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    starts, ends, values = [0], [0], []
    for p in range(1, len(tokens)):
        starts.append(len(values))
        values.append(lp[p - 1, tokens[p]])
        if full:
            values.extend(np.sort(lp[p - 1])[::-1])
        ends.append(len(values))
    return starts, ends, values


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_rescaled_prompt_logprobs_match_a_float64_reference(temperature: float) -> None:
    rng = np.random.default_rng(0)
    vocab, tokens = 11, rng.integers(0, 11, 9).tolist()
    logits = rng.normal(0, 2, (len(tokens), vocab))
    starts, ends, values = flat_prompt_logprobs(logits, tokens, full=temperature != 1.0)
    got = response_logprobs(starts, ends, values, 4, len(tokens), temperature, vocab)
    z = logits / temperature
    ref = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = [ref[p - 1, tokens[p]] for p in range(4, len(tokens))]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_rescaling_refuses_partial_rows() -> None:
    rng = np.random.default_rng(1)
    tokens = [1, 2, 3, 4]
    starts, ends, values = flat_prompt_logprobs(rng.normal(size=(4, 5)), tokens, full=False)
    with pytest.raises(ValueError, match="full-vocabulary"):
        response_logprobs(starts, ends, values, 1, 4, 0.5, 5)
    with pytest.raises(ValueError, match="cover"):
        response_logprobs(starts, ends, values, 1, 5, 1.0)


def test_split_batch() -> None:
    batch = TokenBatch(
        np.arange(9, dtype=np.int32), np.array([4, 5], np.int32), np.array([1, 3], np.int32)
    )
    assert split_batch(batch) == [([0, 1, 2, 3], 1), ([4, 5, 6, 7, 8], 3)]
    bad = TokenBatch(
        np.arange(9, dtype=np.int32), np.array([4, 5], np.int32), np.array([0, 3], np.int32)
    )
    with pytest.raises(ValueError, match="prompt_len"):
        split_batch(bad)
    bad = TokenBatch(
        np.arange(8, dtype=np.int32), np.array([4, 5], np.int32), np.array([1, 3], np.int32)
    )
    with pytest.raises(ValueError, match="sum"):
        split_batch(bad)


def test_engine_is_spawned_without_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inherited TORCHELASTIC_USE_AGENT_STORE made vLLM's own rendezvous wait for a store
    nobody hosts (a 10-minute hang on a GPU host); the engine must not see torchrun's vars."""
    import os

    from asyncrl_vllm.processes import TORCHRUN_VARS, environ

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("ASYNCRL_TEST_SET", raising=False)
    with environ({**dict.fromkeys(TORCHRUN_VARS), "ASYNCRL_TEST_SET": "1"}):
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        assert "MASTER_PORT" not in os.environ
        assert os.environ["ASYNCRL_TEST_SET"] == "1"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert os.environ["MASTER_PORT"] == "29500"
    assert "ASYNCRL_TEST_SET" not in os.environ


def test_context_length_is_checked_before_any_engine_starts(tmp_path) -> None:
    """check_config (run by the controller before spawning) refuses a context that cannot
    hold the longest prompt plus the completion, naming the field and the numbers."""
    import json

    from asyncrl.config import from_dict
    from asyncrl_vllm import check_config

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (tmp_path / "tokenizer.json").write_text("{}")

    def config(**options: object) -> object:
        return from_dict({
            "model": {"path": str(tmp_path)},
            "environment": {"name": "arithmetic"},
            "grpo": {"max_new_tokens": 8},
            "generator": {"options": options},
        })

    check_config(config(max_model_len=15), max_prompt_tokens=7)  # 7 + 8 = 15 fits
    with pytest.raises(ConfigError) as info:
        check_config(config(max_model_len=4), max_prompt_tokens=7)
    assert str(info.value).startswith(
        "generator.options.max_model_len: a context of 4 tokens cannot hold the longest prompt "
        "(7 tokens) plus grpo.max_new_tokens (8) = 15. Fix: set "
        "generator.options.max_model_len >= 15"
    )
    with pytest.raises(ConfigError, match=r"max_position_embeddings\): a context of 64"):
        check_config(config(), max_prompt_tokens=60)  # the model's own limit
    with pytest.raises(ConfigError, match="generator.options.enforce_eagr: unknown key"):
        check_config(config(enforce_eagr=True), max_prompt_tokens=1)


def test_a_temperature_vllm_does_not_serve_is_refused_before_any_engine_starts(tmp_path) -> None:
    """grpo.temperature = 4.0 used to pass check-config and fail every request at the engine
    (``temperature must be in [0, 2]``); below 0.01 vLLM samples at 0.01 instead."""
    import json

    from asyncrl.config import from_dict
    from asyncrl_vllm import check_config

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (tmp_path / "tokenizer.json").write_text("{}")

    def config(temperature: float) -> object:
        return from_dict({"model": {"path": str(tmp_path)}, "environment": {"name": "arithmetic"},
                          "grpo": {"temperature": temperature}})  # fmt: skip

    for fine in (0.01, 1.0, 2.0):
        check_config(config(fine), max_prompt_tokens=1)
    with pytest.raises(ConfigError) as info:
        check_config(config(4.0), max_prompt_tokens=1)
    assert str(info.value) == (
        "grpo.temperature: is 4, above the 2 vLLM serves (it refuses each request: temperature "
        "must be in [0, 2]). Fix: set grpo.temperature to at most 2 (1.0 samples the policy as "
        "it is)."
    )
    with pytest.raises(ConfigError, match=r"grpo.temperature: is 0.005: vLLM samples at 0.01"):
        check_config(config(0.005), max_prompt_tokens=1)


def test_the_temperature_range_is_the_installed_vllms() -> None:
    """TEMPERATURE_RANGE against vLLM's own SamplingParams: the edges are served as asked,
    beyond them refused or changed."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from asyncrl_vllm import TEMPERATURE_RANGE

    low, high = TEMPERATURE_RANGE
    assert SamplingParams(temperature=low).temperature == low
    assert SamplingParams(temperature=high).temperature == high
    refused = r"temperature must be in \[0, 2\]"
    with pytest.raises(Exception, match=refused):  # noqa: B017 - vLLM's own error type
        SamplingParams(temperature=high + 1e-6)
    assert SamplingParams(temperature=low / 2).temperature == low  # not what was asked


def engine_args(tmp_path, model_dir, cuda: bool, **options: object) -> dict:
    """The vLLM engine arguments the backend builds from ``options`` (no engine started)."""
    from types import SimpleNamespace

    from asyncrl.config import from_dict
    from asyncrl_vllm.backend import VLLMBackend

    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out")}, "trainer": {"backend": "bigram"},
        "generator": {"backend": "vllm", "options": options},
    })  # fmt: skip
    ctx = SimpleNamespace(config=config, rank=0, group="rollout", gpu=None)
    return VLLMBackend(ctx)._engine_args(cuda)  # type: ignore[arg-type]


def test_the_cpu_build_starts_without_chunked_prefill_unless_asked(tmp_path, model_dir) -> None:
    """vLLM 0.32's CPU sampler crashes on a chunked prefill of a seeded request (every
    request here is seeded): the CPU engine starts with chunked prefill off; on a GPU it is
    left to vLLM; ``extra_engine_args`` still win."""

    def args(cuda: bool, **options: object) -> dict:
        return engine_args(tmp_path, model_dir, cuda, **options)

    assert args(cuda=False)["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in args(cuda=True)
    on = args(cuda=False, extra_engine_args={"enable_chunked_prefill": True})
    assert on["enable_chunked_prefill"] is True


def test_held_logprobs_need_a_vllm_scheduler_they_fit(tmp_path, model_dir, monkeypatch) -> None:
    """``logprobs_at_end`` (default) names asyncrl's scheduler, after checking that vLLM's
    has what it overrides; a vLLM that moved it is refused before any engine starts."""
    from asyncrl_vllm import scheduler
    from asyncrl_vllm.backend import SCHEDULER

    def args(**options: object) -> dict:
        return engine_args(tmp_path, model_dir, False, **options)

    assert scheduler.unfit() is None  # the installed vLLM
    assert args()["scheduler_cls"] == SCHEDULER
    assert "scheduler_cls" not in args(logprobs_at_end=False)
    mine = {"scheduler_cls": "my.Scheduler"}
    assert args(extra_engine_args=mine)["scheduler_cls"] == "my.Scheduler"

    monkeypatch.setattr(scheduler.Scheduler, "finish_requests", lambda self, request_ids: [])
    assert "finish_requests takes (request_ids), not (request_ids, finished_status)" in str(
        scheduler.unfit()
    )
    with pytest.raises(ConfigError, match="logprobs_at_end = false"):
        args()
    assert "scheduler_cls" not in args(logprobs_at_end=False)
