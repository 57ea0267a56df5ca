"""Staleness statistics as TensorBoard summaries.

`StalenessSummaryWriter` writes the figures of each point (`figures.py`:
`interval_figures` turns the difference of two `StalenessStats` snapshots
into the numbers one point of each series shows) as TensorBoard summaries
into an event file of its own (`event_file.py`).

The values are the tensors `tf.summary.scalar` and `tf.summary.histogram`
would write, with the same plugin metadata, so TensorBoard reads them as
scalars and histograms; they are encoded in Python (the protocol buffer
wire format, `encoding.py`) rather than with TensorFlow ops because a point
per batch must cost little (see `event_file.py`). Writing needs no
`tf.summary` state, so a recording condition left on by another callback
(Keras' `TensorBoard` with an integer `update_freq`,
tensorflow/tensorboard#4975) cannot drop these summaries.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata

from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.tensorboard_plugin import metadata
from tf_diffmap.tensorboard_plugin.encoding import BUCKET_BYTES, ScalarBlocks, Series
from tf_diffmap.tensorboard_plugin.event_file import EventFile
from tf_diffmap.tensorboard_plugin.figures import FigureStack, interval_figures_many, stacked

__all__ = ["scalars_layout", "StalenessSummaryWriter"]


def scalars_layout(
    rules: bool, faults: bool = False, steps: bool = False, dropping: bool = False
) -> layout_pb2.Layout:
    """The custom-scalars layout: every replica's line of a series in one chart.

    TensorBoard merges the layouts of all runs, dropping charts that are the
    same, so the charts do not depend on the run (e.g. its replica count).

    Args:
        rules: add the charts of an active AsyncOptimizer rule.
        faults: add the chart of lost replicas (training on a cluster).
        steps: add the charts of the staleness in optimizer steps and of
            the store's steps (a store that aggregates gradients into steps).
        dropping: add the chart of dropped updates without a rule (the
            strategy's `max_step_staleness` drops stale gradients).

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
    if steps:
        charts[2:2] = [
            chart("Mean staleness in optimizer steps per replica", metadata.STEP_MEAN),
            chart("Largest staleness in optimizer steps per replica", metadata.STEP_MAX),
        ]
        charts += [
            layout_pb2.Chart(
                title=title,
                multiline=layout_pb2.MultilineChartContent(tag=[rf"^{series}$"]),
            )
            for title, series in (
                ("Optimizer steps", metadata.OPTIMIZER_STEPS),
                ("Gradients per optimizer step", metadata.GRADIENTS_PER_STEP),
            )
        ]
    if faults:
        charts.append(chart("Replicas lost (1 while lost)", metadata.LOST))
    if rules or dropping:
        charts.append(chart("Dropped updates per replica", metadata.DROPPED))
    if rules:
        charts.append(chart("Effective learning-rate scale per replica", metadata.LR_SCALE))
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
    metadata.DROPPED: "Updates computed but not applied: staler than the AsyncOptimizer's "
    "drop_above, or than the strategy's max_step_staleness in optimizer steps.",
    metadata.LR_SCALE: "Mean factor the staleness rule applied to the learning rate.",
    metadata.STEP_MEAN: "Mean staleness in optimizer steps of the interval's updates "
    "(applied or dropped): steps the store applied between the read of the parameters "
    "a gradient was computed on and its push.",
    metadata.STEP_MAX: "Largest staleness in optimizer steps of an update in the interval "
    "(applied or dropped).",
    metadata.STEP_DISTRIBUTION: "Staleness in optimizer steps of the interval's updates, "
    "one bucket per staleness; the strategy's last bin counts that staleness and above.",
    metadata.OPTIMIZER_STEPS: "Optimizer steps the parameter store has applied since it "
    "was created, each on the mean of its shard gradients.",
    metadata.GRADIENTS_PER_STEP: "Shard gradients (applied or dropped) per optimizer step "
    "applied in the interval.",
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


@dataclasses.dataclass(frozen=True)
class _Row:
    """The series of one replica (or of all replicas together) in a point."""

    mean: Series
    max: Series
    distribution: Series
    updates: Series
    share: Series | None
    examples_per_second: Series
    dropped: Series | None
    lr_scale: Series | None
    lost: Series
    step_mean: Series
    step_max: Series
    step_distribution: Series


# A point's scalars per row, in the order they are written.
_ROW_SCALARS = (
    "mean",
    "max",
    "step_mean",
    "step_max",
    "updates",
    "share",
    "examples_per_second",
    "dropped",
    "lr_scale",
    "lost",
)
# The store's scalars, in that order.
_STORE_SCALARS = (metadata.VERSION, metadata.OPTIMIZER_STEPS, metadata.GRADIENTS_PER_STEP)


def _totals_of(
    totals: np.ndarray | None, run_info: metadata.RunInfo, columns: tuple[str, ...], name: str
) -> np.ndarray:
    """Running totals to continue from (zeros for None), checked."""
    shape = (run_info.num_replicas, len(columns))
    out = np.zeros(shape) if totals is None else np.array(totals, np.float64)
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, received {out.shape}.")
    return out


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
        step_totals: the running totals of the staleness in optimizer steps
            to continue from (`[replicas, len(STEP_TOTALS_COLUMNS)]`).
        dropping: also write the dropped updates without a rule (the
            strategy's `max_step_staleness` drops stale gradients).

    The staleness in optimizer steps, the store's steps and `STEP_TOTALS`
    are written for the points whose interval is aggregated (its `steps`
    is not None), and the layout has their charts where `run_info` says the
    store aggregates (`gradients_per_step`).

    Raises:
        ValueError: `totals` or `step_totals` of the wrong shape.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        run_info: metadata.RunInfo,
        rules: bool,
        totals: np.ndarray | None = None,
        faults: bool = False,
        step_totals: np.ndarray | None = None,
        dropping: bool = False,
    ):
        self.run_info = run_info
        self.rules = rules
        self.dropping = rules or dropping
        self.faults = faults
        self.totals = _totals_of(totals, run_info, metadata.TOTALS_COLUMNS, "totals")
        self.step_totals = _totals_of(
            step_totals, run_info, metadata.STEP_TOTALS_COLUMNS, "step_totals"
        )
        self._file = EventFile(log_dir)
        self._series: dict[tuple[str, int | None | str], Series] = {}
        # One row of series per replica, then one for all replicas (None).
        self._rows = [
            _Row(
                mean=self._get(metadata.MEAN, r),
                max=self._get(metadata.MAX, r),
                distribution=self._get(metadata.DISTRIBUTION, r),
                updates=self._get(metadata.UPDATES, r),
                share=None if r is None else self._get(metadata.SHARE, r),
                examples_per_second=self._get(metadata.EXAMPLES_PER_SECOND, r),
                dropped=self._get(metadata.DROPPED, r) if self.dropping else None,
                lr_scale=self._get(metadata.LR_SCALE, r) if rules else None,
                lost=self._get(metadata.LOST, r),
                step_mean=self._get(metadata.STEP_MEAN, r),
                step_max=self._get(metadata.STEP_MAX, r),
                step_distribution=self._get(metadata.STEP_DISTRIBUTION, r),
            )
            for r in [*range(run_info.num_replicas), None]
        ]
        self._totals = self._get(metadata.TOTALS, "")
        self._step_totals = self._get(metadata.STEP_TOTALS, "")
        # A point's scalars: each row's (`_ROW_SCALARS`), then the store's,
        # as a last row's first slots.
        store = [self._get(series, "") for series in _STORE_SCALARS]
        self._scalars = ScalarBlocks(
            [getattr(row, name) for row in self._rows for name in _ROW_SCALARS]
            + store
            + [None] * (len(_ROW_SCALARS) - len(store))
        )

    @property
    def path(self) -> str:
        """The event file."""
        return self._file.path

    def _get(self, series: str, replica: int | None | str) -> Series:
        found = self._series.get((series, replica))
        if found is None:
            tag = series if replica == "" else metadata.tag(series, replica)
            if series in (metadata.DISTRIBUTION, metadata.STEP_DISTRIBUTION):
                meta = histogram_metadata.create_summary_metadata(tag, _DESCRIPTIONS[series])
                meta.data_class = summary_pb2.DATA_CLASS_TENSOR
            elif series in (metadata.TOTALS, metadata.STEP_TOTALS):
                columns = (
                    metadata.TOTALS_COLUMNS
                    if series == metadata.TOTALS
                    else metadata.STEP_TOTALS_COLUMNS
                )
                meta = summary_pb2.SummaryMetadata(
                    summary_description="Running totals per replica: " + ", ".join(columns),
                    plugin_data=summary_pb2.SummaryMetadata.PluginData(
                        plugin_name=metadata.PLUGIN_NAME,
                        # The run's description rides on TOTALS alone.
                        content=self.run_info.to_bytes() if series == metadata.TOTALS else b"",
                    ),
                    data_class=summary_pb2.DATA_CLASS_TENSOR,
                )
            else:
                meta = scalar_metadata.create_summary_metadata(tag, _DESCRIPTIONS[series])
                meta.data_class = summary_pb2.DATA_CLASS_SCALAR
            found = self._series[series, replica] = Series(tag, meta)
        return found

    def point(
        self,
        interval: StalenessStats,
        version: int,
        seconds: float,
        lost: np.ndarray | None = None,
        optimizer_steps: int | None = None,
    ) -> bytes:
        """One point's values, an encoded `Summary` (and adds its counts to
        the totals).

        Args:
            interval: the counts since the previous point.
            version: the store version now.
            seconds: the training time since the previous point.
            lost: per replica, whether it was lost at this point; None
                writes no `metadata.LOST` values.
            optimizer_steps: the store's optimizer steps now, where the
                interval is aggregated.

        Returns:
            The point's `Summary`, its values in an order that keeps each
            replica's series together; a tag's first value carries its
            metadata, so write every point returned, in order.
        """
        intervals = stacked(interval)
        stack = interval_figures_many(
            intervals,
            np.array([version]),
            [float(seconds)],
            None if optimizer_steps is None else np.array([optimizer_steps]),
        )
        (summary,) = self._summaries(intervals, stack, [lost])
        return summary

    def _summaries(
        self, intervals: StalenessStats, stack: FigureStack, lost: list[np.ndarray | None]
    ) -> list[bytes]:
        """The `Summary` of each of K points (`point` of each, in order):
        a point's scalars (see `_scalar_slots`), then its matrices."""
        points = len(stack.version)
        scalars = self._scalars.encode(*self._scalar_slots(stack, lost))
        totals = self._running_totals(intervals, stack)
        # Point k's histogram of row i: its first bins[k] buckets of 3
        # floats; the steps' histograms (if any) after the versions'.
        buckets = np.ascontiguousarray(histogram_buckets(stack.histograms), dtype="<f8")
        row_size = buckets[0, 0].nbytes
        buckets = buckets.tobytes()
        steps = stack.steps
        rows = len(self._rows)
        claimed, bins = stack.claimed.tolist(), stack.bins.tolist()
        step_bins = None if steps is None else steps.bins.tolist()
        summaries = []
        for k in range(points):
            values = [scalars[k]]
            add = values.append
            start = k * rows * row_size
            for i, row in enumerate(self._rows):
                if claimed[k][i] > 0:
                    at = start + i * row_size
                    size = bins[k] * BUCKET_BYTES
                    add(row.distribution.matrix(buckets[at : at + size], (bins[k], 3)))
                    if steps is not None:  # every update counts in both histograms
                        at += rows * row_size * points
                        size = step_bins[k] * BUCKET_BYTES
                        content = buckets[at : at + size]
                        add(row.step_distribution.matrix(content, (step_bins[k], 3)))
            for series, (table, shape) in zip((self._totals, self._step_totals), totals):
                size = len(table) // points
                add(series.matrix(table[k * size : (k + 1) * size], shape))
            summaries.append(b"".join(values))
        return summaries

    def _scalar_slots(
        self, stack: FigureStack, lost: list[np.ndarray | None]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The scalars of K points: `[K, slots]` values and whether each is
        written, slots in the order of `self._scalars`: `_ROW_SCALARS` of
        each row, then the store's.

        A row's staleness where it had updates (applied or dropped), in
        steps where the store aggregates; its share (a replica's row); its
        examples per second where time passed; the rule's figures with a
        rule (the learning-rate factor where updates were applied); whether
        it was lost where that is known. The store's version, and where it
        aggregates its optimizer steps, and its gradients per step where it
        took a step.
        """
        points, rows = stack.updates.shape
        kinds = len(_ROW_SCALARS)
        # One call per figure: the store's scalars are a last row's.
        values = np.zeros((points, rows + 1, kinds))
        present = np.zeros((points, rows + 1, kinds), bool)
        claimed = stack.claimed > 0
        values[:, :rows, 0] = stack.mean
        values[:, :rows, 1] = stack.max
        present[:, :rows, 0:2] = claimed[:, :, None]
        steps = stack.steps
        if steps is not None:
            values[:, :rows, 2] = steps.mean
            values[:, :rows, 3] = steps.max
            present[:, :rows, 2:4] = claimed[:, :, None]
        values[:, :rows, 4] = stack.updates
        values[:, : rows - 1, 5] = stack.share
        present[:, :rows, 4] = True
        present[:, : rows - 1, 5] = True
        if stack.examples_per_second is not None:
            values[:, :rows, 6] = stack.examples_per_second
            present[:, :rows, 6] = stack.timed[:, None]
        if self.dropping:
            values[:, :rows, 7] = stack.dropped
            present[:, :rows, 7] = True
        if self.rules:
            values[:, :rows, 8] = stack.lr_scale
            present[:, :rows, 8] = stack.updates > 0
        for k, replicas in enumerate(lost):
            if replicas is not None:
                values[k, : rows - 1, 9] = replicas
                values[k, rows - 1, 9] = np.sum(replicas)
                present[k, :rows, 9] = True
        store = values[:, rows]
        store[:, 0] = stack.version
        present[:, rows, 0] = True
        if steps is not None:
            if stack.optimizer_steps is not None:
                store[:, 1] = stack.optimizer_steps
                present[:, rows, 1] = True
            store[:, 2] = stack.gradients_per_step
            present[:, rows, 2] = stack.stepped
        return values.reshape(points, -1), present.reshape(points, -1)

    def _running_totals(
        self, intervals: StalenessStats, stack: FigureStack
    ) -> list[tuple[bytes, tuple[int, int]]]:
        """The running totals at each of K points (and adds the intervals'
        counts to them): `TOTALS`, and `STEP_TOTALS` where the store
        aggregates, each as the bytes of K tables and a table's shape."""
        points, replicas = intervals.updates.shape
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
        out = [(np.ascontiguousarray(totals, dtype="<f8").tobytes(), self.totals.shape)]
        if stack.steps is not None:
            added = np.zeros((points, *self.step_totals.shape))
            added[:, :, 0] = intervals.step_staleness_sum
            totals = self.step_totals + np.cumsum(added, axis=0)
            totals[:, :, 1] = np.maximum.accumulate(
                np.maximum(self.step_totals[:, 1], stack.steps.max[:, :-1]), axis=0
            )
            self.step_totals = totals[-1].copy()
            step_table = np.ascontiguousarray(totals, dtype="<f8").tobytes()
            out.append((step_table, self.step_totals.shape))
        return out

    # -- what the callback calls ------------------------------------------

    def write_layout(self) -> None:
        """Writes the custom-scalars layout (once per writer is enough)."""
        layout = scalars_layout(
            self.rules,
            self.faults,
            steps=self.run_info.gradients_per_step is not None,
            dropping=self.dropping,
        )
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
        optimizer_steps: int | None = None,
    ) -> None:
        """Writes one point of every series.

        Args:
            step: the point's step (an epoch, or a count of batches).
            interval: the counts since the previous point.
            version: the store version now.
            seconds: the training time since the previous point.
            lost: per replica, whether it was lost at this point (see `point`).
            optimizer_steps: the store's optimizer steps now, where the
                interval is aggregated.
        """
        self._file.write_encoded(
            self.point(interval, version, seconds, lost, optimizer_steps), step
        )

    def write_many(
        self,
        steps: list[int],
        intervals: StalenessStats,
        versions: np.ndarray,
        seconds: np.ndarray,
        lost: list[np.ndarray | None] | None = None,
        optimizer_steps: np.ndarray | None = None,
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
            optimizer_steps: `[K]` the store's optimizer steps at each
                point, where the intervals are aggregated.
        """
        stack = interval_figures_many(intervals, versions, seconds, optimizer_steps)
        lost = [None] * len(steps) if lost is None else lost
        for step, summary in zip(steps, self._summaries(intervals, stack, lost), strict=True):
            self._file.write_encoded(summary, step)

    def flush(self) -> None:
        """Writes buffered points to disk."""
        self._file.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._file.close()
