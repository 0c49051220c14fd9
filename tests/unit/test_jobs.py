"""``[jobs.<name>]`` tables (asyncrl/config/jobs.py), a job's view of the control plane and
the engines' shares (asyncrl/run/jobs.py): each job's config is the run's with the job's
sections over it, under directories of its own; what a job may not set is refused naming the
field and the fix; each request a job's pipeline sends names the job; the engines' samples are
split by weight, each job's dispatch held to its share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import from_dict, to_dict
from asyncrl.errors import ConfigError
from asyncrl.config import modes
from asyncrl.run.jobs import JobControl, shares
from asyncrl.wire.messages import Abort, BeginStep, Generate, GenRequest, Health, SaveState


def _run(model_dir: Path, jobs: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"model": {"path": str(model_dir)}, "environment": {"name": "env", "base_dir": "data"},
            "run": {"output_dir": "out", "name": "sweep", "seed": 5},
            "trainer": {"options": {"lr": 0.01}}, "jobs": jobs, **over}  # fmt: skip


def test_a_job_is_the_run_with_its_sections_over_it(model_dir: Path, tmp_path: Path) -> None:
    cfg = from_dict(_run(model_dir, {
        "math": {"weight": 2, "lr": 1e-4, "run": {"num_steps": 7},
                 "environment": {"options": {"n": 3}}},
        "code": {"environment": {"name": "other", "base_dir": "elsewhere"},
                 "grpo": {"samples_per_prompt": 4}},
    }), base_dir=tmp_path)  # fmt: skip
    math, code = cfg.job_list["math"], cfg.job_list["code"]
    assert list(cfg.job_list) == ["math", "code"]
    assert (math.weight, math.lr, code.weight, code.lr) == (2.0, 1e-4, 1.0, 0.01)
    m, c = math.config, code.config
    assert (m.run.num_steps, m.run.seed, m.run.name) == (7, 5, "sweep.math")
    assert m.environment.name == "env" and m.environment.options == {"n": 3}
    assert m.environment.base_dir == c.model.path.replace("model", "data")  # the run's
    assert (c.environment.name, c.environment.base_dir) == ("other", str(tmp_path / "elsewhere"))
    assert c.environment.options == {}  # another environment: none of the run's options
    assert c.grpo.samples_per_prompt == 4
    assert m.grpo.samples_per_prompt == cfg.grpo.samples_per_prompt
    out = tmp_path / "out"
    assert m.run.output_dir == str(out / "jobs/math")
    assert m.checkpoint.dir == str(out / "checkpoints/jobs/math")
    assert m.export.dir == str(out / "hf/jobs/math")
    assert m.jobs == {} and m.model == cfg.model and m.trainer == cfg.trainer
    again = from_dict(to_dict(cfg))
    assert again == cfg and again.job_list["code"].config == c


@pytest.mark.parametrize(("jobs", "field", "fix"), [
    ({"a b": {}}, "jobs.a b", "letters, digits"),
    ({"a:b": {}}, "jobs.a:b", "letters, digits"),
    ({"a": {"model": {"path": "x"}}}, "jobs.a.model", "set it at the top level"),
    ({"a": {"generator": {}}}, "jobs.a.generator", "set it at the top level"),
    ({"a": {"colour": 1}}, "jobs.a.colour", "a job sets weight, lr"),
    ({"a": {"run": {"output_dir": "x"}}}, "jobs.a.run.output_dir", "remove it"),
    ({"a": {"checkpoint": {"dir": "x"}}}, "jobs.a.checkpoint.dir", "remove it"),
    ({"a": {"weight": 0}}, "jobs.a.weight", "positive number"),
    ({"a": {"lr": "fast"}}, "jobs.a.lr", "positive number"),
    ({"a": {"run": 3}}, "jobs.a.run", "as a [jobs.a.run] table"),
    ({"a": {"grpo": {"samples_per_prompt": 0}}}, "jobs.a: grpo.samples_per_prompt", ""),
    ({"a": {"grpo": {"nope": 1}}}, "jobs.a: grpo.nope", "remove or rename it"),
])  # fmt: skip
def test_what_a_job_may_not_set_is_refused_naming_the_field(
    model_dir: Path, tmp_path: Path, jobs: dict[str, Any], field: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(_run(model_dir, jobs), base_dir=tmp_path)
    assert str(err.value).startswith(f"{field}:") and fix in str(err.value)


def test_a_job_without_a_learning_rate_and_turns_are_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    data = _run(model_dir, {"a": {}})
    data["trainer"] = {}
    with pytest.raises(ConfigError, match=r"^jobs\.a\.lr: is not set, and neither is"):
        from_dict(data, base_dir=tmp_path)
    data["jobs"] = {"a": {"lr": 0.1}}
    data["cluster"] = {"placement": "take_turns"}
    with pytest.raises(ConfigError, match="^cluster.placement: .*jobs"):
        from_dict(data, base_dir=tmp_path)


def test_a_jobs_requests_name_it_and_nothing_else_changes() -> None:
    view = JobControl(None, "math")  # type: ignore[arg-type]  # stamp() touches no socket
    gen = Generate(requests=[GenRequest(group_id=f"math:g{i}", prompt_ids=[1], n=2, max_tokens=4)
                             for i in range(3)])  # fmt: skip
    stamped = view.stamp(gen)
    assert [r.job for r in stamped.requests] == ["math"] * 3
    assert [r.group_id for r in stamped.requests] == [r.group_id for r in gen.requests]
    assert view.stamp(BeginStep(step=4)) == BeginStep(step=4, job="math")
    assert view.stamp(SaveState(path="/p")).job == "math"
    for untouched in (Abort(group_ids=["math:g1"]), Health()):
        assert view.stamp(untouched) is untouched  # no job field: as it was


def test_the_engines_samples_are_split_by_weight() -> None:
    assert shares(64, {"a": 1.0, "b": 3.0}) == {"a": 16, "b": 48}
    assert shares(10, {"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 3, "b": 3, "c": 3}  # never more
    assert shares(64, {"a": 2.5}) == {"a": 64}


def test_a_jobs_dispatch_is_held_to_its_share(model_dir: Path, tmp_path: Path) -> None:
    """A table given a share dispatches groups only while its samples in flight stay within
    it (at least one group, at most the cap), and again once they fall."""
    from asyncrl.run.rollout_phase import RolloutPhase

    cfg = from_dict(_run(model_dir, {}, grpo={"prompts_per_step": 8, "samples_per_prompt": 4},
                         pipeline={"max_inflight_samples": 32}), base_dir=tmp_path)  # fmt: skip
    table = modes.make_groups(cfg, 64)
    phase = RolloutPhase(table, ["rollout:0"])
    prompt = (type("P", (), {"id": "p", "display": "p"})(), [1, 2])

    def fill() -> int:
        sent = 0
        while type(phase.dispatch(["rollout:0"], lambda i: prompt, 0.0)).__name__ == "Sent":
            sent += 1
        return sent

    table.share(10)
    assert fill() == 2 and table.inflight_samples == 8  # a third group would make 12 > 10
    table.share(1)
    assert table.inflight_share == 4  # one group, always
    table.share(1000)
    assert table.inflight_share == 32 and fill() == 6 and table.inflight_samples == 32
