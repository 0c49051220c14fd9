"""Config loading: unknown keys, bad values and broken invariants are named with a fix."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.policy.samplers import GatedConfig, InOrderConfig, OversampledConfig
from asyncrl.errors import ConfigError

# model_dir: the fixture in conftest.py


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(body)
    return p


BASE = """
[model]
path = "model"
[environment]
name = "arithmetic"
"""


def test_minimal_config_gets_defaults_and_resolves_paths(tmp_path: Path, model_dir: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.model.path == str(model_dir.resolve())
    assert cfg.run.output_dir == str((tmp_path / "runs/asyncrl").resolve())
    assert cfg.pipeline.sampler == InOrderConfig(max_lookahead_versions=1)
    # derived defaults: in_order's P * (L + 1) groups, and N samples for each
    assert cfg.max_buffered_groups == 16 * 2
    assert cfg.max_inflight_samples == 16 * 2 * 8
    assert cfg.min_groups_for_streaming_train == 16


def test_unknown_key_is_named_with_a_fix(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "[grpo]\nprompts_per_stepp = 3\n"))
    message = str(info.value)
    assert "grpo.prompts_per_stepp: unknown key. Fix: did you mean 'prompts_per_step'?" in message
    assert "keys of [grpo]: prompts_per_step, samples_per_prompt" in message
    with pytest.raises(ConfigError, match=r"refti: is neither a section of the config nor an "
                       r"installed service's. Fix: did you mean 'refit'\?"):  # fmt: skip
        load_config(write(tmp_path, BASE + "[refti]\ntimeout_s = 3\n"))


def test_wrong_type_is_named_with_a_fix(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "[grpo]\nsamples_per_prompt = 'eight'\n"))
    assert "grpo.samples_per_prompt: expected int, got str. Fix: write a value" in str(info.value)


def test_unsupported_transport_lists_the_choices(tmp_path: Path, model_dir: Path) -> None:
    """A transport that is not installed is named, with the installed ones (once, "nccl" was
    accepted and silently replaced by shm)."""
    with pytest.raises(ConfigError, match=r"refit.transport: no weight transfer named 'rdma' is "
                                          r"installed. Fix: use one of: cuda_ipc, nccl, shm"):
        load_config(write(tmp_path, BASE + "[refit]\ntransport = 'rdma'\n"))


@pytest.mark.parametrize(("field", "value"), [("trainer_gpus", "[0, 1]"), ("rollout_gpus", "[-1]")])
def test_gpu_placement_needs_one_index_per_rank(
    tmp_path: Path, model_dir: Path, field: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=rf"cluster.{field}: .* must list one GPU index"):
        load_config(write(tmp_path, BASE + f"[cluster]\n{field} = {value}\n"))


@pytest.mark.parametrize(
    ("table", "expected", "buffer"),
    [
        ("name = 'gated'\nmax_staleness_versions = 2\n", GatedConfig(max_staleness_versions=2), 48),
        ("name = 'oversampled'\nover_sampling_ratio = 2.0\n",
         OversampledConfig(over_sampling_ratio=2.0), 64),
        ("name = 'in_order'\nmax_lookahead_versions = 0\n", InOrderConfig(max_lookahead_versions=0), 16),
    ],
)
def test_sampler_choice_becomes_its_own_struct_with_its_capacity(
    tmp_path: Path, model_dir: Path, table: str, expected: object, buffer: int
) -> None:
    cfg = load_config(write(tmp_path, BASE + "[pipeline.sampler]\n" + table))
    assert cfg.pipeline.sampler == expected
    assert cfg.max_buffered_groups == buffer  # P = 16: 16*(2+1), ceil(2*16*2), 16*1


def test_a_removed_key_says_what_replaced_it(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "[refit]\nverify_tolerance_fp8_kv = 0.2\n"))
    message = str(info.value)
    assert "refit.verify_tolerance_fp8_kv: removed: refit verification measures" in message
    assert "Fix: remove it" in message and "did you mean" not in message


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[run]\ngc_freeze = false\n",
         "run.gc_freeze: removed: the constant asyncrl.obs.collector.GC_FREEZE = True"),
        ("[refit]\nstaging_buffers = 3\n",
         "refit.staging_buffers: removed: the constant asyncrl.transfers.STAGING_BUFFERS = 2"),
        pytest.param("[gateway]\nmax_messages = 8\n", "gateway.max_messages: removed: the "
                     "constant asyncrl_gateway.server.MAX_MESSAGES = 2048",
                     marks=pytest.mark.skipif(find_spec("asyncrl_gateway") is None,
                                              reason="the gateway's section names it")),
        ("[grpo]\ndynamic_sampling_max_drops = 2\n",
         "grpo.dynamic_sampling_max_drops: removed: 4 x grpo.prompts_per_step"),
        ("[cluster]\ntorchrun = '/opt/torchrun'\n",
         "cluster.torchrun: removed: the constant asyncrl.procs.spawn.TORCHRUN"),
        ("[refit]\nverify_first_steps = 0\n", "refit.verify_first_steps: removed: the constant "
         "asyncrl.policy.verify.VERIFY_FIRST_STEPS = 3 (refit.verify_every_steps = 0 turns"),
        ("[refit]\nkv_calibrate_q = true\n", "refit.kv_calibrate_q: removed: query scales are "
         "calibrated exactly when a generator reports the capability kv_quantized_query"),
        ("[failures]\nheartbeat_interval_s = 1.0\n", "failures.heartbeat_interval_s: removed: "
         "derived from failures.heartbeat_timeout_s: a twelfth of it, 5 s at most"),
        ("[episode]\non_template_mismatch = 'refuse'\n", "episode.on_template_mismatch: removed: "
         "an episode the chat template does not re-render is always split"),
    ],
)
def test_a_key_removed_in_issue_50_names_its_constant(
    tmp_path: Path, model_dir: Path, toml: str, expected: str
) -> None:
    """A config that still sets a key that became a constant fails before anything starts,
    naming the key, that it was removed, what replaced it and the fix."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + toml))
    message = str(info.value)
    assert expected in message, message
    assert "Fix: remove it from the config" in message and "unknown key" not in message


