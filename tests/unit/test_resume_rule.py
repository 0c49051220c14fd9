"""The rule for resuming with changed settings (:mod:`asyncrl.checkpoints.resume_rule`): which settings
are strict, which are harmless, what ``--allow-changed`` lets through, and the fingerprints
that compare the model directory, the chat template, the data and the reward code by
content."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import msgspec
import pytest
import structlog

from asyncrl.config import Config, EnvironmentConfig, ModelConfig, from_dict, to_dict
from asyncrl.data.dataset import make_environment
from asyncrl.data.rewards import Reward
from asyncrl.environment import Prompt
from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints.saving import Checkpointer, open_resume
from asyncrl.checkpoints.saving import reward_code_of as code_of
from asyncrl.checkpoints.resume_rule import (
    FINGERPRINT_FIELDS, HARMLESS, code_fingerprints, compare, fingerprints,
)  # fmt: skip

PROMPTS = [Prompt(id=f"p{i}", text=f"{i} + 1 =", answer=i + 1) for i in range(5)]


def _config(**sections: dict) -> dict:
    """A whole default config as the manifest stores it, with ``sections`` merged in (a
    service's section, absent by default, is the table given)."""
    base = Config(model=ModelConfig(path="/m"), environment=EnvironmentConfig(name="arith"))
    data = to_dict(base)
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


OLD_GATEWAY = {
    "enabled": False, "host": "127.0.0.1", "port": 0, "agent": [], "agent_env": {},
    "agent_dir": "/conf", "max_agents": 0, "check_agent": True, "keep_agent_logs": False,
    "session_timeout_s": 600.0, "claim_timeout_s": 20.0, "idle_timeout_s": 120.0,
    "max_request_tokens": 0,
}  # fmt: skip
"""What every checkpoint stored of ``[gateway]`` while it was a core section, written out
(not read from the plugin): its defaults, switched off, in every run's config."""


def _side(config: dict, fp: dict | None = None) -> dict:
    return {"config": config, "fingerprints": fp or {}}


# The brief's list, written out independently of HARMLESS: what changes the meaning of the
# saved state, and what only changes how the run is executed, observed or saved.
STRICT_CHANGES = [
    ("trainer", {"options": {"lr": 3e-4}}, "trainer.options.lr"),
    ("trainer", {"backend": "deepspeed"}, "trainer.backend"),
    ("loss", {"clip_eps_low": 0.9}, "loss.clip_eps_low"),
    ("loss", {"is_cap": 3.0}, "loss.is_cap"),
    ("grpo", {"temperature": 3.0}, "grpo.temperature"),
    ("grpo", {"max_new_tokens": 64}, "grpo.max_new_tokens"),
    ("grpo", {"normalize_advantages": False}, "grpo.normalize_advantages"),
    ("grpo", {"samples_per_prompt": 4}, "grpo.samples_per_prompt"),
    ("run", {"seed": 7}, "run.seed"),
    ("model", {"dtype": "float32"}, "model.dtype"),
    ("environment", {"name": "other"}, "environment.name"),
    ("environment", {"options": {"train_file": "b.jsonl"}}, "environment.options.train_file"),
    ("pipeline", {"sampler": {"name": "gated", "max_staleness_versions": 1}}, "pipeline.sampler"),
    ("cluster", {"trainer_ranks": 2}, "cluster.trainer_ranks"),
    ("generator", {"options": {"quantization": "fp8"}}, "generator.options.quantization"),
]
HARMLESS_CHANGES = [
    ("run", {"num_steps": 99}), ("run", {"log_format": "json"}), ("run", {"name": "x"}),
    ("eval", {"every_steps": 5, "num_prompts": 100}), ("checkpoint", {"every_steps": 3}),
    ("checkpoint", {"keep_last": 5}), ("export", {"every_steps": 2}),
    ("metrics", {"sinks": ["jsonl", "tensorboard"]}), ("cluster", {"call_timeout_s": 60.0}),
    ("cluster", {"rollout_ranks": 4}), ("refit", {"bucket_size_mb": 64}),
    ("failures", {"max_failed_groups": 0}), ("trainer", {"micro_batch_size": 2}),
    ("model", {"path": "/elsewhere"}), ("run", {"output_dir": "/runs/b"}),
    ("cluster", {"shutdown_grace_s": 5.0}), ("run", {"save_samples": True}),
    ("refit", {"drain": True}),
]  # fmt: skip


@pytest.mark.parametrize(("section", "values", "field"), STRICT_CHANGES,
                         ids=[c[2] for c in STRICT_CHANGES])  # fmt: skip
def test_what_changes_the_meaning_is_refused_and_named(section, values, field) -> None:
    changes = compare(_side(_config()), _side(_config(**{section: values})))
    assert changes.refused and all(line.startswith(field) for line in changes.refused), changes
    assert changes.allowed == [] and changes.harmless == []
    assert changes.names and all(
        n == field or n.startswith(field + ".") for n in changes.names
    ), changes.names
    # named explicitly, the same change passes, listed as allowed
    allowed = compare(_side(_config()), _side(_config(**{section: values})), [field])
    assert allowed.refused == [] and allowed.allowed == changes.refused


@pytest.mark.parametrize(("section", "values"), HARMLESS_CHANGES,
                         ids=[f"{s}.{next(iter(v))}" for s, v in HARMLESS_CHANGES])  # fmt: skip
def test_harmless_changes_are_only_listed(section, values) -> None:
    changes = compare(_side(_config()), _side(_config(**{section: values})))
    assert changes.refused == [] and changes.allowed == []
    assert changes.harmless and all(line.startswith(section) for line in changes.harmless)


def test_the_issue_s_changes_and_the_allow_forms() -> None:
    saved = _side(_config(trainer={"options": {"lr": 1e-4}}, run={"num_steps": 10}))
    now = _side(_config(trainer={"options": {"lr": 1e-4}}, run={"num_steps": 20},
                        loss={"clip_eps_low": 0.9}, grpo={"temperature": 3.0}))  # fmt: skip
    changes = compare(saved, now)
    assert changes.refused == ["grpo.temperature: 1.0 -> 3.0", "loss.clip_eps_low: 0.2 -> 0.9"]
    assert changes.names == ["grpo.temperature", "loss.clip_eps_low"]
    assert changes.harmless == ["run.num_steps: 10 -> 20"]
    # one allowed, the other still refused
    part = compare(saved, now, ["loss.clip_eps_low"])
    assert part.refused == ["grpo.temperature: 1.0 -> 3.0"]
    assert part.allowed == ["loss.clip_eps_low: 0.2 -> 0.9"]
    # a section, several names, or all
    for allow in (["loss", "grpo"], ["grpo.temperature", "loss.clip_eps_low"], ["all"]):
        full = compare(saved, now, allow)
        assert full.refused == [] and len(full.allowed) == 2, allow
    # a misspelt name is reported, not silently ignored
    assert compare(saved, now, ["loss.clip_eps_lw"]).unknown == ["loss.clip_eps_lw"]
    assert compare(saved, now, ["loss"]).unknown == []
    # a setting a checkpoint lacks (or the run lacks) is a change too
    lr_dropped = compare(saved, _side(_config(trainer={"options": {}})))
    assert lr_dropped.refused == ["trainer.options.lr: 0.0001 -> '(unset)'"]


def test_a_checkpoint_whose_config_holds_removed_keys_resumes() -> None:
    """A checkpoint saved before issue 50 stored keys that are constants now: they are
    dropped, not refused (the run resumes), and one stored with another value than the code
    uses now is listed with the harmless changes, naming what replaced it."""
    old = _config()
    old["run"] |= {"gc_freeze": True, "event_loop": "auto", "samples_file_mb": 256.0}
    old["refit"] |= {"staging_buffers": 2, "verify_noise_factor": 3.0}
    old["grpo"] |= {"dynamic_sampling_min_std": 0.0, "dynamic_sampling_max_drops": 0}
    old["gateway"] = {**OLD_GATEWAY, "max_messages": 2048, "model_name": ""}
    same = compare(_side(old), _side(_config()))
    assert (same.refused, same.allowed, same.harmless, same.unknown) == ([], [], [], [])
    old["grpo"]["dynamic_sampling_min_std"] = 0.5
    old["cluster"]["torchrun"] = "/opt/bin/torchrun"
    changed = compare(_side(old), _side(_config()), ["loss"])
    assert changed.refused == [] and changed.allowed == [] and changed.unknown == []
    assert changed.harmless == [
        "cluster.torchrun: '/opt/bin/torchrun' -> 'torchrun' (removed: the constant "
        "asyncrl.procs.spawn.TORCHRUN: this interpreter's `python -m torch.distributed.run`, "
        "what the default meant)",
        "grpo.dynamic_sampling_min_std: 0.5 -> 0.0 (removed: the constant "
        "asyncrl.config.modes.DYNAMIC_SAMPLING_MIN_STD = 0.0)",
    ]
    # the strict settings around them are still compared
    moved = compare(_side(old), _side(_config(grpo={"temperature": 2.0})))
    assert moved.refused == ["grpo.temperature: 1.0 -> 2.0"]


def test_an_old_checkpoint_s_switched_off_gateway_is_no_change() -> None:
    """A checkpoint from before services owned their sections stored ``[gateway]`` switched
    off for every run: a run without the gateway resumes from it, nothing refused, allowed or
    logged; a service's settings count only where it is on (the whole path, the gateway not
    installed: test_a_checkpoint_saved_with_keys_removed_since_resumes)."""
    old = _config(gateway=OLD_GATEWAY)
    same = compare(_side(old), _side(_config()))
    assert (same.refused, same.allowed, same.harmless, same.unknown) == ([], [], [], [])
    # switched off, its settings do nothing: changed, they are not a change
    old["gateway"] |= {"agent": ["python", "a.py"], "session_timeout_s": 5.0}
    off = compare(_side(old), _side(_config(gateway={"enabled": False, "port": 9})))
    assert (off.refused, off.allowed, off.harmless) == ([], [], [])
    # naming it in --allow-changed is no mistake: it is a setting, with nothing to accept
    named = compare(_side(old), _side(_config(gateway={"enabled": False})), ["gateway.port"])
    assert (named.unknown, named.allowed) == ([], [])
    assert compare(_side(old), _side(_config()), ["gateway.prot"]).unknown == ["gateway.prot"]
    # on in the checkpoint, absent now: the one change is that it is off
    old["gateway"]["enabled"] = True
    dropped = compare(_side(old), _side(_config()))
    assert dropped.refused == ["gateway.enabled: True -> False"]
    assert dropped.names == ["gateway.enabled"] and dropped.harmless == []
    assert compare(_side(old), _side(_config()), ["gateway"]).allowed == dropped.refused


def _gateway_on(**values: object) -> Config:
    """A config with the gateway switched on."""
    from asyncrl_gateway.config import GatewayConfig

    return Config(model=ModelConfig(path="/m"), environment=EnvironmentConfig(name="arith"),
                  services={"gateway": GatewayConfig(enabled=True, **values)})  # fmt: skip


@pytest.mark.parametrize("values", [{"agent_dir": "/elsewhere"}, {"max_agents": 8},
                                    {"check_agent": False}, {"port": 8000}])  # fmt: skip
def test_an_enabled_service_s_harmless_keys_are_its_section_s(values: dict) -> None:
    """On at both sides, a service's section is compared key by key: what its section's
    ``HARMLESS`` names is only logged, the rest is strict (the core's HARMLESS names none of
    the gateway's keys any more)."""
    pytest.importorskip("asyncrl_gateway")
    from asyncrl.config.service_sections import harmless_keys

    keys = harmless_keys(_gateway_on())
    assert "gateway.port" in keys and "gateway.agent" not in keys
    saved, now = _side(to_dict(_gateway_on())), _side(to_dict(_gateway_on(**values)))
    changes = compare(saved, now, harmless=keys)
    assert changes.refused == [] and changes.allowed == []
    assert [line.split(":")[0] for line in changes.harmless] == [f"gateway.{next(iter(values))}"]
    assert compare(saved, now).refused  # the core's HARMLESS does not cover it
    agent = _side(to_dict(_gateway_on(agent=["python", "a.py"])))
    assert compare(saved, agent, harmless=keys).refused == [
        "gateway.agent: [] -> ['python', 'a.py']"]


def test_harmless_names_only_existing_settings() -> None:
    """A typo in HARMLESS would make a harmless setting strict (or worse, hide one)."""
    leaves = _leaves(_config())
    for name in HARMLESS:
        assert any(k == name or k.startswith(name + ".") for k in leaves), name


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        out += _leaves(v, key) if isinstance(v, dict) and v else [key]
    return out


# --------------------------------------------------------------------------- fingerprints
def _model_dir(path: Path, template: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 8}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    tok_config = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        tok_config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "model.safetensors").write_bytes(b"\1" * (3 << 20))
    (path / "README.md").write_text("a model")
    return path


