"""``asyncrl check-config`` with the gateway's managed agents on a whole install: the
gateway (plugins/asyncrl-gateway) and the example ``bigram`` backend together. (The
gateway's own checks of an agent command: plugins/asyncrl-gateway/tests/test_managed_agents.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("asyncrl_gateway")
pytest.importorskip("asyncrl_example_backend")


def test_check_config_refuses_an_agent_that_cannot_run_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: ``["python", "agent.py"]`` beside the config; check-config (what
    ``asyncrl run`` checks first) started elsewhere. An import the run's interpreter lacks
    exits 2 naming it; the agent fixed, it passes."""
    from asyncrl.cli import main
    from asyncrl_example_backend.model import write_model_dir

    conf = tmp_path / "conf"
    conf.mkdir()
    model = write_model_dir(conf / "model")
    path = conf / "run.toml"
    path.write_text(f'[model]\npath = "{model}"\n[environment]\nname = "repeat-digit"\n'
                    '[trainer]\nbackend = "bigram"\n[generator]\nbackend = "bigram"\n'
                    '[grpo]\nprompts_per_step = 4\n'
                    '[gateway]\nenabled = true\nagent = ["python", "agent.py"]\n')  # fmt: skip
    (conf / "agent.py").write_text("import json, sys\nimport no_such_module_for_the_agent\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check-config", str(path)]) == 2
    out = capsys.readouterr().out
    assert "invalid: gateway.agent:" in out
    assert "No module named 'no_such_module_for_the_agent'" in out
    (conf / "agent.py").write_text("import json, sys\nimport httpx\n")  # in the run's venv
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().out
