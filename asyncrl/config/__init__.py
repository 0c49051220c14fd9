"""Run configuration: msgspec structs loaded from TOML.

Every struct is frozen, keyword-only and rejects unknown fields, so a typo is an error that
names the field. Cross-field invariants are checked by :func:`validate` right after loading,
before any worker is spawned. Backend, environment and sampler options stay opaque tables here;
each plugin converts its own table with ``msgspec.convert``.

The sections live by theme, each with its checks (docs/configuration.md is generated from
their field docstrings by ``scripts/gen_config_docs.py``):

============== ===========================================================================
``setup``      ``[run]``, ``[model]``, ``[cluster]``, ``[environment]``
``algorithm``  ``[grpo]``, ``[loss]``, ``[pipeline]`` (the sampler table and the capacities)
``engines``    ``[refit]``, ``[trainer]``, ``[generator]``
``operations`` ``[eval]``, ``[checkpoint]``, ``[export]``, ``[failures]``, ``[metrics]``
``root``       :class:`Config`, what derives from it, :func:`problems`, :func:`validate`
``loading``    :func:`load_config`, :func:`from_dict`, :func:`to_dict`
``removed``    keys that existed once, each with what replaced it (the loader's error)
``modes``      what the asynchrony settings amount to (``asyncrl check-config``'s report)
============== ===========================================================================

A service's section (``[gateway]``) is not here: its plugin defines it, and the loader keeps
it in ``Config.services`` (:mod:`asyncrl.services`); :data:`CORE_SECTIONS` names the core's.

:func:`explain` (msgspec's validation errors as ``<field>: <problem>. Fix: <fix>.``) lives in
:mod:`asyncrl.explain`, at the bottom of the package; it is re-exported here.

Import names from here (``from asyncrl.config import Config, load_config``); the modules are
the layout, not the API.
"""

from __future__ import annotations

from asyncrl.config.adapters import LoraConfig
from asyncrl.config.algorithm import GRPOConfig, LossConfig, PipelineConfig
from asyncrl.config.engines import GeneratorConfig, RefitConfig, TrainerConfig
from asyncrl.explain import explain
from asyncrl.config.loading import (
    from_dict,
    load_config,
    load_unvalidated,
    parse_overrides,
    to_dict,
)
from asyncrl.config.operations import (
    CheckpointConfig,
    EvalConfig,
    ExportConfig,
    FailuresConfig,
    MetricsConfig,
)
from asyncrl.config.root import (
    CORE_SECTIONS,
    Config,
    problems,
    required_buffer_capacity,
    validate,
)
from asyncrl.config.setup import ClusterConfig, EnvironmentConfig, ModelConfig, RunConfig
from asyncrl.policy.sampler_choice import make_sampler, resolve_sampler

__all__ = [
    "explain",
    "CORE_SECTIONS",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "EnvironmentConfig",
    "EvalConfig",
    "ExportConfig",
    "FailuresConfig",
    "GeneratorConfig",
    "GRPOConfig",
    "LoraConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "PipelineConfig",
    "RefitConfig",
    "RunConfig",
    "TrainerConfig",
    "from_dict",
    "load_config",
    "load_unvalidated",
    "make_sampler",
    "parse_overrides",
    "problems",
    "required_buffer_capacity",
    "resolve_sampler",
    "to_dict",
    "validate",
]
