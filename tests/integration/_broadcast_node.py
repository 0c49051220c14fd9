"""One side of tests/integration/test_fan_out.py, run in a network namespace of its own:
``send DIR N BUCKETS MIB HOSTS`` (the nccl transfer's sender over gloo, receivers
``rollout:0..N-1`` on ``HOSTS``, a comma list) or ``read DIR IDENTITY``. They meet through
files in DIR (the test's exchange, not the transfer's): ``h<i>`` is bucket i's handle,
``a<i>-<identity>`` a reader's SHA-256 of it, ``sent`` the sender's digests."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from asyncrl.transfers import Receiver, StagingSpec
from asyncrl_torch.transfers.nccl import IDENTITY_ENV_VAR, NcclOpener, NcclStager

WAIT_S = 60.0


def _wait(path: Path) -> bytes:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not come")
        time.sleep(0.005)
    return path.read_bytes()


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def send(where: Path, n: int, buckets: int, mib: int, hosts: list[str]) -> None:
    names = [f"rollout:{i}" for i in range(n)]
    stager = NcclStager(StagingSpec(run_id="fan", rank=0, device="cpu"))
    rng = np.random.default_rng(0)
    digests, seconds = [], []
    try:
        stager.begin([Receiver(name, host) for name, host in zip(names, hosts)])
        for i in range(buckets):
            data = torch.from_numpy(rng.integers(0, 256, mib << 20, dtype=np.uint8))
            k = i % 2
            stager.reserve(k, data.numel())
            stager.pack(k, 0, data)
            start = time.perf_counter()
            stager.seal(k)
            _publish(where / f"h{i}", stager.handle(k))
            digests.append(hashlib.sha256(data.numpy().tobytes()).hexdigest())
            for name in names:  # every reader has it before the next bucket goes
                _wait(where / f"a{i}-{name}")
            seconds.append(time.perf_counter() - start)
    finally:
        stager.close()
    _publish(where / "sent", json.dumps({"digests": digests, "seconds": seconds}).encode())


def read(where: Path, identity: str, buckets: int) -> None:
    os.environ[IDENTITY_ENV_VAR] = identity
    opener = NcclOpener()
    try:
        for i in range(buckets):
            view = opener.open(_wait(where / f"h{i}"), "cpu")
            digest = hashlib.sha256(view.numpy().tobytes()).hexdigest()
            _publish(where / f"a{i}-{identity}", digest.encode())
    finally:
        opener.close()


if __name__ == "__main__":
    role, where = sys.argv[1], Path(sys.argv[2])
    if role == "send":
        send(where, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(","))
    else:
        read(where, sys.argv[3], int(sys.argv[4]))