def _fp(model: Path, prompts=PROMPTS, template: str = "auto") -> dict:
    return {"config": _config(model={"path": str(model), "chat_template": template}),
            "fingerprints": fingerprints(str(model), template, prompts)}  # fmt: skip


def test_another_tokenizer_is_refused_and_a_moved_model_is_not(tmp_path: Path) -> None:
    first = _model_dir(tmp_path / "a", template="{{ messages[0]['content'] }}")
    saved = _fp(first)
    moved = tmp_path / "b"
    shutil.copytree(first, moved)
    (moved / "README.md").write_text("edited: not compared")
    same = compare(saved, _fp(moved))
    assert same.refused == [] and same.harmless == [f"model.path: {str(first)!r} -> {str(moved)!r}"]

    vocab = json.loads((moved / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["c"] = 2
    (moved / "tokenizer.json").write_text(json.dumps(vocab))
    other = compare(saved, _fp(moved))
    assert len(other.refused) == 1, other.refused
    assert other.refused[0].startswith("model.tokenizer.tokenizer.json: sha256 ")
    assert other.names == ["model.tokenizer"]
    assert compare(saved, _fp(moved), ["model.tokenizer"]).refused == []


def test_the_chat_template_is_compared_by_its_text(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = _model_dir(tmp_path / "m", template=template)
    saved = _fp(model)
    # the same text from a file given as model.chat_template: the same template
    file = tmp_path / "t.jinja"
    file.write_text(template)
    same = compare(saved, _fp(model, template=str(file)))
    assert same.refused == []
    assert same.harmless == [f"model.chat_template: 'auto' -> {str(file)!r} (the same template "
                             "text)"]  # fmt: skip
    # another text in tokenizer_config.json: only the template differs, not the tokenizer
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[-1]['content'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    other = compare(saved, _fp(model))
    assert [line.split(":")[0] for line in other.refused] == ["model.chat_template"]
    assert other.names == ["model.chat_template"]


def test_weights_config_and_data_are_compared(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    saved = _fp(model)
    assert compare(saved, _fp(model)).refused == []
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:100] + b"\2" + data[101:])  # the first MiB (the header's place)
    changed = compare(saved, _fp(model))
    assert [c.split(":")[0] for c in changed.refused] == ["model.weights.model.safetensors"]
    weights.write_bytes(data + b"\0" * 8)  # another size
    assert compare(saved, _fp(model)).names == ["model.weights"]
    weights.write_bytes(data)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert compare(saved, _fp(model)).names == ["model.config"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    # the data: one answer changed, or one prompt more
    edited = [*PROMPTS[:4], Prompt(id="p4", text="4 + 1 =", answer=6)]
    data_change = compare(saved, _fp(model, prompts=edited))
    assert data_change.names == ["environment.data"]
    assert data_change.refused[0].startswith("environment.data: '5 prompts, ")
    more = compare(saved, _fp(model, prompts=[*PROMPTS, Prompt(id="p5", text="5 + 1 =")]))
    assert "'6 prompts, " in more.refused[0]
    assert set(FINGERPRINT_FIELDS) >= {"model.weights", "model.config", "environment.data"}


class Answer:
    """An answer of the environment's own class: compared by its attributes."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_fingerprints_are_plain_json_and_stable(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", template="{{ x }}")
    chat = [Prompt(id="c", messages=({"role": "user", "content": "hi"},), answer={"b": 1, "a": 2}),
            Prompt(id="d", text="x", answer=Answer(3))]  # fmt: skip
    fp = fingerprints(str(model), "auto", chat)
    assert json.loads(json.dumps(fp)) == fp == fingerprints(str(model), "auto", chat)
    # another instance of the same answer (another address) is the same data; another value not
    again = [chat[0], Prompt(id="d", text="x", answer=Answer(3))]
    assert fingerprints(str(model), "auto", again) == fp
    other = [chat[0], Prompt(id="d", text="x", answer=Answer(4))]
    assert fingerprints(str(model), "auto", other)["environment"] != fp["environment"]
    assert msgspec.json.decode(msgspec.json.encode(fp)) == fp
    assert sorted(fp["model"]) == ["chat_template", "config", "tokenizer", "weights"]
    assert sorted(fp["model"]["tokenizer"]) == ["tokenizer.json", "tokenizer_config.json"]
    assert "README.md" not in json.dumps(fp)


# --------------------------------------------------------------------------- the reward code
def _source(path: Path, text: str) -> str:
    """Write ``text`` to ``path``; returns the fingerprint value expected for it, computed
    here by hand: the file's name and the SHA-256 of its bytes."""
    path.write_text(text)
    return f"{path.name} sha256 {hashlib.sha256(text.encode()).hexdigest()}"


def _rewards_env(tmp_path: Path, *functions: str) -> object:
    """The built-in dataset environment with ``functions`` as its rewards (imported now)."""
    rows = '{"q": "1+1", "answer": "2"}\n{"q": "2+2", "answer": "4"}\n'
    (tmp_path / "train.jsonl").write_text(rows)
    rewards = [{"function": f, "name": f"r{i}"} for i, f in enumerate(functions)]
    return make_environment({"train": "train.jsonl", "prompt_field": "q", "rewards": rewards,
                             "eval_size": 1}, 0, base_dir=tmp_path)  # fmt: skip


def _code_side(code: dict | None) -> dict:
    fp = {"environment": {"data": "2 prompts, sha256 x"}}
    if code is not None:
        fp["environment"]["code"] = code
    return _side(_config(), fp)


EXACT = "def exact(completion, answer):\n    return completion.strip() == str(answer)\n"


def test_an_edited_reward_function_is_refused_naming_it(tmp_path: Path) -> None:
    """One reward by import path (a module beside the config), one by file path: each is
    fingerprinted by its module's whole file; editing one is refused under its own name, the
    other unchanged, and --allow-changed environment.code (or the one function) accepts it."""
    module = f"rw_edit_{tmp_path.name.replace('-', '_')}"  # unique: sys.modules is shared
    (tmp_path / "rewards").mkdir()
    by_name = _source(tmp_path / f"{module}.py", EXACT)
    by_path = _source(tmp_path / "rewards" / "math.py", EXACT.replace("exact", "close"))
    try:
        env = _rewards_env(tmp_path, f"{module}:exact", "rewards/math.py:close")
        code = code_fingerprints(env)
        assert code == {f"{module}:exact": by_name, "rewards/math.py:close": by_path}
        saved = _code_side(code)
        assert compare(saved, _code_side(code_fingerprints(env))).refused == []
        # a helper changes, the function's own lines do not: still an edit of the reward
        edited = _source(tmp_path / f"{module}.py", EXACT + "\nSCALE = 2\n")
        now = _code_side(code_fingerprints(env))
        changes = compare(saved, now)
        def short(value: str) -> str:  # as a message shows a digest: its first 12 digits
            return f"{value.split()[0]} sha256 {value.split()[-1][:12]}..."

        assert changes.refused == [
            f"environment.code.{module}:exact: '{short(by_name)}' -> '{short(edited)}'"
        ]
        assert changes.names == ["environment.code"]
        for allow in (["environment.code"], [f"environment.code.{module}:exact"], ["environment"]):
            ok = compare(saved, now, allow)
            assert ok.refused == [] and ok.allowed == changes.refused and ok.unknown == [], allow
    finally:
        sys.modules.pop(module, None)


def test_a_function_imported_from_another_file_fingerprints_both(tmp_path: Path) -> None:
    """``helpers.py`` defines the function, ``front.py`` (named in the config) imports it: an
    edit to either is an edit of the reward."""
    front = _source(tmp_path / "front.py", "from helpers import exact  # noqa\n")
    helpers = _source(tmp_path / "helpers.py", EXACT)
    try:
        env = _rewards_env(tmp_path, "front.py:exact")
        assert code_fingerprints(env) == {"front.py:exact": f"{front}; {helpers}"}
    finally:
        sys.modules.pop("helpers", None)


class Scored:
    """A callable object as a reward: its class's file is hashed."""

    def __call__(self, completion: str) -> float:
        return float(len(completion))


def _plain_reward(completion: str, answer: str = "") -> float:
    return 0.0


def test_environment_modules_and_callables_outside_asyncrl(tmp_path: Path) -> None:
    """An environment of its own module, a callable object and a partial as rewards: each by
    its defining file; asyncrl's own files (the dataset environment, its factory) never."""
    env_file = _source(tmp_path / "my_env_mod.py", "class Env:\n    def score(self, p, c):\n"
                       "        return 1.0\n")  # fmt: skip
    spec = importlib.util.spec_from_file_location("my_env_mod", tmp_path / "my_env_mod.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_env_mod"] = module
    try:
        spec.loader.exec_module(module)
        this = Path(__file__).read_bytes()
        this_file = f"{Path(__file__).name} sha256 {hashlib.sha256(this).hexdigest()}"
        env = module.Env()
        env.rewards = [
            Reward("a", 1.0, Scored(), ("completion",), False, "t:Scored", None),
            Reward("b", 1.0, functools.partial(_plain_reward, answer="x"), ("completion",),
                   False, "t:partial", None),
        ]  # fmt: skip
        assert code_fingerprints(env, ["asyncrl.data.dataset"]) == {
            "t:Scored": this_file, "t:partial": this_file, "my_env_mod": env_file,
        }  # fmt: skip
    finally:
        sys.modules.pop("my_env_mod", None)
    _source(tmp_path / "math.py", EXACT)
    dataset_env = _rewards_env(tmp_path, "math.py:exact")
    (tmp_path / "math.py").unlink()  # read when fingerprinted: a file gone since is named so
    assert code_fingerprints(dataset_env, ["asyncrl.data.dataset"]) == {
        "math.py:exact": "math.py unreadable (No such file or directory)"
    }


def test_a_checkpoint_without_code_fingerprints_resumes_saying_so() -> None:
    """A checkpoint of an asyncrl before the reward code was fingerprinted: nothing to compare
    with, so it is neither refused nor allowed, and the resume says so."""
    code = {"my_rewards:exact": "my_rewards.py sha256 " + "a" * 64}
    old = compare(_code_side(None), _code_side(code))
    assert (old.refused, old.allowed, old.harmless, old.unknown) == ([], [], [], [])
    assert len(old.not_compared) == 1
    assert old.not_compared[0].startswith("environment.code: the checkpoint holds no "
                                          "fingerprint of the reward code")  # fmt: skip
    # no reward code outside asyncrl (an empty table) is still a fingerprint: compared
    assert compare(_code_side({}), _code_side(code)).refused == [
        f"environment.code.my_rewards:exact: '(unset)' -> 'my_rewards.py sha256 {'a' * 12}...'"
    ]
    same = compare(_code_side(code), _code_side(dict(code)))
    assert (same.refused, same.not_compared) == ([], [])
    # the name is known even where there is no leaf to cover
    assert compare(_code_side({}), _code_side({}), ["environment.code"]).unknown == []


# --------------------------------------------------------------------------- through a resume
class SavingTrainers:
    """A control plane whose trainers save nothing (the trainer directory stays empty)."""

    async def call_each(self, workers: list, requests: list, *, timeout_s: float) -> list:
        return [None] * len(workers)


def _manifest_without_code(path: Path) -> None:
    """Rewrite a checkpoint's manifest as an asyncrl before the code fingerprints wrote it
    (its own digest recomputed, as that asyncrl did)."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["fingerprints"]["environment"]["code"]
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.anyio
async def test_an_edited_reward_is_refused_on_resume_with_the_fix(
    tmp_path: Path, model_dir: Path
) -> None:
    """The Checkpointer records the reward code in the manifest; the reward file edited, the
    resume is refused naming the function and the fix; allowed, it goes on; a checkpoint
    without the record resumes with an info line."""
    rewards = tmp_path / "rewards.py"
    _source(rewards, EXACT)
    env = _rewards_env(tmp_path, "rewards.py:exact")
    cfg = from_dict({
        "model": {"path": str(model_dir)}, "run": {"output_dir": str(tmp_path / "out")},
        "environment": {"name": "dataset", "options": {
            "train": "train.jsonl", "prompt_field": "q", "eval_size": 1,
            "rewards": [{"function": "rewards.py:exact"}]}, "base_dir": str(tmp_path)},
        "checkpoint": {"save_model": False},
    })  # fmt: skip
    prompts = env.dataset("train")
    saver = Checkpointer(cfg, control=SavingTrainers(), trainers=["trainer:0"], metrics=None,
                         train_prompts=prompts, code=code_of(cfg, env))  # type: ignore[arg-type]
    state = ckpt.ControllerState(step=1, finished=False, groups=[], scheduler={
        "ledger": {"trained": [[0, 1]], "num_repeated": 0}, "redispatch": []})  # fmt: skip
    path = await saver.save(state, finished=False)
    assert path is not None
    recorded = json.loads((path / "manifest.json").read_text())["fingerprints"]["environment"]
    assert recorded["code"] == {"rewards.py:exact": _source(rewards, EXACT)}
    assert open_resume(cfg, "latest", train_prompts=prompts,
                       code=code_of(cfg, env)).changes.refused == []  # fmt: skip

    _source(rewards, EXACT.replace("strip()", "lower()"))  # what the next process imports
    edited = code_of(cfg, env)
    with pytest.raises(ckpt.CheckpointError) as refused:
        open_resume(cfg, "latest", train_prompts=prompts, code=edited)
    message = str(refused.value)
    assert f"checkpoint {path} is from another run: environment.code.rewards.py:exact: " \
           "'rewards.py sha256 " in message  # fmt: skip
    assert ("Fix: restore them (the checkpoint's manifest.json holds its config; for edited "
            "code (rewards.py:exact), restore the file the checkpoint was trained with, e.g. "
            "from version control), or accept the change with --allow-changed "
            "environment.code (allow_changed= when embedded)") in message
    allowed = open_resume(cfg, "latest", train_prompts=prompts, code=edited,
                          allow_changed=["environment.code"])  # fmt: skip
    assert [line.split(":")[0] for line in allowed.changes.allowed] == [
        "environment.code.rewards.py"]

    _manifest_without_code(path)
    with structlog.testing.capture_logs() as logs:
        old = open_resume(cfg, "latest", train_prompts=prompts, code=edited)
    assert old.changes.refused == [] and old.state.step == 1
    [line] = [e for e in logs if e["event"] == "resume_not_compared"]
    assert line["log_level"] == "info" and line["checkpoint"] == str(path)
    assert line["what"].startswith("environment.code: the checkpoint holds no fingerprint")


@pytest.mark.anyio
async def test_a_checkpoint_saved_with_keys_removed_since_resumes(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: a checkpoint whose manifest's config holds keys that are constants now
    (as one saved before issue 50 does) is opened for a resume with today's config; a removed
    key it stored with another value is logged with the harmless changes. It holds the
    ``[gateway]`` switched off that every run stored while the gateway's section was the
    core's: a run without the gateway, not even installed, resumes from it."""
    from asyncrl import registry

    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda group: [] if group == "asyncrl.services"
                        else real(group=group))  # fmt: skip
    cfg = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out")}, "checkpoint": {"save_model": False},
    })  # fmt: skip
    saver = Checkpointer(cfg, control=SavingTrainers(), trainers=["trainer:0"], metrics=None,
                         train_prompts=PROMPTS)  # type: ignore[arg-type]
    state = ckpt.ControllerState(step=1, finished=False, groups=[], scheduler={
        "ledger": {"trained": [[0, 1]], "num_repeated": 0}, "redispatch": []})  # fmt: skip
    path = await saver.save(state, finished=False)
    assert path is not None
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["config"]["run"] |= {"gc_young_interval_s": 0.05, "event_loop": "auto"}
    manifest["config"]["refit"] |= {"verify_num_sequences": 16, "staging_buffers": 3}
    manifest["config"]["gateway"] = {**OLD_GATEWAY, "request_head_timeout_s": 10.0,
                                     "model_name": ""}  # fmt: skip
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    resume = open_resume(cfg, "latest", train_prompts=PROMPTS)
    assert resume is not None and resume.state.step == 1
    assert resume.changes.refused == [] and resume.changes.harmless == [
        "refit.staging_buffers: 3 -> 2 (removed: the constant "
        "asyncrl.transfers.STAGING_BUFFERS = 2)"]
