"""The ``cuda_ipc`` stager on a GPU: stable tensors' small copies wait for ``seal`` and go in
batched copies (per dtype), everything else at once; either way the buffer holds each tensor's
exact bytes at its offset. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from asyncrl.worker.buckets import align  # noqa: E402
from asyncrl.transfers import StagingSpec  # noqa: E402
from asyncrl_torch.transfers.cuda_ipc import DEFER_BELOW_BYTES, CudaIpcStager  # noqa: E402

pytestmark = pytest.mark.gpu


def test_deferred_and_direct_copies_land_byte_for_byte() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = DEFER_BELOW_BYTES // 2 + 1  # elements of bf16: just over the cut
    tensors = [
        (torch.randn(64, 64, device="cuda", generator=gen).to(torch.bfloat16), True),
        (torch.randn(3, 5, device="cuda", generator=gen), True),  # float32
        (torch.randn(big, device="cuda", generator=gen).to(torch.bfloat16), True),  # too big
        (torch.randn(7, device="cuda", generator=gen).to(torch.bfloat16), False),  # not stable
        (torch.arange(10, device="cuda", dtype=torch.int64), True),
    ]
    stager = CudaIpcStager(StagingSpec("test", 0, "cuda:0"))
    try:
        for k in (0, 1):  # both buffers, refilled once to reuse cached views
            for _ in range(2):
                total = sum(align(t.nbytes) for t, _ in tensors)
                stager.reserve(k, total)
                offsets, used = [], 0
                for t, stable in tensors:
                    stager.pack(k, used, t, stable)
                    offsets.append(used)
                    used += align(t.nbytes)
                deferred = {d: len(v[0]) for d, v in stager._deferred[k].items()}
                assert deferred == {torch.bfloat16: 1, torch.float32: 1, torch.int64: 1}
                stager.seal(k)
                assert stager._deferred[k] == {}
                buf = stager._buffers[k]
                for (t, _), off in zip(tensors, offsets):
                    got = buf[off : off + t.nbytes]
                    assert torch.equal(got, t.reshape(-1).view(torch.uint8))
                for t, _ in tensors:  # new values for the refill
                    if t.is_floating_point():
                        t.add_(1)
    finally:
        stager.close()