def test_every_removed_key_is_named_once_and_overrides_too(tmp_path: Path, model_dir: Path) -> None:
    """Several removed keys: one line each (not the first alone); ``--set`` of one is refused
    the same way; an embedding caller's ``from_dict`` too."""
    from asyncrl.config import from_dict

    body = BASE + "[run]\nevent_loop = 'asyncio'\n[refit]\nverify_noise_factor = 5.0\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, body))
    lines = str(info.value).splitlines()
    assert [line.split(": ")[1 if i == 0 else 0] for i, line in enumerate(lines)] == [
        "run.event_loop", "refit.verify_noise_factor"]
    with pytest.raises(ConfigError, match=r"failures.retry_backoff_s: removed: the constant "
                       r"asyncrl.policy.failures.RETRY_BACKOFF_S = 1.0"):
        load_config(write(tmp_path, BASE), {"failures.retry_backoff_s": 0.05})
    with pytest.raises(ConfigError, match=r"^metrics.progress: removed: the progress bar shows"):
        from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "x"},
                   "metrics": {"progress": "off"}})  # fmt: skip


def test_each_removed_key_is_gone_and_its_constant_holds_its_default() -> None:
    """Every entry of the removed-key tables, the core's and each installed service's section's
    (the gateway's, when it is installed): its section has no such field any more, and the
    constant it names exists with the key's last default (behaviour unchanged)."""
    import importlib

    import msgspec

    from asyncrl.config import Config
    from asyncrl.config.removed import REMOVED
    from asyncrl.config.service_sections import GROUP, load_section
    from asyncrl.registry import available

    fields = {f.name: {g.name for g in f.type.fields}
              for f in msgspec.inspect.type_info(Config).fields
              if isinstance(f.type, msgspec.inspect.StructType)}  # fmt: skip
    entries = dict(REMOVED)
    assert all(key.partition(".")[0] in fields for key in REMOVED)  # the core names no service
    for name in available(GROUP):
        spec = load_section(name, name)
        fields[name] = {f.name for f in msgspec.structs.fields(spec.type)}
        entries |= {f"{name}.{key}": entry for key, entry in spec.removed.items()}
    if find_spec("asyncrl_gateway") is not None:
        assert "gateway.max_tools" in entries and "gateway.model_name" in entries
    for key, entry in entries.items():
        section, _, name = key.partition(".")
        assert name not in fields[section], key
        if entry.constant:
            module, _, attr = entry.constant.rpartition(".")
            assert getattr(importlib.import_module(module), attr) == entry.default, key


