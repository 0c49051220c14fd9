"""What the controller checks before any process or file exists: the plugins load, the
environment (its optional capabilities checked: :mod:`asyncrl.env.capabilities`) and the
tokenizer load, the prompts fit, each service accepts the run (the
gateway's managed agent command runs once), both backends accept
their config, ``/dev/shm`` and the run's directories have room enough
(:mod:`asyncrl.procs.space`), and so do the GPUs (the memory plan,
:mod:`asyncrl.procs.gpu_memory`); each mistake a ``ConfigError`` naming its field."""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import anyio

from asyncrl import registry
from asyncrl.backend import BackendPlugin
from asyncrl.data.chat import ChatTemplate
from asyncrl.env.capabilities import check_environment
from asyncrl.env.episode import EpisodeEnvironment
from asyncrl.config import Config
from asyncrl.errors import AsyncRLError, ConfigError, config_error
from asyncrl.data.prompts import Tokenizer
from asyncrl.services import enabled_services, load_service
from asyncrl.sinks import check_sinks
from asyncrl.procs.gpu_memory import MemoryPlan, gpu_totals, plan_memory
from asyncrl.procs.space import check_space
from asyncrl.transfers import STAGING_BUFFERS

__all__ = ["Preflight", "check_before_spawn", "checked_environment", "end_token_ids",
           "make_environment", "memory_plan"]


class Preflight(NamedTuple):
    """What the checks before spawning made, for the run to use."""

    environment: Any
    tokenizer: Tokenizer
    memory: MemoryPlan
    """The memory plan on this host's GPUs (no verdict without them); its model shape says
    the longest sequence the run trains."""


async def check_before_spawn(cfg: Config) -> Preflight:
    """Load the environment and the tokenizer, measure the prompts and run both backends'
    ``check_config``: every mistake a plugin can see is a ``ConfigError`` (or
    ``PluginError``) naming its field, raised before any process or file exists (an
    environment that does not keep its contract: a ``PluginError`` naming it and the member,
    :func:`~asyncrl.env.capabilities.check_environment`)."""
    await anyio.to_thread.run_sync(check_sinks, cfg)  # imports the trackers' packages
    trainer = BackendPlugin.of(
        registry.load("asyncrl.training_backends", cfg.trainer.backend, "trainer.backend")
    )
    generator = BackendPlugin.of(
        registry.load("asyncrl.generation_backends", cfg.generator.backend, "generator.backend")
    )
    environment = checked_environment(cfg)
    tokenizer = Tokenizer(
        os.path.join(cfg.model.path, "tokenizer.json"),
        _eos_token_id(cfg.model.path),
        ChatTemplate.from_model(cfg.model.path, cfg.model.chat_template),
    )
    for name in enabled_services(cfg):
        await load_service(name, f"{name}.enabled").check(cfg, environment, tokenizer)
    longest = await anyio.to_thread.run_sync(_longest_prompt, environment, tokenizer, cfg)
    for job in cfg.job_list.values():  # each job's environment, prompts and limits too
        try:
            job_env = await anyio.to_thread.run_sync(checked_environment, job.config)
            job_longest = await anyio.to_thread.run_sync(_longest_prompt, job_env, tokenizer,
                                                         job.config)  # fmt: skip
            for section, plugin in (("trainer", trainer), ("generator", generator)):
                if plugin.check_config is not None:
                    with _plugin_errors(f"{section}.options", f"the {section} backend "
                                        f"{getattr(cfg, section).backend!r} refused the job",
                                        f"correct [jobs.{job.name}] or [{section}.options]"):
                        plugin.check_config(job.config, max_prompt_tokens=job_longest)
        except ConfigError as exc:
            raise ConfigError(f"jobs.{job.name}: {exc}") from None
    for section, plugin in (("trainer", trainer), ("generator", generator)):
        if cfg.lora.enabled and not plugin.adapters:
            backend = getattr(cfg, section).backend
            raise config_error(
                f"{section}.backend",
                f"the {section} backend {backend!r} does not "
                f"{'train' if section == 'trainer' else 'serve'} LoRA adapters (lora.rank = "
                f"{cfg.lora.rank}; docs/lora.md says which backends do)",
                "train the full weights (lora.rank = 0), or use a backend that does",
            )
        if plugin.check_config is not None:
            backend = getattr(cfg, section).backend
            with _plugin_errors(
                f"{section}.options",
                f"the {section} backend {backend!r} refused the config",
                f"correct [{section}.options] (docs/backends/ lists each backend's options)",
            ):
                plugin.check_config(cfg, max_prompt_tokens=longest)
    engines = {
        f"{section}.backend": plugin.shm_bytes(cfg)
        for section, plugin in (("trainer", trainer), ("generator", generator))
        if plugin.shm_bytes is not None
    }
    need = functools.partial(check_space, cfg, engines, staging_buffers=STAGING_BUFFERS)
    await anyio.to_thread.run_sync(need)  # /dev/shm, disks: room enough
    # a multi-turn episode (the environment's, or a service's sessions) grows to its context
    episodic = isinstance(environment, EpisodeEnvironment) or bool(enabled_services(cfg))
    sequence = cfg.episode.max_context_tokens if episodic else longest + cfg.grpo.max_new_tokens
    plan = await anyio.to_thread.run_sync(  # nvidia-smi, the safetensors headers: off the loop
        lambda: plan_memory(cfg, trainer.gpu_memory, generator.gpu_memory, gpu_totals(),
                            longest_sequence=sequence)  # fmt: skip
    )
    for problem in plan.problems():  # the GPUs: room enough at the processes' peaks
        raise problem
    return Preflight(environment, tokenizer, plan)


