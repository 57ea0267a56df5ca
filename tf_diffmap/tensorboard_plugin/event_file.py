"""A TensorBoard event file written with TensorFlow's record writer.

An event file is a TFRecord file of `Event` protocol buffers whose first
record names the format (`brain.Event:2`); TensorBoard reads every file of a
run directory whose name contains `tfevents`. `tf.summary` writes the same
thing, but through TensorFlow ops, each an eager op call per point, where
`tf.io.TFRecordWriter` writes a record without one. A point per batch has to
be cheap, so the callback writes its events here, encoded by hand (`varint`,
`field`: the protocol buffer wire format) from bytes made once per tag.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Iterable

import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2

__all__ = ["EventFile", "field", "varint"]

_FILE_VERSION = "brain.Event:2"
_counter = itertools.count()
_DOUBLE = struct.Struct("<d")


def varint(number: int) -> bytes:
    """`number` (an unsigned integer below 2**64) as a protocol buffer varint."""
    out = bytearray()
    while number > 0x7F:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes, a message or a packed
    repeated field) of field number `number`."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


class EventFile:
    """Appends events to a new event file in `log_dir`.

    Args:
        log_dir: the run's directory; created if missing.
        flush_seconds: write buffered events to disk when a write comes this
            long after the last flush, so that TensorBoard sees a long epoch
            progress.
    """

    def __init__(self, log_dir: str | os.PathLike, flush_seconds: float = 5.0):
        log_dir = os.fspath(log_dir)
        tf.io.gfile.makedirs(log_dir)
        stamp = f"{time.time():.0f}.{socket.gethostname()}.{os.getpid()}.{next(_counter)}"
        name = f"events.out.tfevents.{stamp}.staleness.v2"
        self.path = os.path.join(log_dir, name)
        self._records = tf.io.TFRecordWriter(self.path)
        self._flush_seconds = flush_seconds
        self._last_flush = time.monotonic()
        self._closed = False
        self._write_event(event_pb2.Event(wall_time=time.time(), file_version=_FILE_VERSION))
        self.flush()

    def _write_event(self, event: event_pb2.Event) -> None:
        if self._closed:
            raise ValueError(f"The event file {self.path} is closed; create a new EventFile.")
        self._records.write(event.SerializeToString())

    def write(self, values: Iterable[summary_pb2.Summary.Value], step: int) -> None:
        """Writes `values` as one event at `step`, stamped with the time now."""
        self.write_encoded(summary_pb2.Summary(value=list(values)).SerializeToString(), step)

    def write_encoded(self, summary: bytes, step: int) -> None:
        """Writes an encoded `Summary` as one event at `step` (>= 0),
        stamped with the time now."""
        if self._closed:
            raise ValueError(f"The event file {self.path} is closed; create a new EventFile.")
        # Event: wall_time (field 1, double), step (2, varint; 0 is left
        # out, as the library does), summary (5).
        event = b"\x09" + _DOUBLE.pack(time.time())
        if step:
            event += b"\x10" + varint(step)
        self._records.write(event + field(5, summary))
        if time.monotonic() - self._last_flush >= self._flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Writes buffered events to disk."""
        if not self._closed:
            self._records.flush()
            self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flushes and closes the file (closing twice is harmless)."""
        if not self._closed:
            self._records.close()
            self._closed = True
