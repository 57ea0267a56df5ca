"""The events of a TensorFlow profile (`*.xplane.pb`), as plain records.

`tf.profiler.experimental.stop()` and `tf.profiler.experimental.client.trace`
write an `XSpace` protocol buffer per traced task; its message class is
TensorFlow's own (`tensorflow.tsl.profiler.protobuf`), with no public name.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["ProfileEvent", "profile_events"]


class ProfileEvent(NamedTuple):
    """One event of a profile: a span on one thread of one task.

    Attributes:
        plane: the plane (`/host:CPU` for a CPU task).
        line: the thread's name (`tf_Compute/...`, `python`, ...).
        name: the event's name; a kernel's is `node name:OpType`.
        start_ns: when it started, in ns since the Unix epoch (the
            profile's own start, which its task wrote, plus the event's
            offset), so that the profiles of several tasks line up.
        duration_ns: how long it lasted.
    """

    plane: str
    line: str
    name: str
    start_ns: int
    duration_ns: float


def profile_events(path: str | os.PathLike) -> list[ProfileEvent]:
    """Every event of one `*.xplane.pb` file.

    Raises:
        ValueError: the file is not a profile (`XSpace`).
    """
    from google.protobuf.message import DecodeError
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    data = open(path, "rb").read()
    try:
        space.ParseFromString(data)
    except DecodeError as error:
        raise ValueError(f"{path} is not a TensorFlow profile (XSpace): {error}") from error
    events = []
    origin = _start_time(space)
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            base = origin + line.timestamp_ns
            for event in line.events:
                events.append(
                    ProfileEvent(
                        plane.name,
                        line.display_name or line.name,
                        names.get(event.metadata_id, "?"),
                        base + event.offset_ps // 1000,
                        event.duration_ps / 1000,
                    )
                )
    return events


def _start_time(space) -> int:
    """The profile's start (ns since the epoch), from its task's environment."""
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for stat in plane.stats:
            if names.get(stat.metadata_id) == "profile_start_time":
                return stat.uint64_value or stat.int64_value
    raise ValueError("The profile does not say when it started (no profile_start_time).")
