"""``asyncrl check-config`` as users run it: the console script and ``python -m asyncrl``."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from asyncrl.cli import main

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))  # every shipped config


@pytest.fixture
def with_model(tmp_path: Path) -> list[str]:
    """Overrides pointing the example configs at a model directory (config.json +
    tokenizer.json are all the file's validation looks at; ``--config-only``: the plugins'
    checks, which read the model, are tested below on a real one)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return ["--set", f"model.path={model}", "--config-only"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_config_checks_clean(path: Path, with_model: list[str], capsys) -> None:
    assert main(["check-config", str(path), *with_model]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mode: ") and "staleness" in out.splitlines()[0] or "on-policy" in out
    assert "max_buffered_groups" in out and "ok: no invariant is broken" in out


def test_every_broken_invariant_is_listed_with_its_fix(with_model: list[str], capsys) -> None:
    code = main(
        [
            "check-config",
            str(ROOT / "examples/modes/gated.toml"),
            *with_model,
            "--set",
            "grpo.temperature=0.0",
            "--set",
            "pipeline.max_buffered_groups=3",
            "--set",
            "pipeline.max_inflight_samples=2",
            "--set",
            "loss.is_cap=0.5",
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "4 problems" in out
    for field in (
        "grpo.temperature",
        "pipeline.max_buffered_groups",
        "pipeline.max_inflight_samples",
        "loss.is_cap",
    ):
        assert f"  - {field}:" in out and "Fix:" in out, field
    assert "gated sampler needs (32 groups" in out


def test_unparsable_configs_exit_2_with_the_field(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[model]\npath = "m"\n[environment]\nname = "x"\n[grpo]\nprompts_per_stepp = 3\n'
    )
    assert main(["check-config", str(bad)]) == 2
    assert "grpo.prompts_per_stepp: unknown key" in capsys.readouterr().out
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 2
    assert main(["check-config", str(bad), "--set", "nonsense"]) == 2


def test_advice_for_chunks_in_sync_mode(with_model: list[str], capsys) -> None:
    main(["check-config", str(ROOT / "examples/modes/sync.toml"), *with_model,
          "--set", "pipeline.min_groups_for_streaming_train=4"])
    assert "advice: pipeline.min_groups_for_streaming_train" in capsys.readouterr().out
    main(["check-config", str(ROOT / "examples/modes/sync.toml"), *with_model])
    assert "advice" not in capsys.readouterr().out


def test_console_script_and_module_entry(with_model: list[str]) -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "asyncrl"]
    assert script.load() is main
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "check-config",
            str(ROOT / "examples/modes/sync.toml"),
            *with_model,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("mode: sync on-policy")
    exe = Path(sys.executable).parent / "asyncrl"
    proc = subprocess.run(
        [str(exe), "check-config", "/nonexistent.toml"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "does not exist" in proc.stdout


def _safetensors(values: list[float]) -> bytes:
    """A one-tensor float32 safetensors file, built by hand from the format's definition."""
    import json
    import struct

    data = struct.pack(f"<{len(values)}f", *values)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)],
                               "data_offsets": [0, len(data)]}}).encode()  # fmt: skip
    return struct.pack("<Q", len(header)) + header + data


def _checkpoint(
    root: Path, step: int, *, with_model: bool, weights: list[float] = [0.0, 1.5, -2.0, 0.25]
) -> Path:
    from asyncrl.checkpoints import directory as ckpt

    tmp = ckpt.start_save(root, step)
    if with_model:
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text('{"model_type": "qwen2"}')
        (tmp / "model" / "model.safetensors").write_bytes(_safetensors(weights))
    state = ckpt.ControllerState(step=step, finished=True, scheduler={}, groups=[])
    return ckpt.commit(
        tmp, state=ckpt.encode_state(state), step=step, finished=True, config={},
        has_model=with_model,
    )  # fmt: skip


