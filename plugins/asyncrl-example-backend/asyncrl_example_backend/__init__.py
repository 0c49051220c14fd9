"""asyncrl-example-backend: the reference backend plugin, a bigram language model in numpy.

It is two things at once:

* **the example plugin authors copy.** A separate distribution that asyncrl finds only through
  entry points (see ``pyproject.toml``); each module is small and does one job:

  ============== =============================================================================
  ``model``      the model: a ``[V, V]`` float32 logits table, how it is initialised, and the
                 numpy math (log-softmax, logprobs of packed batches) both roles share
  ``options``    the ``[generator.options]`` / ``[trainer.options]`` structs (msgspec,
                 unknown fields rejected, errors name the field)
  ``generation`` a :class:`~asyncrl.plugin.backend.GenerationBackend`: sampling, abort, score,
                 refit
  ``training``   a :class:`~asyncrl.plugin.backend.TrainingBackend`: exact GRPO/PPO gradients,
                 SGD/Adam
  ``testenv``    ``repeat-digit``, a *testing* environment whose reward a bigram can learn
  ============== =============================================================================

* **the fast engine of the integration tests.** Starting it costs milliseconds and it imports
  no torch, so tests of the controller, the pumps, refit and shutdown run with real worker
  processes and real sockets in seconds. The options marked *testing knob* make a worker slow,
  fail at start or kill itself, to exercise those paths.

The model: token ``t`` follows token ``p`` with probability ``softmax(table[p] / T)[t]``. The
table comes from ``<model.path>/bigram.npy`` when that file exists, otherwise from a seeded
normal draw (``run.seed``), so the trainer and every generator start from identical weights.
``vocab_size`` and ``eos_token_id`` are read from ``<model.path>/config.json``.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugin.backend import BackendPlugin, WorkerContext
from asyncrl.plugin.common import Config, ConfigError

__version__ = "0.1.0.dev0"
__all__ = ["generation_plugin", "training_plugin"]


def _check_generator(config: Config, *, max_prompt_tokens: int) -> None:
    from .options import GeneratorOptions, parse_options

    parse_options(config.generator.options, GeneratorOptions, "generator.options")
    if config.refit.transport == "cuda_ipc":
        raise ConfigError(
            "refit.transport: the bigram engine reads host memory (shm, or nccl's gloo "
            "broadcasts), not CUDA IPC buffers. Fix: set refit.transport = 'shm' (one host) or "
            "'nccl' (several)"
        )


def _check_trainer(config: Config, *, max_prompt_tokens: int) -> None:
    from .options import TrainerOptions, parse_options

    parse_options(config.trainer.options, TrainerOptions, "trainer.options")
    loss = config.loss
    if (loss.correction, loss.ratio_level, loss.proximal_policy) != ("tis", "token", "behaviour"):
        raise ConfigError(
            f"trainer.backend = \"bigram\": its loss is the token-level PPO clip with the "
            f"generator as the proximal policy; loss.correction = {loss.correction!r}, "
            f"loss.ratio_level = {loss.ratio_level!r} and loss.proximal_policy = "
            f"{loss.proximal_policy!r} need fsdp2 or deepspeed. Fix: leave loss.correction = "
            "\"tis\", loss.ratio_level = \"token\" and loss.proximal_policy = \"behaviour\" "
            "(the defaults)"
        )


def _generator(ctx: WorkerContext) -> Any:
    from .generation import BigramGenerator

    return BigramGenerator(ctx)


def _trainer(ctx: WorkerContext) -> Any:
    from .training import BigramTrainer

    return BigramTrainer(ctx)


# What the entry points name: a factory for the workers plus a check of the options that the
# controller runs before it spawns anything (so a typo fails in a second, not after start-up).
generation_plugin = BackendPlugin(create=_generator, check_config=_check_generator)
training_plugin = BackendPlugin(create=_trainer, check_config=_check_trainer)
