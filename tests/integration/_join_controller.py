"""An application embedding the controller, whose workers are started elsewhere: binds on
this node's address (its host name, resolved), writes the join file and trains.

Usage: ``python _join_controller.py CONFIG JOIN_FILE`` (``test_two_nodes.py``)."""

from __future__ import annotations

import socket
import sys

import anyio

from asyncrl import Controller, load_config
from asyncrl.config import parse_overrides
from asyncrl.join import join_file
from asyncrl.obs import log


async def main(config_path: str, join_path: str) -> None:
    log.configure("json")  # one JSON object a line, which the test reads
    here = socket.gethostbyname(socket.gethostname())
    config = load_config(config_path, parse_overrides([f"cluster.host={here}"]))
    async with Controller(config, attach=join_file(join_path)) as ctl:
        await ctl.train()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