def test_export_through_the_console_script(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "asyncrl")
    root = tmp_path / "checkpoints"
    _checkpoint(root, 4, with_model=True)
    _checkpoint(root, 9, with_model=True)
    out = tmp_path / "exported"
    proc = subprocess.run([exe, "export", str(root), str(out)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "exported step 9" in proc.stdout  # a directory of checkpoints: its newest
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = subprocess.run([exe, "export", str(root), str(out)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert again.returncode == 2 and "exists. Fix: pick another OUT or pass --force" in (
        again.stderr
    )
    forced = subprocess.run([exe, "export", str(root / "step-00000004"), str(out), "--force"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert forced.returncode == 0 and "exported step 4" in forced.stdout


def test_export_refusals(tmp_path: Path, capsys) -> None:
    bare = _checkpoint(tmp_path / "bare", 2, with_model=False)
    assert main(["export", str(bare), str(tmp_path / "o")]) == 2
    assert "holds no model (it was saved with checkpoint.save_model = false). Fix" in (
        capsys.readouterr().err
    )
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_of_a_corrupted_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    """A flipped byte in the saved model, or one file too many: nothing is exported, the
    message names the file and an older checkpoint to export."""
    root = tmp_path / "checkpoints"
    older = _checkpoint(root, 4, with_model=True)
    newest = _checkpoint(root, 9, with_model=True)
    weights = newest / "model" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:7] + b"\x01" + intact[8:])
    out = tmp_path / "o"
    assert main(["export", str(root), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: error: ") and err.count("\n") == 1, err
    assert (
        f"checkpoint {newest} is corrupt: model/model.safetensors does not match its sha256 in "
        f"the manifest. Fix: export an older checkpoint, e.g. asyncrl export {older} OUT"
    ) in err
    assert not out.exists() and not (tmp_path / ".tmp-o").exists()
    weights.write_bytes(intact)
    (newest / "model" / "extra.bin").write_bytes(b"?")
    assert main(["export", str(root), str(out)]) == 2
    assert "model/extra.bin is not in the manifest" in capsys.readouterr().err
    (newest / "model" / "extra.bin").unlink()
    assert main(["export", str(root), str(out)]) == 0  # intact again: exported
    assert (out / "model.safetensors").read_bytes() == intact


def test_plugins_lists_every_group_and_names_a_broken_one(tmp_path: Path) -> None:
    """``asyncrl plugins`` through the console script: the shipped plugins by group with
    their distribution and version; an installed distribution whose target does not import
    (a stand-in dist-info on the path) is shown with its error, and the exit code is 1."""
    import os

    exe = str(Path(sys.executable).parent / "asyncrl")
    proc = subprocess.run([exe, "plugins"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "asyncrl.samplers (samplers)" in lines
    assert any(line.split()[:2] == ["in_order", "asyncrl"] for line in lines)
    assert any(line.split()[:2] == ["repeat-digit", "asyncrl-example-backend"] for line in lines)
    assert "BROKEN" not in proc.stdout

    dist = tmp_path / "broken_env-1.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-env\nVersion: 1.2\n")
    (dist / "entry_points.txt").write_text(
        "[asyncrl.environments]\nbroken = no_such_module_for_asyncrl:make\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([exe, "plugins"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1
    text = proc.stdout
    (line,) = [x for x in text.splitlines() if x.split()[:1] == ["broken"]]
    assert line.split() == ["broken", "broken-env", "1.2", "(no_such_module_for_asyncrl:make)"]
    assert "BROKEN: ModuleNotFoundError: No module named 'no_such_module_for_asyncrl'" in text
    assert text.rstrip().endswith("1 plugin cannot be used (see BROKEN above)")


def _bigram_config(tmp_path: Path, **environment: object) -> Path:
    from asyncrl_example_backend.model import write_model_dir

    model = write_model_dir(tmp_path / "model")
    path = tmp_path / "run.toml"
    options = ", ".join(f"{k} = {v!r}" for k, v in environment.items())
    path.write_text(
        f'[model]\npath = "{model}"\n[environment]\nname = "repeat-digit"\n'
        f"options = {{ {options} }}\n"
        '[trainer]\nbackend = "bigram"\n[generator]\nbackend = "bigram"\n'
        '[grpo]\nprompts_per_step = 4\n'
    )
    return path


def test_check_config_runs_the_plugins_checks_through_the_console_script(
    tmp_path: Path,
) -> None:
    """What `asyncrl run` checks before it spawns (plugins, environment options, tokenizer,
    backend options) is checked by `check-config` too, and a mistake there exits 2."""
    exe = str(Path(sys.executable).parent / "asyncrl")
    good = _bigram_config(tmp_path / "good")
    proc = subprocess.run([exe, "check-config", str(good)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every plugin's options are fine" in proc.stdout
    for args, named in (
        (["--set", "generator.backend=nope"], "generator.backend: no generation backend named"),
        (["--set", "trainer.options.lr=-1"], "trainer.options"),
        (["--set", "metrics.sinks=['jsonl','nope']"], "metrics.sinks"),
        # repeat-digit has 64 train prompts by default
        (["--set", "grpo.prompts_per_step=65"],
         "grpo.prompts_per_step: the train split of environment 'repeat-digit' has 64 prompts"),
    ):
        bad = subprocess.run([exe, "check-config", str(good), *args], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert named in bad.stdout, (args, bad.stdout)
        ok = subprocess.run([exe, "check-config", str(good), *args, "--config-only"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
        assert ok.returncode == 0, (args, ok.stdout)  # the file alone is fine
    bad_env = _bigram_config(tmp_path / "bad", no_such_option=1)
    proc = subprocess.run([exe, "check-config", str(bad_env)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "environment.options" in proc.stdout, proc.stdout


def test_export_of_non_finite_weights_is_refused(tmp_path: Path, capsys) -> None:
    """A checkpoint whose model holds a NaN and an infinity (as one written before saves were
    checked could): its checksums hold, and nothing is exported all the same."""
    root = tmp_path / "checkpoints"
    older = _checkpoint(root, 4, with_model=True)
    newest = _checkpoint(root, 9, with_model=True,
                         weights=[0.0, float("nan"), 1.0, float("-inf")])  # fmt: skip
    out = tmp_path / "o"
    assert main(["export", str(root), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: error: ") and err.count("\n") == 1, err
    assert (
        f"checkpoint {newest} holds non-finite weights: 2 NaN or infinite values in w "
        "(model.safetensors; tensors affected: 1). Fix: export an older checkpoint"
    ) in err
    assert not out.exists() and not (tmp_path / ".tmp-o").exists()
    assert main(["export", str(older), str(out)]) == 0
