"""asyncrl: asynchronous GRPO post-training of LLMs with one anyio controller.

``import asyncrl`` never imports torch or an engine; backends are plugins found through
entry points (see :mod:`asyncrl.registry`). Nor does it import the controller until
``asyncrl.Controller`` (or ``RunStatus``, ``RunSummary``) is first asked for: a worker
process, which imports asyncrl too, needs none of it (half its import time).

Embedding::

    async with asyncrl.Controller(asyncrl.load_config("run.toml")) as ctl:
        summary = await ctl.train()
"""

from typing import Any

from asyncrl.config import Config, load_config
from asyncrl.errors import (
    AsyncRLError,
    ConfigError,
    NoSpaceError,
    NonFiniteError,
    PluginError,
    ProtocolError,
    RefitError,
    RemoteCallError,
    RunError,
    WorkerDiedError,
    WorkerError,
    WorkerHungError,
    WorkerStartupError,
)
from asyncrl.wire.messages import PROTOCOL_VERSION

__version__ = "0.1.0.dev0"

_CONTROLLER_NAMES = ("Controller", "RunStatus", "RunSummary")


def __getattr__(name: str) -> Any:
    """The controller's names, imported when first asked for (PEP 562)."""
    if name in _CONTROLLER_NAMES:
        from asyncrl.run import controller

        return getattr(controller, name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncRLError",
    "Config",
    "ConfigError",
    "Controller",
    "NoSpaceError",
    "NonFiniteError",
    "PluginError",
    "ProtocolError",
    "RefitError",
    "RemoteCallError",
    "RunError",
    "RunStatus",
    "RunSummary",
    "WorkerDiedError",
    "WorkerError",
    "WorkerHungError",
    "WorkerStartupError",
    "load_config",
]
