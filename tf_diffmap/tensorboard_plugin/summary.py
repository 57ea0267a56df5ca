"""Staleness statistics as TensorBoard summaries.

`interval_figures` turns the difference of two `StalenessStats` snapshots into
the numbers one point of each series shows (plain NumPy, tested on its own);
`StalenessSummaryWriter` writes them as TensorBoard summaries into an event
file of its own (`event_file.py`).

The values are the tensors `tf.summary.scalar` and `tf.summary.histogram`
would write, with the same plugin metadata, so TensorBoard reads them as
scalars and histograms; they are encoded in Python (the protocol buffer
wire format, `_Series`) rather than with TensorFlow ops because a point per
batch must cost little (see `event_file.py`). Writing needs no `tf.summary` state, so a recording
condition left on by another callback (Keras' `TensorBoard` with an integer
`update_freq`, tensorflow/tensorboard#4975) cannot drop these summaries.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata

from tf_diffmap.staleness import StalenessStats
from tf_diffmap.tensorboard_plugin import metadata
from tf_diffmap.tensorboard_plugin.event_file import EventFile, field, varint

__all__ = ["IntervalFigures", "interval_figures", "scalars_layout", "StalenessSummaryWriter"]


@dataclasses.dataclass(frozen=True)
class IntervalFigures:
    """The figures of one point: the updates between two snapshots.

    Per-replica arrays have one entry per replica followed by one for all
    replicas together (index -1), except `share`.

    Attributes:
        version: the store version at the end of the interval.
        updates: updates applied in the interval.
        claimed: updates applied or dropped in the interval.
        mean: mean staleness of the interval's updates, applied or dropped
            (0 where none).
        max: largest staleness of the interval's updates, applied or dropped.
        histogram: `[replicas + 1, bins]` counts of staleness 0, 1, ...,
            trimmed after the last non-empty bin of any row.
        share: per replica, its fraction of the interval's work: updates it
            computed, applied or dropped.
        examples_per_second: examples per second of training time, or None
            when the strategy does not count examples or no time passed.
        dropped: updates dropped in the interval.
        lr_scale: mean learning-rate factor of the applied updates (0 where none).
    """

    version: int
    updates: np.ndarray
    claimed: np.ndarray
    mean: np.ndarray
    max: np.ndarray
    histogram: np.ndarray
    share: np.ndarray
    examples_per_second: np.ndarray | None
    dropped: np.ndarray
    lr_scale: np.ndarray


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def interval_figures(interval: StalenessStats, version: int, seconds: float) -> IntervalFigures:
    """The figures of a point from the counts of its interval.

    The staleness figures (mean, max, distribution) all come from the
    interval's histogram, so that they agree with each other: a snapshot of
    the strategy's counters reads them one after the other while replicas
    keep recording, so between two snapshots taken during training
    `staleness_sum` and `updates` may differ by an update or two, which in a
    short interval would make a mean no update had. An update in the
    histogram's last bin counts as that bin's staleness. Between snapshots
    taken with no update in flight (an epoch's end), with no update dropped
    and none in the last bin, the mean is `StalenessStats.mean_staleness`
    exactly; the other figures are always the arithmetic of `StalenessStats`
    (`interval_max_staleness`, `work_share`, `mean_lr_scale`).

    Args:
        interval: the counts of the interval, e.g. `now.since(before)`.
        version: the store version at the end of the interval.
        seconds: the training time the interval took (without validation).

    Returns:
        An `IntervalFigures`.
    """
    stack = interval_figures_many(_stacked(interval), np.array([version]), [float(seconds)])
    return stack.point(0)


def _stacked(interval: StalenessStats) -> StalenessStats:
    """One interval as a stack of one."""
    return StalenessStats(
        version=interval.version,
        updates=np.asarray(interval.updates)[None],
        dropped=np.asarray(interval.dropped)[None],
        staleness_sum=np.asarray(interval.staleness_sum)[None],
        staleness_max=interval.staleness_max,
        histogram=np.asarray(interval.histogram)[None],
        lr_scale_sum=None
        if interval.lr_scale_sum is None
        else np.asarray(interval.lr_scale_sum)[None],
        examples=None if interval.examples is None else np.asarray(interval.examples)[None],
    )


@dataclasses.dataclass(frozen=True)
class _Stack:
    """The figures of K points, every array with a leading dimension of K
    (see `IntervalFigures`); `histogram` is untrimmed, `bins[k]` the bins
    point k shows, `examples_per_second[k]` None where `seconds[k]` <= 0."""

    version: np.ndarray
    updates: np.ndarray
    claimed: np.ndarray
    mean: np.ndarray
    max: np.ndarray
    histogram: np.ndarray
    bins: np.ndarray
    share: np.ndarray
    examples_per_second: np.ndarray | None
    timed: np.ndarray
    dropped: np.ndarray
    lr_scale: np.ndarray

    def point(self, k: int) -> IntervalFigures:
        return IntervalFigures(
            version=int(self.version[k]),
            updates=self.updates[k],
            claimed=self.claimed[k],
            mean=self.mean[k],
            max=self.max[k],
            histogram=self.histogram[k, :, : self.bins[k]],
            share=self.share[k],
            examples_per_second=None
            if self.examples_per_second is None or not self.timed[k]
            else self.examples_per_second[k],
            dropped=self.dropped[k],
            lr_scale=self.lr_scale[k],
        )


def interval_figures_many(
    intervals: StalenessStats, versions: np.ndarray, seconds: np.ndarray
) -> _Stack:
    """`interval_figures` of K intervals at once.

    Args:
        intervals: the counts of K intervals, each array with a leading
            dimension of K (`[K, replicas]`, the histogram `[K, replicas,
            bins]`).
        versions: `[K]` the store version at the end of each.
        seconds: `[K]` the training time each took.

    Returns:
        The K points' figures, stacked.
    """
    # Batch-level points come by the dozen from the callback's thread while
    # the replicas run: each NumPy call covers every point and replica.
    counts = np.asarray(intervals.histogram, dtype=np.int64)
    points, replicas, width = counts.shape
    histogram = np.empty((points, replicas + 1, width), np.int64)
    histogram[:, :replicas] = counts
    counts.sum(axis=1, out=histogram[:, replicas])
    bins = np.arange(width)
    largest = ((histogram > 0) * bins).max(axis=2)
    claimed = histogram.sum(axis=2).astype(np.float64)
    mean = _ratio((histogram @ bins).astype(np.float64), claimed)
    # Per replica then all together: updates, dropped, examples, lr factors.
    columns = np.zeros((points, replicas + 1, 4))
    columns[:, :replicas, 0] = intervals.updates
    columns[:, :replicas, 1] = intervals.dropped
    if intervals.examples is not None:
        columns[:, :replicas, 2] = intervals.examples
    # Without a recorded factor (no rule), every update had 1.
    lr_scale_sum = intervals.updates if intervals.lr_scale_sum is None else intervals.lr_scale_sum
    columns[:, :replicas, 3] = lr_scale_sum
    columns[:, replicas] = columns[:, :replicas].sum(axis=1)
    updates, dropped = columns[:, :, 0], columns[:, :, 1]
    work = updates[:, :replicas] + dropped[:, :replicas]
    share = _ratio(work, np.broadcast_to(work.sum(axis=1, keepdims=True), work.shape))
    lr_scale = _ratio(columns[:, :, 3], updates)
    seconds = np.asarray(seconds, dtype=np.float64)
    examples_per_second = None
    if intervals.examples is not None:
        examples_per_second = _ratio(
            columns[:, :, 2], np.broadcast_to(seconds[:, None], updates.shape)
        )
    return _Stack(
        version=np.asarray(versions, np.int64),
        updates=updates,
        claimed=claimed,
        mean=mean,
        max=largest.astype(np.float64),
        histogram=histogram,
        bins=largest[:, -1] + 1,
        share=share,
        examples_per_second=examples_per_second,
        timed=seconds > 0,
        dropped=dropped,
        lr_scale=lr_scale,
    )


def scalars_layout(rules: bool, faults: bool = False) -> layout_pb2.Layout:
    """The custom-scalars layout: every replica's line of a series in one chart.

    TensorBoard merges the layouts of all runs, dropping charts that are the
    same, so the charts do not depend on the run (e.g. its replica count).

    Args:
        rules: add the charts of an active AsyncOptimizer rule.
        faults: add the chart of lost replicas (training on a cluster).

    Returns:
        A `layout_pb2.Layout` with one category, `metadata.LAYOUT_CATEGORY`.
    """

    def chart(title: str, series: str, with_all: bool = True) -> layout_pb2.Chart:
        suffix = r"(replica_\d+|all)" if with_all else r"replica_\d+"
        return layout_pb2.Chart(
            title=title,
            multiline=layout_pb2.MultilineChartContent(tag=[rf"^{series}/{suffix}$"]),
        )

    charts = [
        chart("Mean staleness per replica", metadata.MEAN),
        chart("Largest staleness per replica", metadata.MAX),
        chart("Updates applied per replica", metadata.UPDATES, with_all=False),
        chart("Share of the work per replica", metadata.SHARE, with_all=False),
        chart("Examples per second per replica", metadata.EXAMPLES_PER_SECOND),
        layout_pb2.Chart(
            title="Store version",
            multiline=layout_pb2.MultilineChartContent(tag=[rf"^{metadata.VERSION}$"]),
        ),
    ]
    if faults:
        charts.append(chart("Replicas lost (1 while lost)", metadata.LOST))
    if rules:
        charts += [
            chart("Dropped updates per replica", metadata.DROPPED),
            chart("Effective learning-rate scale per replica", metadata.LR_SCALE),
        ]
    return layout_pb2.Layout(
        category=[layout_pb2.Category(title=metadata.LAYOUT_CATEGORY, chart=charts)]
    )


_DESCRIPTIONS = {
    metadata.MEAN: "Mean staleness of the interval's updates (applied or dropped): "
    "updates other replicas claimed while this one computed its gradient.",
    metadata.MAX: "Largest staleness of an update in the interval (applied or dropped).",
    metadata.DISTRIBUTION: "Staleness of the interval's updates, one bucket per "
    "staleness; the strategy's last bin counts that staleness and above.",
    metadata.UPDATES: "Updates applied to the parameter store in the interval.",
    metadata.SHARE: "This replica's fraction of the updates computed in the interval "
    "(applied or dropped).",
    metadata.EXAMPLES_PER_SECOND: "Examples per second of training time in the interval.",
    metadata.LOST: "1 where the replica was lost (its worker unreachable, or rejoining), "
    "else 0; for all replicas, how many were.",
    metadata.VERSION: "Updates the parameter store has applied since it was created.",
    metadata.DROPPED: "Updates computed but not applied (staler than drop_above).",
    metadata.LR_SCALE: "Mean factor the staleness rule applied to the learning rate.",
}


def histogram_buckets(counts: np.ndarray) -> np.ndarray:
    """Counts of staleness 0, 1, ... as the histograms plugin's buckets.

    Bucket s spans [s - 0.5, s + 0.5), so that each integer staleness sits in
    the middle of its own bucket.

    Args:
        counts: `[..., k]` counts of staleness 0 to k - 1.

    Returns:
        `[..., k, 3]` float64 (left edge, right edge, count).
    """
    counts = np.asarray(counts, dtype=np.float64)
    buckets = np.empty(counts.shape + (3,))
    centers = np.arange(counts.shape[-1], dtype=np.float64)
    buckets[..., 0] = centers - 0.5
    buckets[..., 1] = centers + 0.5
    buckets[..., 2] = counts
    return buckets


# A scalar's tensor up to its value: float32 (as `tf.summary.scalar`
# writes; TensorBoard's data server takes no other scalar type), shape [],
# one packed float (4 bytes) in `float_val`.
_SCALAR_TENSOR = b"\x08" + varint(types_pb2.DT_FLOAT) + field(2, b"") + b"\x2a\x04"
_DOUBLE_TENSOR = b"\x08" + varint(types_pb2.DT_DOUBLE)
_BUCKET_BYTES = 3 * 8  # a histogram bucket: left edge, right edge, count
_FLOAT = struct.Struct("<f")


def _float32(number: float) -> bytes:
    try:
        return _FLOAT.pack(number)
    except OverflowError:  # beyond float32: infinite, as a cast would make it
        return _FLOAT.pack(math.copysign(math.inf, number))


class _Series:
    """One tag's values, each encoded as a `Summary`'s `value` field.

    A point writes some forty values; each is the bytes of its tag (made once
    per tag, and per shape of a matrix) followed by its number or content:
    about a third of what filling protocol buffers cost. The first value of a
    tag in an event file carries the tag's metadata, as TensorFlow's own
    writer does: TensorBoard keeps the first it reads.
    """

    __slots__ = ("_tag", "_metadata", "_scalar", "_matrices")

    def __init__(self, tag: str, summary_metadata: summary_pb2.SummaryMetadata):
        self._tag = field(1, tag.encode())  # Value: tag 1, tensor 8, metadata 9
        self._metadata = field(9, summary_metadata.SerializeToString())
        self._scalar: bytes | None = None
        self._matrices: dict[tuple[int, ...], bytes] = {}

    def scalar(self, number: float) -> bytes:
        """A scalar value (float32)."""
        if self._scalar is None:
            if self._metadata:
                return self._first(_SCALAR_TENSOR + _float32(number))
            self._scalar = self._until_last(_SCALAR_TENSOR, 4)
        return self._scalar + _float32(number)

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


@dataclasses.dataclass(frozen=True)
class _Row:
    """The series of one replica (or of all replicas together) in a point."""

    mean: _Series
    max: _Series
    distribution: _Series
    updates: _Series
    share: _Series | None
    examples_per_second: _Series
    dropped: _Series | None
    lr_scale: _Series | None
    lost: _Series


class StalenessSummaryWriter:
    """Writes staleness figures as TensorBoard summaries into `log_dir`.

    Args:
        log_dir: the run's directory (the callback's `log_dir/staleness`).
        run_info: what the dashboard needs to know about the run.
        rules: also write the dropped updates and the learning-rate scale.
        totals: running totals to continue from (`[replicas, len(TOTALS_COLUMNS)]`),
            e.g. those of an earlier writer of the same run; zeros by default.
        faults: the run trains on a cluster, where replicas may be lost: the
            layout gets a chart of them.

    Raises:
        ValueError: `totals` of the wrong shape.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        run_info: metadata.RunInfo,
        rules: bool,
        totals: np.ndarray | None = None,
        faults: bool = False,
    ):
        self.run_info = run_info
        self.rules = rules
        self.faults = faults
        shape = (run_info.num_replicas, len(metadata.TOTALS_COLUMNS))
        self.totals = np.zeros(shape) if totals is None else np.array(totals, np.float64)
        if self.totals.shape != shape:
            raise ValueError(f"totals must have shape {shape}, received {self.totals.shape}.")
        self._file = EventFile(log_dir)
        self._series: dict[tuple[str, int | None | str], _Series] = {}
        # One row of series per replica, then one for all replicas (None).
        self._rows = [
            _Row(
                mean=self._get(metadata.MEAN, r),
                max=self._get(metadata.MAX, r),
                distribution=self._get(metadata.DISTRIBUTION, r),
                updates=self._get(metadata.UPDATES, r),
                share=None if r is None else self._get(metadata.SHARE, r),
                examples_per_second=self._get(metadata.EXAMPLES_PER_SECOND, r),
                dropped=self._get(metadata.DROPPED, r) if rules else None,
                lr_scale=self._get(metadata.LR_SCALE, r) if rules else None,
                lost=self._get(metadata.LOST, r),
            )
            for r in [*range(run_info.num_replicas), None]
        ]
        self._version = self._get(metadata.VERSION, "")
        self._totals = self._get(metadata.TOTALS, "")

    @property
    def path(self) -> str:
        """The event file."""
        return self._file.path

    def _get(self, series: str, replica: int | None | str) -> _Series:
        found = self._series.get((series, replica))
        if found is None:
            tag = series if replica == "" else metadata.tag(series, replica)
            if series == metadata.DISTRIBUTION:
                meta = histogram_metadata.create_summary_metadata(tag, _DESCRIPTIONS[series])
                meta.data_class = summary_pb2.DATA_CLASS_TENSOR
            elif series == metadata.TOTALS:
                meta = summary_pb2.SummaryMetadata(
                    summary_description="Running totals per replica: "
                    + ", ".join(metadata.TOTALS_COLUMNS),
                    plugin_data=summary_pb2.SummaryMetadata.PluginData(
                        plugin_name=metadata.PLUGIN_NAME, content=self.run_info.to_bytes()
                    ),
                    data_class=summary_pb2.DATA_CLASS_TENSOR,
                )
            else:
                meta = scalar_metadata.create_summary_metadata(tag, _DESCRIPTIONS[series])
                meta.data_class = summary_pb2.DATA_CLASS_SCALAR
            found = self._series[series, replica] = _Series(tag, meta)
        return found

    def point(
        self,
        interval: StalenessStats,
        version: int,
        seconds: float,
        lost: np.ndarray | None = None,
    ) -> bytes:
        """One point's values, an encoded `Summary` (and adds its counts to
        the totals).

        Args:
            interval: the counts since the previous point.
            version: the store version now.
            seconds: the training time since the previous point.
            lost: per replica, whether it was lost at this point; None
                writes no `metadata.LOST` values.

        Returns:
            The point's `Summary`, its values in an order that keeps each
            replica's series together; a tag's first value carries its
            metadata, so write every point returned, in order.
        """
        intervals = _stacked(interval)
        stack = interval_figures_many(intervals, np.array([version]), [float(seconds)])
        (summary,) = self._summaries(intervals, stack, [lost])
        return summary

    def _summaries(
        self, intervals: StalenessStats, stack: _Stack, lost: list[np.ndarray | None]
    ) -> list[bytes]:
        """The `Summary` of each of K points (`point` of each, in order)."""
        points, replicas = intervals.updates.shape
        # The running totals at each point.
        added = np.zeros((points, replicas, len(metadata.TOTALS_COLUMNS)))
        added[:, :, 0] = intervals.updates
        added[:, :, 1] = intervals.dropped
        if intervals.examples is not None:
            added[:, :, 2] = intervals.examples
        added[:, :, 3] = intervals.staleness_sum
        totals = self.totals + np.cumsum(added, axis=0)
        totals[:, :, 4] = np.maximum.accumulate(
            np.maximum(self.totals[:, 4], stack.max[:, :-1]), axis=0
        )
        self.totals = totals[-1].copy()
        totals_shape = self.totals.shape
        totals = np.ascontiguousarray(totals, dtype="<f8").tobytes()
        totals_size = len(totals) // points

        # Plain floats and bytes, made once for all K points: NumPy calls
        # value by value would cost more than encoding the values.
        claimed, mean = stack.claimed.tolist(), stack.mean.tolist()
        largest, updates = stack.max.tolist(), stack.updates.tolist()
        share, dropped = stack.share.tolist(), stack.dropped.tolist()
        lr_scale, versions = stack.lr_scale.tolist(), stack.version.tolist()
        timed = stack.timed.tolist()
        eps = None if stack.examples_per_second is None else stack.examples_per_second.tolist()
        # Point k's histogram of row i: its first bins[k] buckets of 3 floats.
        buckets = np.ascontiguousarray(histogram_buckets(stack.histogram), dtype="<f8")
        row_size = buckets[0, 0].nbytes
        buckets = buckets.tobytes()
        bins = stack.bins.tolist()
        summaries = []
        for k in range(points):
            values = []
            add = values.append
            shape = (bins[k], 3)
            start = k * len(self._rows) * row_size
            for i, row in enumerate(self._rows):
                if claimed[k][i] > 0:
                    add(row.mean.scalar(mean[k][i]))
                    add(row.max.scalar(largest[k][i]))
                    at = start + i * row_size
                    add(row.distribution.matrix(buckets[at : at + shape[0] * _BUCKET_BYTES], shape))
                add(row.updates.scalar(updates[k][i]))
                if row.share is not None:
                    add(row.share.scalar(share[k][i]))
                if eps is not None and timed[k]:
                    add(row.examples_per_second.scalar(eps[k][i]))
                if self.rules:
                    add(row.dropped.scalar(dropped[k][i]))
                    if updates[k][i] > 0:
                        add(row.lr_scale.scalar(lr_scale[k][i]))
                if lost[k] is not None:
                    add(row.lost.scalar(float(lost[k][i] if i < replicas else np.sum(lost[k]))))
            add(self._version.scalar(versions[k]))
            add(self._totals.matrix(totals[k * totals_size : (k + 1) * totals_size], totals_shape))
            summaries.append(b"".join(values))
        return summaries

    # -- what the callback calls ------------------------------------------

    def write_layout(self) -> None:
        """Writes the custom-scalars layout (once per writer is enough)."""
        layout = scalars_layout(self.rules, self.faults)
        value = summary_pb2.Summary.Value(
            tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
            metadata=custom_scalar_metadata.create_summary_metadata(),
            tensor=tensor_pb2.TensorProto(
                dtype=types_pb2.DT_STRING,
                tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                string_val=[layout.SerializeToString()],
            ),
        )
        self._file.write([value], step=0)

    def write(
        self,
        step: int,
        interval: StalenessStats,
        version: int,
        seconds: float,
        lost: np.ndarray | None = None,
    ) -> None:
        """Writes one point of every series.

        Args:
            step: the point's step (an epoch, or a count of batches).
            interval: the counts since the previous point.
            version: the store version now.
            seconds: the training time since the previous point.
            lost: per replica, whether it was lost at this point (see `point`).
        """
        self._file.write_encoded(self.point(interval, version, seconds, lost), step)

    def write_many(
        self,
        steps: list[int],
        intervals: StalenessStats,
        versions: np.ndarray,
        seconds: np.ndarray,
        lost: list[np.ndarray | None] | None = None,
    ) -> None:
        """Writes K points at once: `write` for each, its figures computed
        for all of them together.

        Args:
            steps: the K points' steps.
            intervals: the counts since each point's previous one, every
                array with a leading dimension of K.
            versions: `[K]` the store version at each point.
            seconds: `[K]` the training time since each point's previous one.
            lost: per point, per replica, whether it was lost (or None).
        """
        stack = interval_figures_many(intervals, versions, seconds)
        lost = [None] * len(steps) if lost is None else lost
        for step, summary in zip(steps, self._summaries(intervals, stack, lost), strict=True):
            self._file.write_encoded(summary, step)

    def flush(self) -> None:
        """Writes buffered points to disk."""
        self._file.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._file.close()
