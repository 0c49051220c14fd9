"""The whole run configuration: :class:`Config`, the values derived from it, and its checks.

Each section checks itself (``problems()`` next to its fields); :func:`problems` gathers them
and :func:`validate` raises the first. Plugin answers the core needs are asked of the plugin,
never decided by its name here: the sampler says what capacity it needs, the weight transfer
whether a restarted rollout worker can join it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.config.adapters import LoraConfig
from asyncrl.config.algorithm import GRPOConfig, LossConfig, PipelineConfig
from asyncrl.config.engines import GeneratorConfig, RefitConfig, TrainerConfig
from asyncrl.config.episodes import EpisodeConfig
from asyncrl.config.jobs import learning_rate, merged_table, table_problems
from asyncrl.config.operations import (
    CheckpointConfig,
    EvalConfig,
    ExportConfig,
    FailuresConfig,
    MetricsConfig,
)
from asyncrl.config.section import Section, fail
from asyncrl.config.setup import ClusterConfig, EnvironmentConfig, ModelConfig, RunConfig
from asyncrl.errors import ConfigError
from asyncrl.explain import explain
from asyncrl.policy.sampler_choice import make_sampler, resolve_sampler
from asyncrl.policy.samplers import Sampler
from asyncrl.transfers import load_transfer

__all__ = ["CORE_SECTIONS", "Config", "Job", "derive_job", "problems", "required_buffer_capacity",
           "validate"]


class Config(Section, dict=True):
    """The run's configuration, one section per TOML table (docs/configuration.md).

    ``dict=True`` gives each instance room for what is derived from it once
    (:attr:`sampler`, :attr:`rollout_restarts`); it is never encoded, compared or copied
    (``msgspec.structs.replace`` makes a config that derives its own).
    """

    model: ModelConfig
    environment: EnvironmentConfig
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss: LossConfig = LossConfig()
    pipeline: PipelineConfig = PipelineConfig()
    refit: RefitConfig = RefitConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraConfig = LoraConfig()
    generator: GeneratorConfig = GeneratorConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()
    failures: FailuresConfig = FailuresConfig()
    metrics: MetricsConfig = MetricsConfig()
    episode: EpisodeConfig = EpisodeConfig()
    services: dict[str, Any] = {}
    """Each service's section (``asyncrl.services``), by the service's name, as its plugin's
    struct: the top-level table of that name (``[gateway]``), which the loader converts with
    the service's ``section`` type (:func:`asyncrl.config.loading.from_dict`). Not a table of
    the TOML itself: the core names no service."""
    jobs: dict[str, dict[str, Any]] = {}
    """``[jobs.<name>]``: the run's jobs, each table as written, its settings over the run's
    (:mod:`asyncrl.config.jobs`; docs/jobs.md). Empty: the run is one job, its own."""

    @functools.cached_property
    def sampler(self) -> Sampler:
        """The sampler ``[pipeline.sampler]`` names, built once for this config: it answers
        for the run's capacities, staleness bound and mode (``asyncrl check-config``). Ask it,
        never drive it: a sampler keeps state, so a run's scheduler gets one of its own from
        :meth:`make_sampler`.

        Raises:
            ConfigError: as :func:`~asyncrl.policy.sampler_choice.make_sampler` (nothing is
                kept, so each read raises again).
        """
        return make_sampler(self.pipeline.sampler)

    @functools.cached_property
    def rollout_restarts(self) -> int:
        """``failures.rollout_restarts``, or 0 when the ``refit.transport`` cannot take a
        restarted rollout worker (its ``WeightTransfer.takes_new_readers`` is false: a
        plugin's collective group that cannot be formed again). Loads the transfer's module, which imports
        no torch."""
        transfer = load_transfer(self.refit.transport)
        return self.failures.rollout_restarts if transfer.takes_new_readers else 0

    @property
    def min_groups_for_streaming_train(self) -> int:
        return self.pipeline.min_groups_for_streaming_train or self.grpo.prompts_per_step

    @property
    def max_buffered_groups(self) -> int:
        return self.pipeline.max_buffered_groups or required_buffer_capacity(self)

    @property
    def max_inflight_samples(self) -> int:
        return self.pipeline.max_inflight_samples or (
            self.max_buffered_groups * self.grpo.samples_per_prompt
        )

    def make_sampler(self) -> Sampler:
        """A fresh :class:`~asyncrl.policy.samplers.Sampler` for this run's scheduler, which
        owns its state (questions about the policy go to :attr:`sampler`)."""
        return make_sampler(self.pipeline.sampler)

    @functools.cached_property
    def job_list(self) -> dict[str, Job]:
        """Each of :attr:`jobs`, its config whole (:func:`derive_job`), by name in the order
        written; empty without jobs.

        Raises:
            ConfigError: as :func:`derive_job`.
        """
        return {name: derive_job(self, name, table) for name, table in self.jobs.items()}


CORE_SECTIONS = tuple(name for name in Config.__struct_fields__ if name != "services")
"""The core's top-level tables, in order; any other is a service's section (or a mistake)."""


def required_buffer_capacity(config: Config) -> int:
    """Groups the buffer must hold so that the pumps can never deadlock (the sampler's rule)."""
    return config.sampler.required_buffer_capacity(config.grpo.prompts_per_step)


def problems(config: Config) -> list[ConfigError]:
    """Every broken cross-field invariant, each a :class:`ConfigError` naming the field and
    the fix (``asyncrl check-config`` prints them all): each section's own checks in the order
    of the reference (docs/configuration.md), then the model directory's files."""
    out: list[ConfigError] = []
    for section in (config.run, config.cluster, config.grpo, config.loss):
        out += section.problems()
    out += _pipeline_problems(config)
    for section in (
        config.refit, config.trainer, config.generator, config.environment, config.eval,
        config.checkpoint, config.export, config.failures, config.metrics, config.episode,
        *config.services.values(),  # each service's section: its problems() checked as it loaded
    ):  # fmt: skip
        out += section.problems()
    out += config.lora.problems(config.model.path)
    if config.lora.enabled and config.loss.reference_path:
        out.append(fail(
            "loss.reference_path", "is set, but with [lora] the KL reference is the base "
            "itself (model.path with the adapter disabled; no second model is loaded)",
            "leave loss.reference_path empty with [lora]",
        ))  # fmt: skip
    out += config.model.problems()
    if config.jobs:
        out += run_problems(config)
        if not out:  # each job's config whole, once the run's is
            try:
                config.job_list
            except ConfigError as exc:
                out.append(exc)
    return out


@dataclass(frozen=True)
class Job:
    """One job of a run, derived from its table (:func:`derive_job`)."""

    name: str
    weight: float
    """Its share of the engines' request slots, against the other jobs' weights."""
    lr: float
    """Its adapter's learning rate (``OpenJob.lr``)."""
    config: Config
    """The run's config with the job's tables merged over it: its sections are the job's."""


def run_problems(config: Config) -> list[ConfigError]:
    """What a run with jobs needs beyond each job's own config (which
    :func:`derive_job` checks): tables a job may have, no service, the
    engines and the trainer resident (no turns). Whether the backends serve and train jobs
    (and with what: the ``fsdp2`` trainer and the vLLM engine need ``[lora]`` and slots
    enough) is theirs to say (their ``check_config``; the workers' capabilities)."""
    out = []
    for name, table in config.jobs.items():
        out += table_problems(name, table)
    served = [name for name, section in config.services.items() if section.enabled]
    if served:
        out.append(fail(served[0], "is enabled, but the run has jobs: a service stands in "
                        "front of one run's environment", f"run [{served[0]}] without jobs "
                        "(docs/jobs.md)"))  # fmt: skip
    if config.cluster.placement == "take_turns":
        out.append(fail("cluster.placement", "is \"take_turns\", but the run has jobs: the "
                        "trainer's state offload moves the run's own optimizer only",
                        "use cluster.placement = \"resident\" with jobs"))  # fmt: skip
    return out


def derive_job(config: Config, name: str, table: dict[str, Any]) -> Job:
    """Job ``name`` of the run of ``config``: ``table`` (its ``[jobs.<name>]``, paths made
    absolute as the config loaded) over the run's config
    (:func:`~asyncrl.config.jobs.merged_table`), converted and validated as a run's.

    Raises:
        ConfigError: the table is wrong (:func:`~asyncrl.config.jobs.table_problems`), or the
            job's config is (the error prefixed with ``jobs.<name>``), or no ``lr``.
    """
    found = table_problems(name, table)
    if found:
        raise found[0]
    run = msgspec.to_builtins(config)
    run.pop("jobs"), run.pop("services")  # a run of jobs has no service (run_problems)
    data = merged_table(run, name, table)
    try:
        job = validate(msgspec.convert(data, Config))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"jobs.{name}: {explain(exc, Config)}") from None
    except ConfigError as exc:
        raise ConfigError(f"jobs.{name}: {exc}") from None
    lr = learning_rate(name, table, config.trainer.options)
    return Job(name, float(table.get("weight", 1.0)), lr, job)


def validate(config: Config) -> Config:
    """Check cross-field invariants; raise :class:`ConfigError` naming the field and the fix
    of the first one broken. Returns the config with ``[pipeline.sampler]`` resolved to its
    sampler's struct (and that config's :attr:`Config.sampler` already built by the checks).

    Raises:
        ConfigError: the first of :func:`problems`.
    """
    try:
        config = _with_sampler_struct(config)
    except ConfigError:
        pass  # problems() names it, with every other broken invariant
    found = problems(config)
    if found:
        raise found[0]
    return config


def _with_sampler_struct(config: Config) -> Config:
    """``config`` with ``[pipeline.sampler]`` as its sampler's struct (itself if it is one)."""
    p = config.pipeline
    struct = resolve_sampler(p.sampler)
    if struct is p.sampler:
        return config
    return msgspec.structs.replace(config, pipeline=msgspec.structs.replace(p, sampler=struct))


def _pipeline_problems(config: Config) -> list[ConfigError]:
    """``[pipeline]``'s own checks, its sampler (the table names an installed one with knobs
    it accepts) and the checks that need the whole config: the capacities against
    ``[grpo]`` and the sampler's rule (skipped when a capacity or the sampler is broken: they
    would only repeat it)."""
    g, p = config.grpo, config.pipeline
    out = p.problems()
    try:
        sampler = config.sampler
    except ConfigError as exc:
        return out + [exc]
    if out:
        return out
    if config.min_groups_for_streaming_train > g.prompts_per_step:
        out.append(
            fail(
                "pipeline.min_groups_for_streaming_train",
                f"{p.min_groups_for_streaming_train} exceeds grpo.prompts_per_step "
                f"({g.prompts_per_step}); a step could never start",
                f"set it to at most {g.prompts_per_step}",
            )
        )
    chunk = p.min_groups_for_streaming_train
    if config.cluster.placement == "take_turns" and 0 < chunk < g.prompts_per_step:
        out.append(fail(
            "pipeline.min_groups_for_streaming_train",
            f"{chunk} streams chunks into a step while the engines generate, but with "
            "cluster.placement = \"take_turns\" the trainer steps only while they sleep, so a "
            "step's groups go to it at once",
            "set it to 0 (or remove it), or use cluster.placement = \"resident\"",
        ))  # fmt: skip
    need = required_buffer_capacity(config)
    if config.max_buffered_groups < need:
        out.append(
            fail(
                "pipeline.max_buffered_groups",
                f"{p.max_buffered_groups} is below what the {sampler.name} sampler needs "
                f"({need} groups for prompts_per_step={g.prompts_per_step}; docs/modes.md); "
                "the pumps would deadlock",
                f"set pipeline.max_buffered_groups >= {need} (or 0 for the default)",
            )
        )
    if config.max_inflight_samples < g.samples_per_prompt:
        out.append(
            fail(
                "pipeline.max_inflight_samples",
                f"{p.max_inflight_samples} cannot hold one group ({g.samples_per_prompt} samples)",
                f"set it to at least grpo.samples_per_prompt ({g.samples_per_prompt}), or 0",
            )
        )
    return out
