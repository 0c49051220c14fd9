"""msgpack codec with zero-copy array frames. No pickle, ever.

A message becomes a list of frames: frame 0 is the msgpack body; every ``numpy.ndarray`` in
the message is replaced in the body by a msgpack extension (code :data:`ARRAY_EXT`) holding
``[frame_index, dtype, shape]`` and its bytes travel as frame ``frame_index``, uncopied.
On decode, arrays are ``numpy.frombuffer`` views of the received frames (read-only).

A :class:`Codec` is bound to one message type (usually a tagged union) and is not
thread-safe: give each socket reader its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from asyncrl.errors import ProtocolError

__all__ = ["ARRAY_EXT", "Codec"]

ARRAY_EXT = 1
_ALLOWED_DTYPES = frozenset({"|u1", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "|b1"})
_header = msgspec.msgpack.Encoder()
_header_dec = msgspec.msgpack.Decoder(tuple[int, str, list[int]])

T = TypeVar("T")


class Codec(Generic[T]):
    """Encode and decode messages of type ``T`` (a struct or a tagged union of structs)."""

    def __init__(self, type_: Any) -> None:
        self._type = type_
        self._frames: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(
            type_, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )

    def encode(self, msg: T) -> list[Any]:
        """Return ``[body, *array_buffers]``; the buffers alias the message's arrays."""
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(msg)
            return self._frames
        finally:
            self._frames = []

    def decode(self, frames: Sequence[Any]) -> T:
        """Decode ``frames`` (bytes, memoryviews or ``zmq.Frame``s) into a ``T``.

        Raises:
            ProtocolError: the frames are not a valid ``T``.
        """
        if not frames:
            raise ProtocolError("empty message")
        self._frames = [getattr(f, "buffer", f) for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        except (msgspec.DecodeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"cannot decode {self._type_name()}: {exc}") from None
        finally:
            self._frames = []

    def _type_name(self) -> str:
        return getattr(self._type, "__name__", str(self._type))

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            dtype = arr.dtype.str
            if dtype not in _ALLOWED_DTYPES:
                raise TypeError(f"array dtype {arr.dtype} cannot go on the wire")
            self._frames.append(memoryview(arr).cast("B") if arr.size else b"")
            header = _header.encode((len(self._frames) - 1, dtype, list(arr.shape)))
            return msgspec.msgpack.Ext(ARRAY_EXT, header)
        raise TypeError(f"{type(obj).__name__} cannot be encoded (no pickle on the wire)")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != ARRAY_EXT:
            raise ValueError(f"unknown msgpack extension {code}")
        index, dtype, shape = _header_dec.decode(data)
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"array dtype {dtype!r} is not allowed")
        if not 0 < index < len(self._frames):
            raise ValueError(f"array frame {index} is missing")
        arr = np.frombuffer(self._frames[index], dtype=np.dtype(dtype))
        return arr.reshape(shape)

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise ValueError(f"expected {type_.__name__}, got {type(obj).__name__}")
