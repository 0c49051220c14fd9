"""FP8 KV-cache scale calibration on the trainer's own forwards (HF transformers models).

Convention. vLLM with ``kv_cache_dtype="fp8"`` stores K and V in FP8 e4m3 (largest finite
value 448) and dequantizes with one scale per layer and tensor: ``stored = x / scale`` and
``x ~= stored * scale``, so ``scale = amax(|x|) / 448`` makes the largest value seen map to
the top of the FP8 range. This module computes those scales with the updated weights on the
step's data:

1. per layer, the amax of ``|k|`` and ``|v|`` (optionally ``|q|``) as they enter the KV
   cache, i.e. **after** any q/k-norm and RoPE; one amax per layer per micro-batch forward;
2. a robust percentile of those per-micro-batch amaxes (default 99.9, linear interpolation
   as :func:`numpy.percentile`), so one outlier micro-batch does not set the scale alone;
3. the maximum over ranks (:func:`all_reduce_max`), so every rank gets the same scales;
4. ``scale = amax * margin / 448`` (default margin 1.05, head-room for the next step's data).

The scales are named ``model.layers.{i}.self_attn.{k,v,q}_scale``, the form the vLLM
backend's scale resolver accepts.

How q/k/v are seen. Llama/Qwen-style HF attention modules compute q, k, v, apply q/k-norm
and RoPE, and then call an attention function looked up by name,
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``,
as ``fn(module, query, key, value, attention_mask, ...)`` with ``[batch, heads, seq,
head_dim]`` tensors (k and v before the grouped-query head repeat, i.e. exactly the heads
the cache stores). :func:`record_qkv_amax` temporarily puts a recording wrapper into that
interface under the model's *own* implementation name (as an instance-local override, which
``get_interface`` prefers over the library-wide mapping) and removes it on exit. The config
is not changed, so mask construction and every ``_attn_implementation == ...`` check behave
as before, and no parameter is touched, so it works on FSDP2 (``fully_shard``) models. The
override is process-wide for that implementation name: while it is installed, attention of
other models passes straight through the wrapper unrecorded (it records only the attention
modules of the model it was built for). Nested recorders must exit in reverse order.

Padding. The trainer's micro-batches are right-padded without an attention mask (see
:class:`asyncrl_torch.batches.MicroBatch`). :meth:`QKVAmaxRecorder.sample` takes an optional
``[batch, seq]`` boolean mask of the positions to count; :func:`valid_positions` derives it
from a micro-batch: a sequence with response tokens ends right after its last one, so its
pads are excluded exactly. A sequence without response tokens has an unknown length (its pad
id may also be a real token) and is counted in full, which can only make its amax larger.
A micro-batch with no response tokens at all (the backend's lockstep dummy) is forwarded,
since FSDP's collectives need it, but contributes no sample.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl_torch.batches import MicroBatch

if TYPE_CHECKING:
    from transformers.modeling_utils import AttentionInterface

__all__ = [
    "FP8_E4M3_MAX",
    "QKVAmaxRecorder",
    "all_reduce_max",
    "calibrate_kv_scales",
    "combine_amax",
    "record_qkv_amax",
    "scale_names",
    "scales_from_amax",
    "valid_positions",
]

FP8_E4M3_MAX = 448.0
"""Largest finite value of FP8 e4m3 (``torch.finfo(torch.float8_e4m3fn).max``)."""

AttentionFn = Callable[..., Any]


# ---------------------------------------------------------------------- pure helpers
def combine_amax(samples: Sequence[Sequence[float]] | np.ndarray, percentile: float) -> np.ndarray:
    """Per-layer percentile of per-micro-batch amaxes, in float64.

    Args:
        samples: ``[num_microbatches, ...]`` amaxes, e.g. ``[num_microbatches, num_layers]``;
            the percentile is taken over the first axis.
        percentile: In ``[0, 100]``; linear interpolation between order statistics, as
            :func:`numpy.percentile` (100 is the plain maximum).

    Returns:
        ``samples.shape[1:]`` float64 array. A non-finite sample gives a non-finite (inf or
        NaN) result, which :func:`scales_from_amax` rejects.

    Raises:
        ValueError: No samples, a 0-d input, or a percentile outside ``[0, 100]``.
    """
    a = np.asarray(samples, dtype=np.float64)
    if a.ndim < 1 or a.shape[0] == 0:
        raise ValueError(f"need at least one amax sample, got shape {a.shape}")
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must lie in [0, 100], got {percentile}")
    with np.errstate(invalid="ignore"):  # inf - inf in the interpolation gives NaN, no warning
        out = np.percentile(a, percentile, axis=0, method="linear")
    return np.asarray(out, dtype=np.float64)


def scales_from_amax(
    amax: Sequence[float] | np.ndarray, margin: float = 1.05, fp8_max: float = FP8_E4M3_MAX
) -> np.ndarray:
    """Dequantization scales ``amax * margin / fp8_max`` (float64, same shape as ``amax``).

    Args:
        amax: Per-layer absolute maxima.
        margin: Head-room factor, > 0.
        fp8_max: Largest representable value of the FP8 format (448 for e4m3).

    Raises:
        ValueError: Some amax is not finite or not > 0 (a zero amax, e.g. a layer that was
            never seen, would give a zero scale), or ``margin``/``fp8_max`` is not > 0.
    """
    if not (np.isfinite(margin) and margin > 0 and np.isfinite(fp8_max) and fp8_max > 0):
        raise ValueError(f"margin and fp8_max must be finite and > 0, got {margin}, {fp8_max}")
    a = np.asarray(amax, dtype=np.float64)
    bad = ~(np.isfinite(a) & (a > 0))
    if bad.any():
        where = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)][:8]
        raise ValueError(
            f"KV scales must be finite and > 0: amax at index {where} is "
            f"{a[bad][:8].tolist()} (a layer never reached, or non-finite activations)"
        )
    return a * margin / fp8_max


def scale_names(num_layers: int, kinds: Sequence[str] = ("k", "v")) -> list[str]:
    """Scale names, kind-major: ``[f"model.layers.{i}.self_attn.{kind}_scale"]``.

    The order matches a ``[len(kinds), num_layers]`` array flattened row by row.
    """
    for kind in kinds:
        if kind not in ("q", "k", "v"):
            raise ValueError(f"unknown scale kind {kind!r}; expected 'q', 'k' or 'v'")
    return [f"model.layers.{i}.self_attn.{kind}_scale" for kind in kinds for i in range(num_layers)]


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over the default process group, in place; a no-op without one.

    The tensor must live on a device the process group's backend supports (CUDA for NCCL).
    """
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def valid_positions(mb: MicroBatch) -> torch.Tensor:
    """``[b, L]`` bool mask of the real (non-pad) positions of a right-padded micro-batch.

    A row with response tokens is real up to and including its last response token
    (position ``max(cols) + 1``); a row without response tokens is taken as real in full
    (see the module docstring).
    """
    b, length = mb.input_ids.shape
    device = mb.input_ids.device
    ends = torch.zeros(b, dtype=torch.int64, device=device)
    if mb.rows.numel():
        ends = ends.scatter_reduce(0, mb.rows, mb.cols + 2, reduce="amax", include_self=True)
    ends = torch.where(ends > 0, ends, torch.full_like(ends, length))
    return torch.arange(length, device=device)[None, :] < ends[:, None]


