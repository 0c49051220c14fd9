"""The worker processes: ``runtime.serve`` (the entry point), a runtime per role on a shared
base (``rollout``, ``trainer``, ``base``), weight transfer, export."""
