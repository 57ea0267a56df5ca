"""Summary values encoded by hand, in the protocol buffer wire format.

A batch-level staleness point writes some fifty values; filling protocol
buffers for each would cost more than computing them. `Series` holds one
tag's bytes, made once, and encodes a value as those bytes followed by its
number or content. `ScalarBlocks` encodes the scalars of many points at
once: the scalars a point has are laid out once as a template of bytes
with a hole for each float, and NumPy fills the holes of every point that
has the same scalars, so that a point's scalars cost one slice of bytes
rather than a Python call each.

The first value of a tag in an event file carries the tag's metadata, as
TensorFlow's own writer does: TensorBoard keeps the first it reads.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from tensorboard.compat.proto import summary_pb2, types_pb2

from tf_diffmap.tensorboard_plugin.event_file import field, varint

__all__ = ["BUCKET_BYTES", "ScalarBlocks", "Series"]

# A scalar's tensor up to its value: float32 (as `tf.summary.scalar`
# writes; TensorBoard's data server takes no other scalar type), shape [],
# one packed float (4 bytes) in `float_val`.
_SCALAR_TENSOR = b"\x08" + varint(types_pb2.DT_FLOAT) + field(2, b"") + b"\x2a\x04"
_DOUBLE_TENSOR = b"\x08" + varint(types_pb2.DT_DOUBLE)
BUCKET_BYTES = 3 * 8
"""A histogram bucket's bytes: left edge, right edge, count (float64)."""
_FLOAT = struct.Struct("<f")


def _float32(number: float) -> bytes:
    try:
        return _FLOAT.pack(number)
    except OverflowError:  # beyond float32: infinite, as a cast would make it
        return _FLOAT.pack(math.copysign(math.inf, number))


class Series:
    """One tag's values, each encoded as a `Summary`'s `value` field.

    Each value is the bytes of its tag (made once per tag, and per shape of
    a matrix) followed by its number or content: about a third of what
    filling protocol buffers costs. The first carries the tag's metadata.

    Args:
        tag: the value's tag.
        summary_metadata: its metadata, written with the first value.
    """

    __slots__ = ("_tag", "_metadata", "_scalar", "_matrices")

    def __init__(self, tag: str, summary_metadata: summary_pb2.SummaryMetadata):
        self._tag = field(1, tag.encode())  # Value: tag 1, tensor 8, metadata 9
        self._metadata = field(9, summary_metadata.SerializeToString())
        self._scalar: bytes | None = None
        self._matrices: dict[tuple[int, ...], bytes] = {}

    def scalar(self, number: float) -> bytes:
        """A scalar value (float32)."""
        prefix = self.scalar_prefix()
        if prefix is None:
            return self._first(_SCALAR_TENSOR + _float32(number))
        return prefix + _float32(number)

    def scalar_prefix(self) -> bytes | None:
        """A scalar value's encoding but its 4 bytes of float32 (little
        endian), once the first value (with the metadata) is written; None
        before."""
        if self._scalar is None and not self._metadata:
            self._scalar = self._until_last(_SCALAR_TENSOR, 4)
        return self._scalar

    def matrix(self, content: bytes, shape: tuple[int, ...]) -> bytes:
        """A float64 tensor value of `shape` (e.g. a histogram), from its
        little-endian `content`."""
        prefix = self._matrices.get(shape)
        if prefix is None:
            # TensorProto: dtype 1, tensor_shape 2 (its dims 2, each with
            # size 1), tensor_content 4, last.
            dims = b"".join(field(2, b"\x08" + varint(n) if n else b"") for n in shape)
            tensor = _DOUBLE_TENSOR + field(2, dims) + b"\x22" + varint(len(content))
            if self._metadata:
                return self._first(tensor + content)
            prefix = self._matrices[shape] = self._until_last(tensor, len(content))
        return prefix + content

    def _first(self, tensor: bytes) -> bytes:
        value = field(1, self._tag + field(8, tensor) + self._metadata)
        self._metadata = b""
        return value

    def _until_last(self, tensor: bytes, size: int) -> bytes:
        """A value's encoding but its last `size` bytes (the tensor's number
        or content, of that fixed size), without metadata."""
        value = field(1, self._tag + field(8, tensor + bytes(size)))
        return value[: len(value) - size]


class ScalarBlocks:
    """Encodes the scalars of K points at once, each point's in one block.

    Args:
        series: the `Series` of each slot (None for a slot never written),
            in the order a point's scalars are written.
        max_layouts: templates kept, one per set of slots that points had.
    """

    def __init__(self, series: list[Series | None], max_layouts: int = 256):
        self.series = series
        self._max_layouts = max_layouts
        self._layouts: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def encode(self, values: np.ndarray, present: np.ndarray) -> list[bytes]:
        """Each point's scalars: the values of its present slots, in order.

        Args:
            values: `[K, slots]` the numbers (cast to float32).
            present: `[K, slots]` bool, whether point k writes slot j.

        Returns:
            K runs of encoded `value` fields, as `Series.scalar` of each
            present slot in order would make them.
        """
        used = np.flatnonzero(present.any(axis=0)).tolist()
        prefixes = {j: self.series[j].scalar_prefix() for j in used}
        if any(prefix is None for prefix in prefixes.values()):
            return self._one_by_one(values, present)  # a tag's first value
        with np.errstate(over="ignore"):  # beyond float32: infinite, as packed
            numbers = values.astype("<f4")
        keys = [row.tobytes() for row in np.packbits(present, axis=1)]
        points: dict[bytes, list[int]] = {}
        for k, key in enumerate(keys):
            points.setdefault(key, []).append(k)
        out: list[bytes] = [b""] * len(keys)
        for key, ks in points.items():
            slots, template, holes = self._layout(key, present[ks[0]], prefixes)
            if not len(slots):
                continue
            block = np.tile(template, (len(ks), 1))
            block[:, holes] = numbers[np.ix_(ks, slots)].view(np.uint8)
            size, blob = len(template), block.tobytes()
            for n, k in enumerate(ks):
                out[k] = blob[n * size : (n + 1) * size]
        return out

    def _layout(self, key: bytes, present: np.ndarray, prefixes: dict[int, bytes]):
        """The slots of a set, its template of bytes and the holes' bytes."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= self._max_layouts:
                self._layouts.clear()
            slots = np.flatnonzero(present)
            pieces = [prefixes[j] for j in slots.tolist()]
            template = np.frombuffer(b"".join(p + bytes(4) for p in pieces), np.uint8)
            ends = np.cumsum([len(p) + 4 for p in pieces], dtype=np.int64)
            holes = (ends[:, None] - 4 + np.arange(4)).ravel()
            layout = self._layouts[key] = (slots, template, holes)
        return layout

    def _one_by_one(self, values: np.ndarray, present: np.ndarray) -> list[bytes]:
        out = []
        for row, here in zip(values.tolist(), present.tolist(), strict=True):
            series = self.series
            out.append(
                b"".join(series[j].scalar(v) for j, (v, h) in enumerate(zip(row, here)) if h)
            )
        return out
