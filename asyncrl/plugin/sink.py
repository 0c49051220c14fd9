"""The plugin API for metrics sinks (an ``asyncrl.metrics_sinks`` entry point).

- ``SinkPlugin``: what a sink entry point names: its factory, an options check, and whether it
  runs on the metrics writer's thread instead of its own.
- ``Sink``: the protocol: ``log_config``, ``log`` (every record) and ``close``.
- ``parse_options``: a sink's ``[metrics.options.<name>]`` table converted to its options
  struct, a mistake a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from asyncrl.sinks import Sink, SinkPlugin, parse_options

__all__ = ["Sink", "SinkPlugin", "parse_options"]
