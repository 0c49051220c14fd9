"""asyncrl: asynchronous GRPO post-training of LLMs with one anyio controller.

``import asyncrl`` never imports torch or an engine; backends are plugins found through
entry points (see :mod:`asyncrl.plugins`).

Embedding::

    async with asyncrl.Controller(asyncrl.load_config("run.toml")) as ctl:
        summary = await ctl.train()
"""

from asyncrl.config import Config, load_config
from asyncrl.run.controller import Controller, RunStatus, RunSummary
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