def test_the_heartbeat_interval_is_derived_from_its_timeout() -> None:
    """A twelfth of ``failures.heartbeat_timeout_s``, 5 s at most: the defaults' 5 s, a short
    timeout's shorter; a property of the section, not a key (nothing of it is written in a
    config, a checkpoint or the reference)."""
    import msgspec

    from asyncrl.config import FailuresConfig
    from asyncrl.config.operations import HEARTBEAT_INTERVAL_S, PROBES_PER_TIMEOUT

    assert (HEARTBEAT_INTERVAL_S, PROBES_PER_TIMEOUT) == (5.0, 12)
    assert FailuresConfig().heartbeat_interval_s == 5.0  # 60 s / 12
    assert FailuresConfig(heartbeat_timeout_s=120.0).heartbeat_interval_s == 5.0
    assert FailuresConfig(heartbeat_timeout_s=3.0).heartbeat_interval_s == 0.25
    fields = {f.name for f in msgspec.inspect.type_info(FailuresConfig).fields}
    assert "heartbeat_interval_s" not in fields
    assert b"interval" not in msgspec.json.encode(FailuresConfig())
    reference = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    assert "heartbeat_interval_s" not in reference


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ("name = 'gated'\nmax_lookahead_versions = 1\n",
         r"pipeline.sampler.max_lookahead_versions: unknown key.*keys of \[pipeline.sampler\]: "
         "max_staleness_versions"),
        ("max_lookahead_versions = 1\n", r"pipeline.sampler.name: required but missing.*in_order"),
        ("name = 'gated'\nmax_staleness_versions = 0\n", r"max_staleness_versions: must be >= 1"),
        ("name = 'oversampled'\nover_sampling_ratio = 0.5\n", r"over_sampling_ratio: must be >= 1"),
        ("name = 'gated'\nmax_staleness_versions = 'x'\n",
         r"pipeline.sampler.max_staleness_versions: expected int, got str. Fix"),
    ],
)
def test_sampler_mistakes_name_the_knob(tmp_path: Path, model_dir: Path, table: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, BASE + "[pipeline.sampler]\n" + table))


def test_unknown_sampler_is_rejected(tmp_path: Path, model_dir: Path) -> None:
    body = BASE + "[pipeline.sampler]\nname = 'windowedd'\n"
    with pytest.raises(ConfigError, match="windowedd.*installed: .*gated, in_order.*Fix"):
        load_config(write(tmp_path, body))


@pytest.mark.parametrize(
    ("extra", "field", "fix"),
    [
        ("[grpo]\nsamples_per_prompt = 1\n", "grpo.samples_per_prompt", ">= 2"),
        ("[grpo]\ntemperature = 0.0\n", "grpo.temperature", "1.0"),
        ("[run]\nnum_steps = 0\n", "run.num_steps", "positive"),
        (
            "[grpo]\nprompts_per_step = 4\n[pipeline]\nmin_groups_for_streaming_train = 5\n",
            "pipeline.min_groups_for_streaming_train",
            "at most 4",
        ),
        (
            "[grpo]\nprompts_per_step = 4\n[pipeline]\nmax_buffered_groups = 7\n"
            "[pipeline.sampler]\nname = 'in_order'\nmax_lookahead_versions = 1\n",
            "pipeline.max_buffered_groups",
            ">= 8",
        ),
        (
            "[pipeline.sampler]\nname = 'in_order'\nmax_lookahead_versions = -1\n",
            "pipeline.sampler.max_lookahead_versions",
            ">= 1 for async",
        ),
        ("[loss]\nclip_eps_low = 1.5\n", "loss.clip_eps_low", "0.2"),
        ("[failures]\nreward_timeout_s = 0\n", "failures.reward_timeout_s", "use e.g. 60"),
        ("[failures]\nreward_timeout_s = inf\n", "failures.reward_timeout_s", "use e.g. 60"),
        ("[pipeline]\nmax_buffered_groups = -1\n", "pipeline.max_buffered_groups",
         "got -1. Fix: use 0 for the default"),
        ("[refit]\nverify_every_steps = -2\n", "refit.verify_every_steps",
         "got -2. Fix: use 0 to turn it off"),
    ],
)
def test_invariants_name_field_and_fix(
    tmp_path: Path, model_dir: Path, extra: str, field: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + extra))
    assert field in str(info.value)
    assert "Fix:" in str(info.value) and fix in str(info.value)


