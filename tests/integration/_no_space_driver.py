"""Runs an embedded Controller (bigram backends) inside ``test_no_space.py``'s private mount
namespace and prints how it ended, as one JSON line on stdout.

Usage: ``python _no_space_driver.py CONFIG_JSON MODE``. ``MODE``: ``fill-shm`` fills
``/dev/shm`` once every worker is ready (after the pre-spawn check, before the first refit
reserves the staging buffers); ``plain`` only runs.
"""

from __future__ import annotations

import json
import os
import sys

import anyio

from asyncrl import Controller
from asyncrl.config import from_dict


def fill(directory: str) -> None:
    """Write ``directory/filler`` until its file system is full."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (1 << 16, 1 << 12):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                continue
    finally:
        os.close(fd)


async def main(config_path: str, mode: str) -> dict[str, object]:
    with open(config_path) as f:
        cfg = from_dict(json.load(f))
    result: dict[str, object] = {}
    try:
        async with Controller(cfg) as ctl:
            assert ctl.addresses is not None
            result["run_id"] = ctl.addresses.run_id
            if mode == "fill-shm":
                fill("/dev/shm")
                result["shm_free"] = os.statvfs("/dev/shm").f_bavail
            await ctl.train()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.update(type=type(exc).__name__, message=str(exc),
                      group=isinstance(exc, BaseExceptionGroup),
                      needed=getattr(exc, "needed_bytes", None),
                      free=getattr(exc, "free_bytes", None))  # fmt: skip
    return result


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, sys.argv[1], sys.argv[2])), flush=True)