def checked_environment(cfg: Config) -> Any:
    """The configured environment (:func:`make_environment`), its optional capabilities
    checked once (a way to score unless a service stands in front of it), with one step's
    prompts at least; a job's too (docs/jobs.md).

    Raises:
        ConfigError: the factory refused its options, or the train split is too small.
        PluginError: the environment does not keep its contract.
    """
    environment = make_environment(cfg)
    check_environment(environment, cfg.environment.name, scored=not enabled_services(cfg))
    train = len(environment.dataset("train"))
    if train < cfg.grpo.prompts_per_step:
        raise config_error(
            "grpo.prompts_per_step",
            f"the train split of environment {cfg.environment.name!r} has {train} prompts, "
            f"fewer than one step's {cfg.grpo.prompts_per_step}",
            "give the environment more prompts, or lower grpo.prompts_per_step",
        )
    return environment


def memory_plan(cfg: Config, gpus: list[int] | None, *, longest_sequence: int = 0) -> MemoryPlan:
    """The run's memory plan on ``gpus`` (each GPU's bytes; ``None``: unknown here), its
    sequences at most ``longest_sequence`` tokens (0: not known), from its backends'
    ``gpu_memory`` (:mod:`asyncrl.procs.gpu_memory`): for planning on other GPUs than this
    host's, which :func:`check_before_spawn` plans on."""
    trainer = BackendPlugin.of(
        registry.load("asyncrl.training_backends", cfg.trainer.backend, "trainer.backend")
    )
    generator = BackendPlugin.of(
        registry.load("asyncrl.generation_backends", cfg.generator.backend, "generator.backend")
    )
    return plan_memory(cfg, trainer.gpu_memory, generator.gpu_memory, gpus,
                       longest_sequence=longest_sequence)  # fmt: skip


@contextmanager
def _plugin_errors(field: str, what: str, fix: str) -> Iterator[None]:
    """A plugin that raises an exception of its own kind (not an asyncrl error): still one
    ``ConfigError`` line naming ``field``, with the plugin's message."""
    try:
        yield
    except AsyncRLError:
        raise
    except Exception as exc:
        raise config_error(field, f"{what}: {type(exc).__name__}: {exc}", fix) from exc


def make_environment(cfg: Config) -> Any:
    """The configured environment, from its ``asyncrl.environments`` factory: called as
    ``factory(options, seed)``, with ``base_dir=`` too when the factory takes it
    (:func:`check_before_spawn` then checks it against the environment contract).

    Raises:
        ConfigError: the factory refused its options.
    """
    make_env = registry.load("asyncrl.environments", cfg.environment.name, "environment.name")
    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(make_env).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no keywords
        params = {}
    if "base_dir" in params:
        kwargs["base_dir"] = cfg.environment.base_dir
    with _plugin_errors(
        "environment.options",
        f"environment {cfg.environment.name!r} refused its options",
        "correct [environment.options] (the environment's own documentation lists them)",
    ):
        return make_env(dict(cfg.environment.options), cfg.run.seed, **kwargs)


def _longest_prompt(environment: Any, tokenizer: Tokenizer, cfg: Config) -> int:
    """Tokens in the longest prompt the run can send (the train split and the evaluated part
    of the eval split). Chat prompts are rendered here, so a chat prompt without a chat
    template, or one the template rejects, is a ``ConfigError`` before any process starts."""
    prompts = list(environment.dataset("train"))
    if cfg.eval.num_prompts:
        prompts += list(environment.dataset("eval"))[: cfg.eval.num_prompts]
    longest = 0
    for start in range(0, len(prompts), 4096):
        ids = tokenizer.encode_prompts(prompts[start : start + 4096])
        longest = max([longest, *(len(x) for x in ids)])
    return longest


def _eos_token_id(model_path: str) -> int | None:
    ids = end_token_ids(model_path)
    return ids[0] if ids else None


def end_token_ids(model_path: str) -> list[int]:
    """The ids that end a generation (what the engine stops on): the model's generation
    config's ``eos_token_id`` (one or a list), else its config's; ``[]`` when neither says."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids = eos if isinstance(eos, list) else [eos]
        ids = [int(i) for i in ids if i is not None]
        if ids:
            return ids
    return []