def test_missing_model_dir_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path.*config.json.*make_model"):
        load_config(write(tmp_path, BASE))


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_overrides_apply_before_validation(tmp_path: Path, model_dir: Path) -> None:
    cfg = load_config(write(tmp_path, BASE), {"grpo.prompts_per_step": 4, "run.seed": 7})
    assert cfg.grpo.prompts_per_step == 4 and cfg.run.seed == 7
    with pytest.raises(ConfigError, match="grpo.samples_per_prompt"):
        load_config(write(tmp_path, BASE), {"grpo.samples_per_prompt": 1})


def test_configuration_reference_is_up_to_date() -> None:
    """docs/configuration.md is generated from the field docstrings; a field added or changed
    without regenerating it fails here (fix: python scripts/gen_config_docs.py)."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_config_docs", root / "scripts/gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs/configuration.md").read_text() == module.render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    )


def _counting_samplers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route every sampler plugin's factory through a counter; returns the list of built
    samplers' names (one entry per factory call)."""
    from asyncrl import registry
    from asyncrl.policy.samplers import SamplerPlugin

    built: list[str] = []
    real_load = registry.load

    def load(group: str, name: str, *args: object, **kwargs: object) -> object:
        obj = real_load(group, name, *args, **kwargs)
        if group != "asyncrl.samplers":
            return obj

        def create(config: object) -> object:
            built.append(name)
            return obj.create(config)

        return SamplerPlugin(obj.config, create)

    monkeypatch.setattr(registry, "load", load)
    return built


