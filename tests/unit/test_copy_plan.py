"""The vLLM backend's copy plan (asyncrl_vllm.copy_plan) on a stand-in model whose
``load_weights`` behaves like vLLM's loaders: q/k/v into slices of one fused parameter, a tied
head, a loader that transforms after copying, one that converts the dtype. After any number of
refits the parameters must equal what ``load_weights`` alone would have written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from asyncrl_vllm.copy_plan import CopyPlan  # noqa: E402

pytestmark = pytest.mark.timeout(60)

H = 8


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * H, H), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(16, H), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.cast = torch.nn.Parameter(torch.zeros(H, dtype=torch.float64), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights):  # noqa: ANN001, ANN201 - vLLM's signature
        loaded = set()
        for name, t in weights:
            self.calls += 1
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.data.narrow(0, i * H, H).copy_(t)
            elif name == "embed":
                self.embed.data.copy_(t)
            elif name == "scaled":  # copies, then transforms in place: not a plain copy
                self.scaled.data.copy_(t)
                self.scaled.data.mul_(2.0)
            elif name == "cast":  # copies from a converted temporary
                self.cast.data.copy_(t.to(torch.float64))
            else:
                raise KeyError(name)
            loaded.add(name)
        return loaded


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [(n, torch.randn(H, H, generator=g)) for n in "qkv"]
    out.append(("embed", torch.randn(16, H, generator=g)))
    out.append(("scaled", torch.randn(H, generator=g)))
    out.append(("cast", torch.randn(H, generator=g)))
    # all in one buffer, as a bucket delivers them (views at offsets)
    flat = torch.cat([t.reshape(-1) for _, t in out])
    views, offset = [], 0
    for name, t in out:
        views.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return views


def fill(memory: torch.Tensor, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Write ``weights(seed)`` into ``memory`` (a staging buffer refilled in place) and return
    views of it, as a bucket delivers them."""
    views, offset = [], 0
    for name, t in weights(seed):
        memory[offset : offset + t.numel()].copy_(t.reshape(-1))
        views.append((name, memory[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return views


def reference(seed: int) -> dict[str, torch.Tensor]:
    m = Model()
    m.load_weights(weights(seed))
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_plan_replays_plain_copies_and_falls_back_for_the_rest() -> None:
    model = Model()
    plan = CopyPlan(model)
    assert plan.load(weights(1)) == 0  # the first load compiles, through load_weights
    assert plan.planned == 4  # q, k, v, embed; not "scaled" (transforms) nor "cast" (converts)
    for seed in (2, 3):
        calls = model.calls
        assert plan.load(weights(seed)) == 4
        assert model.calls - calls == 2  # only the two unplanned names hit load_weights
        expected = reference(seed)
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), name


def test_a_destination_rewritten_after_the_copy_is_not_planned() -> None:
    class Twice(Model):
        def load_weights(self, weights):  # noqa: ANN001, ANN201
            out = super().load_weights(weights)
            self.embed.data.add_(1.0)  # touches the destination after the loader's copy
            return out

    model = Twice()
    plan = CopyPlan(model)
    plan.load([(n, t) for n, t in weights(1) if n == "embed"])
    assert plan.planned == 0


def test_a_compiled_bucket_replays_whatever_its_buffer_holds_now() -> None:
    """A bucket kept under a key is one batched copy from the same buffer on later refits: the
    sender refills the buffer in place, the replay must write the new contents."""
    model = Model()
    plan = CopyPlan(model)
    memory = torch.empty(sum(t.numel() for _, t in weights(0)))  # the mapped staging buffer
    assert plan.replay("b0") is None  # nothing compiled yet: the caller builds the views
    plan.load(fill(memory, 1), "b0")
    assert plan.buckets == 1
    for seed in (2, 3):
        plan.next_refit()
        fill(memory, seed)
        calls = model.calls
        assert plan.replay("b0") == 4
        assert model.calls - calls == 2  # "scaled" and "cast" still go through load_weights
        expected = reference(seed)
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), (seed, name)


def test_buckets_not_replayed_in_a_refit_are_dropped_at_the_next() -> None:
    model = Model()
    plan = CopyPlan(model)
    plan.load(weights(1)[:3], "old")  # e.g. a buffer the sender has since replaced
    plan.next_refit()
    plan.load(weights(2)[3:], "new")
    assert plan.buckets == 2
    plan.next_refit()  # "old" was not used during the last refit
    assert plan.buckets == 1 and plan.replay("old") is None
    assert plan.replay("new") == 1  # embed only: "scaled" and "cast" have no plan
    plan.forget_buckets()  # e.g. the memory they read from was freed
    assert plan.buckets == 0 and plan.replay("new") is None


def test_forgetting_the_buckets_of_one_buffer_keeps_the_others() -> None:
    """A mirror buffer was replaced: only the buckets keyed by its handle are dropped."""
    model = Model()
    plan = CopyPlan(model)
    plan.load(weights(1)[:3], ("ipc", b"A", 0))
    plan.load(weights(1)[3:], ("ipc", b"B", 0))
    plan.forget_buckets(lambda key: key[1] == b"A")
    assert plan.buckets == 1
    assert plan.replay(("ipc", b"A", 0)) is None
    assert plan.replay(("ipc", b"B", 0)) == 1
