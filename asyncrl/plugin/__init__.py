"""The plugin API: what a backend, environment, sampler, transfer, sink or service imports
from asyncrl, in a few façades named for who imports them (docs/plugins.md, "What a plugin
may import"):

- :mod:`asyncrl.plugin.common`: every plugin: the run config, the errors a check raises,
  options checking, loading a plugin by name, process helpers.
- :mod:`asyncrl.plugin.backend`: generation and training backends (engines).
- :mod:`asyncrl.plugin.transfer`: weight transfers, and backends that read their buckets.
- :mod:`asyncrl.plugin.environment`: environments, rewards, tools and tool-call parsers.
- :mod:`asyncrl.plugin.sampler`: staleness samplers.
- :mod:`asyncrl.plugin.sink`: metrics sinks.
- :mod:`asyncrl.plugin.service`: services on the controller's loop (the gateway).

A plugin imports from asyncrl only these modules' names; everything else in asyncrl is
private and may move without notice (``tests/unit/test_plugin_api.py`` holds the shipped
plugins to it). The names stay defined where they are; the façades re-export them, and
importing any of them imports no torch and no engine.

This package imports nothing itself: import the façade you need.
"""