def test_the_sampler_is_built_once_per_config(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading checks the sampler; every later question (capacities, the staleness bound,
    the mode) asks that same sampler. Only a scheduler gets a fresh one (it drives it)."""
    from asyncrl.config.modes import describe
    from asyncrl.config.modes import make_groups

    built = _counting_samplers(monkeypatch)
    cfg = load_config(write(tmp_path, BASE + "[pipeline.sampler]\nname = 'gated'\n"))
    assert built == ["gated"]
    for _ in range(5):
        assert (cfg.max_buffered_groups, cfg.max_inflight_samples) == (32, 256)
    assert cfg.sampler is cfg.sampler and cfg.sampler.max_staleness == 1
    assert "staleness <= 1" in describe(cfg).mode
    assert built == ["gated"]
    scheduler = make_groups(cfg)
    assert built == ["gated", "gated"] and scheduler.sampler is not cfg.sampler


def test_a_config_without_its_sampler_built_still_derives_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``Config`` made directly (no load) builds its sampler on the first question, once;
    a replaced config builds its own (its table may differ)."""
    import msgspec

    from asyncrl.config import Config, EnvironmentConfig, ModelConfig, PipelineConfig

    built = _counting_samplers(monkeypatch)
    cfg = Config(model=ModelConfig(path=str(model_dir)), environment=EnvironmentConfig(name="x"))
    assert built == []
    assert cfg.max_buffered_groups == 32 and cfg.max_inflight_samples == 256
    assert built == ["in_order"]
    table = {"name": "oversampled", "over_sampling_ratio": 2.0}
    other = msgspec.structs.replace(cfg, pipeline=PipelineConfig(sampler=table))
    assert other.max_buffered_groups == 64 and cfg.max_buffered_groups == 32  # ceil(2*16*2)
    assert built == ["in_order", "oversampled"]
    assert msgspec.to_builtins(other)["pipeline"]["sampler"] == table  # nothing cached leaks


def test_rollout_restarts_ask_the_transfer_not_its_name(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer that declares it takes no new reader gets no rollout restart, whatever it
    is called; ``nccl`` takes new readers (it forms a new group), so it keeps them."""
    import dataclasses

    from asyncrl.config import root
    from asyncrl.transfers import load_transfer

    restarts = "[failures]\nrollout_restarts = 2\n"
    assert load_config(write(tmp_path, BASE + restarts)).rollout_restarts == 2
    nccl = load_config(write(tmp_path, BASE + restarts + "[refit]\ntransport = 'nccl'\n"))
    assert nccl.rollout_restarts == 2
    shm = load_transfer("shm")
    monkeypatch.setattr(
        root, "load_transfer",
        lambda name: dataclasses.replace(shm, takes_new_readers=False),
    )  # fmt: skip
    assert load_config(write(tmp_path, BASE + restarts)).rollout_restarts == 0


def test_asking_the_transfer_imports_no_torch(tmp_path: Path, model_dir: Path) -> None:
    """The config and its questions stay torch-free: a controller host needs no torch to
    load a config and ask whether the nccl transfer takes a restarted worker."""
    import subprocess
    import sys

    path = write(tmp_path, BASE + "[refit]\ntransport = 'nccl'\n")
    code = (
        "import sys; from asyncrl.config import load_config;"
        f"cfg = load_config({str(path)!r}); print(cfg.rollout_restarts, cfg.max_buffered_groups,"
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "32", "False"]


def test_each_section_checks_its_own_fields(tmp_path: Path, model_dir: Path) -> None:
    """One broken field in every section: problems() lists each, named by its section, in the
    order of the reference (the model directory, read from disk, last)."""
    from asyncrl.config import load_unvalidated, problems

    body = BASE.replace('path = "model"', 'path = "nowhere"') + """
[run]
num_steps = 0
[cluster]
rollout_gpus = [0, 1]
[grpo]
temperature = 0
[loss]
is_cap = 0.5
[pipeline]
max_buffered_groups = 1
[refit]
verify_every_steps = -1
[trainer]
micro_batch_size = 0
max_tokens_per_micro_batch = -1
[eval]
num_prompts = -1
[checkpoint]
keep_last = 0
[export]
every_steps = -1
[failures]
reward_timeout_s = 0
[metrics]
completions_every = -1
"""
    found = problems(load_unvalidated(write(tmp_path, body)))
    assert [str(exc).split(":")[0] for exc in found] == [
        "run.num_steps", "cluster.rollout_gpus", "grpo.temperature", "loss.is_cap",
        "pipeline.max_buffered_groups", "refit.verify_every_steps", "trainer.micro_batch_size",
        "trainer.max_tokens_per_micro_batch", "eval.num_prompts", "checkpoint.keep_last", "export.every_steps",
        "failures.reward_timeout_s", "metrics.completions_every", "model.path", "model.path",
    ]  # fmt: skip
    assert all("Fix:" in str(exc) for exc in found)


def test_packing_needs_a_row_length(tmp_path: Path, model_dir: Path) -> None:
    """``trainer.pack_sequences`` packs rows of ``max_tokens_per_micro_batch`` tokens: with
    that 0 (off) the config names both fields and the fix; with it set, nothing."""
    from asyncrl.config import load_unvalidated, problems

    body = BASE + "\n[trainer]\npack_sequences = true\n"
    found = problems(load_unvalidated(write(tmp_path, body)))
    assert [str(exc).split(":")[0] for exc in found] == ["trainer.pack_sequences"]
    assert "trainer.max_tokens_per_micro_batch" in str(found[0]) and "Fix:" in str(found[0])
    ok = body + "max_tokens_per_micro_batch = 4096\n"
    assert problems(load_unvalidated(write(tmp_path, ok))) == []


@pytest.mark.anyio
async def test_a_controller_not_running_says_where_to_ask(tmp_path: Path, model_dir: Path) -> None:
    """What the controller answers needs a run: outside ``async with`` each call says so."""
    import asyncrl

    ctl = asyncrl.Controller(load_config(write(tmp_path, BASE)))
    for ask in (ctl.status, ctl.request_checkpoint):
        with pytest.raises(RuntimeError, match="inside `async with Controller"):
            ask()
    with pytest.raises(RuntimeError, match="not running"):
        await ctl.save_checkpoint()


def test_a_negative_capacity_is_named_once(tmp_path: Path, model_dir: Path) -> None:
    """A capacity below 0 is ``[pipeline]``'s own problem; the checks against ``[grpo]`` and
    the sampler's rule, which would only repeat it, are skipped."""
    from asyncrl.config import load_unvalidated, problems

    body = BASE + "[pipeline]\nmax_inflight_samples = -1\nmin_groups_for_streaming_train = -3\n"
    found = [str(e) for e in problems(load_unvalidated(write(tmp_path, body)))]
    assert found == [
        "pipeline.min_groups_for_streaming_train: must be >= 0, got -3. Fix: use 0 for the "
        "default.",
        "pipeline.max_inflight_samples: must be >= 0, got -1. Fix: use 0 for the default.",
    ]


def test_the_event_loop_is_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncrl.launch.EVENT_LOOP = "auto"`` (once ``run.event_loop``): uvloop where it is
    installed, else asyncio's; ``asyncio`` forces asyncio's."""
    import importlib.util

    from asyncrl.launch import EVENT_LOOP, loop_options

    pytest.importorskip("uvloop")  # a dependency on Linux: installed with asyncrl
    assert EVENT_LOOP == "auto" and loop_options() == {"use_uvloop": True}
    assert loop_options("asyncio") == {"use_uvloop": False}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))  # fmt: skip
    assert loop_options() == {"use_uvloop": False}
