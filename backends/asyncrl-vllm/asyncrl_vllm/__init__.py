"""vLLM generation backend for asyncrl (entry point ``asyncrl.generation_backends:vllm``).

Modules: :mod:`.backend` (the ``AsyncLLM``-driving backend), :mod:`.ext` (the worker
extension run inside vLLM's workers), :mod:`.options` (``[generator.options]``),
:mod:`.scoring` and :mod:`.kv_scales` (pure helpers), :mod:`.reaper` (kills the engine's
processes if their owner dies). Importing this package imports neither torch nor vLLM.
"""

__version__ = "0.1.0.dev0"
