"""The plugin API for weight transfers (an ``asyncrl.weight_transfers`` entry point), and for
the generation backends that read the buckets a transfer staged.

- ``WeightTransfer``: what a transfer entry point names: the sender's stager factory and the
  reader's opener factory, with what the transfer promises.
- ``StagingSpec``: where the sender stages buckets (run, rank, device, buffer count).
- ``Stager``: the sender's side, on trainer rank 0: reserve, pack, seal, hand out handles.
- ``Opener``: the reader's side, in the process that loads the weights: a handle's bytes.
- ``Receiver``: one generator a refit goes to (identity, host, pid).
- ``IDENTITY_ENV_VAR``: the environment variable a generation backend sets in each engine
  process it starts, naming the reader to a transfer that places readers itself (``nccl``).
- ``load_transfer``: the transfer registered under a name (a reader opens buckets with it).
- ``read_bytes``: bytes of an ``shm`` bucket as ``uint8`` numpy, for a reader without torch.
"""

from __future__ import annotations

from asyncrl.transfers import (
    IDENTITY_ENV_VAR,
    Opener,
    Receiver,
    Stager,
    StagingSpec,
    WeightTransfer,
    load_transfer,
)
from asyncrl.transfers.shm import read_bytes

__all__ = [
    "IDENTITY_ENV_VAR",
    "Opener",
    "Receiver",
    "Stager",
    "StagingSpec",
    "WeightTransfer",
    "load_transfer",
    "read_bytes",
]
