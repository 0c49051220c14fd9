"""FSDP2 training backend for asyncrl, registered as ``asyncrl.training_backends:fsdp2``.

Importing this package imports nothing heavy; the entry point is
:func:`asyncrl_fsdp.backend.make_backend`.
"""

__all__: list[str] = []