# ---------------------------------------------------------------------- the recorder
def _from_class_modules(module: torch.nn.Module, name: str) -> Any:
    """``name`` from the source module of the first class in ``type(module).__mro__`` that
    defines it (FSDP2 wraps classes in dynamic subclasses defined elsewhere)."""
    for cls in type(module).__mro__:
        value = getattr(sys.modules.get(cls.__module__), name, None)
        if value is not None:
            return value
    return None


class QKVAmaxRecorder:
    """Per-layer amax of |q|, |k|, |v| at the attention-function call, one sample per forward.

    Made by :func:`record_qkv_amax`; run each forward inside :meth:`sample` (or
    :meth:`unrecorded`); attention of the model outside both raises.

    Attributes:
        kinds: The recorded tensors, ``("k", "v")`` or ``("k", "v", "q")``.
        num_layers: Number of decoder layers (the model's ``num_hidden_layers``).
    """

    def __init__(self, kinds: tuple[str, ...], num_layers: int, modules: set[int]) -> None:
        self.kinds = kinds
        self.num_layers = num_layers
        self._modules = modules  # ids of the attention modules to record
        self._samples: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None
        self._open = False
        self._valid: torch.Tensor | None = None
        self._skip = False

    @contextlib.contextmanager
    def sample(self, valid: torch.Tensor | None = None) -> Iterator[None]:
        """Record one sample: the per-layer amax over every attention call inside the block.

        Args:
            valid: Optional ``[batch, seq]`` bool mask of the positions to count (the
                attention function's query/key/value must then be ``[batch, heads, seq,
                head_dim]`` with that batch and seq). A layer not reached records 0.
        """
        if self._open or self._skip:
            raise RuntimeError("QKVAmaxRecorder.sample() inside sample() or unrecorded()")
        self._open, self._valid, self._current = True, valid, None
        try:
            yield
            current = self._current
            if current is None:
                current = torch.zeros(len(self.kinds), self.num_layers, dtype=torch.float32)
            self._samples.append(current)
        finally:
            self._open, self._valid, self._current = False, None, None

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Let attention calls inside the block through without recording them (forwards
        that must run, e.g. for FSDP's collectives, but must not count)."""
        if self._open:
            raise RuntimeError("QKVAmaxRecorder.unrecorded() inside sample()")
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def samples(self) -> np.ndarray:
        """``[num_samples, len(kinds), num_layers]`` float64 array of the samples so far."""
        if not self._samples:
            return np.zeros((0, len(self.kinds), self.num_layers), dtype=np.float64)
        cpu = [s.detach().to("cpu", torch.float64) for s in self._samples]
        return torch.stack(cpu).numpy()

    def _record(self, module: torch.nn.Module, tensors: tuple[torch.Tensor, ...]) -> None:
        if self._skip or id(module) not in self._modules:
            return
        if not self._open:
            raise RuntimeError(
                "attention ran under record_qkv_amax outside QKVAmaxRecorder.sample()"
            )
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RuntimeError(
                f"attention module has layer_idx {layer!r}, expected an int "
                f"in [0, {self.num_layers})"
            )
        if self._current is None:
            self._current = torch.zeros(
                len(self.kinds), self.num_layers, dtype=torch.float32, device=tensors[0].device
            )
        valid = self._valid
        for j, x in enumerate(tensors):
            per_pos = x.detach().abs().amax(dim=(1, 3))  # [batch, seq]
            if valid is not None:
                if valid.shape != per_pos.shape:
                    raise ValueError(
                        f"valid mask has shape {tuple(valid.shape)} but attention inputs have "
                        f"[batch, seq] = {tuple(per_pos.shape)}"
                    )
                per_pos = per_pos.masked_fill(~valid.to(per_pos.device), 0)
            m = per_pos.amax().to(torch.float32)
            self._current[j, layer] = torch.maximum(self._current[j, layer], m)


@contextlib.contextmanager
def record_qkv_amax(
    model: torch.nn.Module, include_q: bool = False, *, num_layers: int | None = None
) -> Iterator[QKVAmaxRecorder]:
    """Route ``model``'s attention through a recording wrapper for the duration of the block.

    The wrapper calls the implementation the model is configured with (sdpa, eager, flash,
    ...) unchanged; the override is removed on exit, also on exceptions.

    Args:
        model: An HF transformers model (possibly FSDP2-sharded) whose attention modules
            have ``layer_idx`` and ``config`` and call the attention interface.
        include_q: Also record |q|.
        num_layers: Defaults to the text config's ``num_hidden_layers``.

    Yields:
        The :class:`QKVAmaxRecorder`.

    Raises:
        ValueError: No attention module found.
        TypeError: An attention module's config names no attention implementation.
        KeyError: The configured implementation is not registered.
    """
    attn = _attention_modules(model)
    if num_layers is None:
        config = model.config
        num_layers = int(config.get_text_config().num_hidden_layers)
    kinds = ("k", "v", "q") if include_q else ("k", "v")
    recorder = QKVAmaxRecorder(kinds, num_layers, {id(m) for m in attn})
    targets = _override_targets(attn)
    with _overridden(targets, lambda fn: _recording_wrapper(recorder, include_q, fn)):
        yield recorder


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s attention modules: those with an int ``layer_idx``, a config naming an
    attention implementation and a k/q projection.

    Raises:
        ValueError: There is none.
    """
    attn = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and hasattr(getattr(m, "config", None), "_attn_implementation")
        and any(hasattr(m, p) for p in ("k_proj", "qkv_proj", "q_proj"))
    ]
    if not attn:
        raise ValueError("no attention modules (with layer_idx, config and k/q projections)")
    return attn


def _override_targets(attn: list[torch.nn.Module]) -> list[tuple[AttentionInterface, str]]:
    """The distinct (interface, implementation key) pairs to override, from each attention
    module's own modeling file (a model may declare its own AttentionInterface instance).

    Raises:
        TypeError: A module's config names no attention implementation.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    targets: dict[tuple[int, str], tuple[AttentionInterface, str]] = {}
    for m in attn:
        impl = m.config._attn_implementation
        if not isinstance(impl, str):
            raise TypeError(f"{type(m).__name__} has no attention implementation ({impl!r})")
        if impl.startswith("paged|") and impl != "paged|eager":
            impl = impl.removeprefix("paged|")  # as AttentionInterface.get_interface does
        iface = _from_class_modules(m, "ALL_ATTENTION_FUNCTIONS")
        if not isinstance(iface, AttentionInterface):
            iface = ALL_ATTENTION_FUNCTIONS
        targets[(id(iface), impl)] = (iface, impl)
    return list(targets.values())


@contextlib.contextmanager
def _overridden(
    targets: list[tuple[AttentionInterface, str]],
    wrap: Callable[[AttentionFn | None], AttentionFn],
) -> Iterator[None]:
    """Put ``wrap(original)`` into each interface under its key as an instance-local
    override for the block, then restore each key's previous local entry (or none), in
    reverse order, also on exceptions. ``original`` is ``None`` for an unregistered
    ``"eager"`` (the call site's own default).

    Raises:
        KeyError: An implementation other than ``"eager"`` is not registered (the
            overrides installed before it are removed).
    """
    installed: list[tuple[AttentionInterface, str, bool, AttentionFn | None]] = []
    try:
        for iface, impl in targets:
            had_local = impl in iface._local_mapping
            previous = iface._local_mapping.get(impl)
            if impl in iface:
                original: AttentionFn | None = iface[impl]
            elif impl == "eager":
                original = None
            else:
                raise KeyError(f"attention implementation {impl!r} is not registered")
            iface[impl] = wrap(original)  # instance-local override
            installed.append((iface, impl, had_local, previous))
        yield
    finally:
        for iface, impl, had_local, previous in reversed(installed):
            if had_local:
                iface[impl] = previous
            else:
                del iface[impl]


def _recording_wrapper(
    recorder: QKVAmaxRecorder, include_q: bool, original: AttentionFn | None
) -> AttentionFn:
    """An attention function that shows k, v (and q) to ``recorder``, then calls
    ``original``, or for ``None`` the module's own modeling file's eager attention."""
    eager: dict[type, AttentionFn] = {}

    def wrapper(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        recorder._record(module, (key, value, query) if include_q else (key, value))
        fn = original
        if fn is None:  # "eager": the default the call site passes, from its modeling file
            fn = eager.get(type(module))
            if fn is None:
                fn = _from_class_modules(module, "eager_attention_forward")
                if fn is None:
                    raise RuntimeError(f"no eager_attention_forward for {type(module)}")
                eager[type(module)] = fn
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------- end to end
def calibrate_kv_scales(
    model: torch.nn.Module,
    micro_batches: Iterable[MicroBatch],
    forward: Callable[[MicroBatch], Any],
    *,
    percentile: float = 99.9,
    margin: float = 1.05,
    include_q: bool = False,
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Per-layer FP8 KV (and q) scales from forwards over ``micro_batches``.

    Runs ``forward(mb)`` for each micro-batch under :func:`torch.no_grad` with the model in
    eval mode (every module's training flag is restored afterwards), takes one amax sample
    per micro-batch that has response tokens (pads excluded, see :func:`valid_positions`),
    combines them with :func:`combine_amax`, applies ``reduce_max`` (e.g.
    :func:`all_reduce_max`; every rank must call this function then), and converts with
    :func:`scales_from_amax`. A rank without samples contributes zeros to the reduction.

    Args:
        model: The (possibly FSDP2-sharded) HF model that ``forward`` runs.
        micro_batches: The micro-batches; on a multi-rank run every rank must pass the same
            number (pad with dummy micro-batches, which are forwarded but not sampled).
        forward: Runs the model on one micro-batch; its result is discarded (a forward of
            the base model without ``lm_head`` is enough).
        percentile: Percentile across micro-batches, in ``[0, 100]``.
        margin: Head-room factor on the amax.
        include_q: Also return ``q_scale`` entries.
        reduce_max: Elementwise max across ranks of a float64 ``[kinds, layers]`` tensor on
            the model's device; ``None`` for a single process.

    Returns:
        ``{"model.layers.{i}.self_attn.{k,v[,q]}_scale": scale}``.

    Raises:
        ValueError: Some scale would not be finite and > 0 (raised on every rank alike when
            ``reduce_max`` is used, since non-finite amaxes are reduced as +inf).
    """
    samples, kinds, num_layers = _amax_samples(model, micro_batches, forward, include_q)
    if len(samples):
        amax = combine_amax(samples, percentile)
    else:
        amax = np.zeros((len(kinds), num_layers))
    if reduce_max is not None:
        amax = _reduce_on_model_device(amax, model, reduce_max)
    scales = scales_from_amax(amax, margin)
    return dict(zip(scale_names(num_layers, kinds), scales.reshape(-1).tolist(), strict=True))


def _amax_samples(
    model: torch.nn.Module,
    micro_batches: Iterable[MicroBatch],
    forward: Callable[[MicroBatch], Any],
    include_q: bool,
) -> tuple[np.ndarray, tuple[str, ...], int]:
    """The recorder's samples, kinds and layer count after ``forward`` over each
    micro-batch, in eval mode without gradients (each module's training flag restored);
    one sample per micro-batch with response tokens, the others forwarded unrecorded."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), record_qkv_amax(model, include_q) as rec:
            for mb in micro_batches:
                sampled = mb.response_slice.stop > mb.response_slice.start
                block = rec.sample(valid_positions(mb)) if sampled else rec.unrecorded()
                with block:
                    forward(mb)
            samples = rec.samples()
    finally:
        for m, was_training in flags.items():
            m.training = was_training
    return samples, rec.kinds, rec.num_layers


def _reduce_on_model_device(
    amax: np.ndarray, model: torch.nn.Module, reduce_max: Callable[[torch.Tensor], torch.Tensor]
) -> np.ndarray:
    """``reduce_max`` of ``amax`` as a float64 tensor on the model's device (CPU without
    parameters), NaN sent as +inf so that it wins the max on every rank."""
    amax = np.where(np.isnan(amax), np.inf, amax)  # a NaN must win the max on all ranks
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    t = torch.as_tensor(amax, dtype=torch.float64, device=device)
    return reduce_max(t).to("cpu").numpy()
