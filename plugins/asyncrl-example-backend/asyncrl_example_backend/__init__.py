"""asyncrl-example-backend: the reference backend plugin, a bigram language model in numpy.

It is two things at once:

* **the example plugin authors copy.** A separate distribution that asyncrl finds only through
  entry points (see ``pyproject.toml``); each module is small and does one job:

  ============== =============================================================================
  ``model``      the model: a ``[V, V]`` float32 logits table, how it is initialised, and the
                 numpy math (log-softmax, logprobs of packed batches) both roles share
  ``options``    the ``[generator.options]`` / ``[trainer.options]`` structs (msgspec,
                 unknown fields rejected, errors name the field)
  ``generation`` :class:`~asyncrl.backend.GenerationBackend`: sampling, abort, score, refit
  ``training``   :class:`~asyncrl.backend.TrainingBackend`: exact GRPO/PPO gradients, SGD/Adam
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

__version__ = "0.1.0.dev0"
