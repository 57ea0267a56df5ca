"""The figures of a staleness point, from the difference of two snapshots.

`interval_figures` turns the counts of one interval (`StalenessStats`, the
difference of two snapshots) into the numbers one point of each series
shows; `interval_figures_many` does so for K intervals at once, as one
`FigureStack`. Plain NumPy, tested on its own; `summary.py` writes the
figures as TensorBoard summaries.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tf_diffmap.store.staleness import StalenessStats

__all__ = ["FigureStack", "IntervalFigures", "interval_figures", "interval_figures_many", "stacked"]


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
        step_mean, step_max, step_histogram: as `mean`, `max` and
            `histogram`, with the staleness in optimizer steps; None where
            the store takes a step per update (the staleness in steps is
            then the staleness in versions).
        optimizer_steps: the store's optimizer steps at the end of the
            interval, where it aggregates gradients into steps (else None).
        gradients_per_step: the interval's gradients (applied or dropped)
            per optimizer step applied in it; None where it applied none,
            or the store does not aggregate.
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
    step_mean: np.ndarray | None = None
    step_max: np.ndarray | None = None
    step_histogram: np.ndarray | None = None
    optimizer_steps: int | None = None
    gradients_per_step: float | None = None


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def interval_figures(
    interval: StalenessStats, version: int, seconds: float, optimizer_steps: int | None = None
) -> IntervalFigures:
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
    (`interval_max_staleness`, `work_share`, `mean_lr_scale`). The staleness
    in optimizer steps is figured alike from `step_histogram`, where the
    interval is aggregated (`interval.steps` is not None).

    Args:
        interval: the counts of the interval, e.g. `now.since(before)`.
        version: the store version at the end of the interval.
        seconds: the training time the interval took (without validation).
        optimizer_steps: the store's optimizer steps at the end of the
            interval, where it aggregates (`StalenessStats.steps`).

    Returns:
        An `IntervalFigures`.
    """
    stack = interval_figures_many(
        stacked(interval),
        np.array([version]),
        [float(seconds)],
        None if optimizer_steps is None else np.array([optimizer_steps]),
    )
    return stack.point(0)


def stacked(interval: StalenessStats) -> StalenessStats:
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
        steps=None if interval.steps is None else np.asarray(interval.steps)[None],
        step_staleness_sum=None
        if interval.step_staleness_sum is None
        else np.asarray(interval.step_staleness_sum)[None],
        step_histogram=None
        if interval.step_histogram is None
        else np.asarray(interval.step_histogram)[None],
    )


@dataclasses.dataclass(frozen=True)
class FigureStack:
    """The figures of K points, every array with a leading dimension of K
    (see `IntervalFigures`); `histogram` is untrimmed, `bins[k]` the bins
    point k shows, `examples_per_second[k]` None where `seconds[k]` <= 0.
    The step figures are None where the intervals are not aggregated;
    `gradients_per_step[k]` counts only where `stepped[k]`. `histograms`
    holds `histogram` and, after it, the steps' histogram (one array, so
    that their buckets are made together)."""

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
    histograms: np.ndarray
    steps: _Histograms | None = None
    optimizer_steps: np.ndarray | None = None
    gradients_per_step: np.ndarray | None = None
    stepped: np.ndarray | None = None

    def point(self, k: int) -> IntervalFigures:
        steps = self.steps
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
            step_mean=None if steps is None else steps.mean[k],
            step_max=None if steps is None else steps.max[k],
            step_histogram=None if steps is None else steps.histogram[k, :, : steps.bins[k]],
            optimizer_steps=None if self.optimizer_steps is None else int(self.optimizer_steps[k]),
            gradients_per_step=None
            if self.stepped is None or not self.stepped[k]
            else float(self.gradients_per_step[k]),
        )


@dataclasses.dataclass(frozen=True)
class _Histograms:
    """The staleness figures of K points in one unit, from their histograms:
    per point, per replica and then for all (`[K, replicas + 1, ...]`)."""

    histogram: np.ndarray  # untrimmed
    bins: np.ndarray  # [K] the bins point k shows
    claimed: np.ndarray
    mean: np.ndarray
    max: np.ndarray


def _histograms(*units: np.ndarray) -> tuple[np.ndarray, list[_Histograms]]:
    """The figures of K intervals' histograms `[K, replicas, bins]` in each
    unit, computed together (NumPy's calls cost more than their work here).

    Returns:
        The histograms with their all-replica rows, `[units * K, replicas
        + 1, bins]`, and each unit's `_Histograms` (views of it).
    """
    counts = np.concatenate(units) if len(units) > 1 else np.asarray(units[0])
    points, replicas, width = counts.shape
    histogram = np.empty((points, replicas + 1, width), np.int64)
    histogram[:, :replicas] = counts
    histogram[:, :replicas].sum(axis=1, out=histogram[:, replicas])
    bins = np.arange(width)
    largest = ((histogram > 0) * bins).max(axis=2)
    claimed = histogram.sum(axis=2).astype(np.float64)
    mean = _ratio((histogram @ bins).astype(np.float64), claimed)
    maximum = largest.astype(np.float64)
    k = points // len(units)
    return histogram, [
        _Histograms(
            histogram=histogram[at : at + k],
            bins=largest[at : at + k, -1] + 1,
            claimed=claimed[at : at + k],
            mean=mean[at : at + k],
            max=maximum[at : at + k],
        )
        for at in range(0, points, k)
    ]


def interval_figures_many(
    intervals: StalenessStats,
    versions: np.ndarray,
    seconds: np.ndarray,
    optimizer_steps: np.ndarray | None = None,
) -> FigureStack:
    """`interval_figures` of K intervals at once.

    Args:
        intervals: the counts of K intervals, each array with a leading
            dimension of K (`[K, replicas]`, the histograms `[K, replicas,
            bins]`, `steps` `[K]`).
        versions: `[K]` the store version at the end of each.
        seconds: `[K]` the training time each took.
        optimizer_steps: `[K]` the store's optimizer steps at the end of
            each, where the intervals are aggregated.

    Returns:
        The K points' figures, stacked.
    """
    # Batch-level points come by the dozen from the callback's thread while
    # the replicas run: each NumPy call covers every point and replica.
    aggregated = intervals.steps is not None and intervals.step_histogram is not None
    histograms, units = _histograms(
        intervals.histogram, *([intervals.step_histogram] if aggregated else [])
    )
    versions_unit = units[0]
    points, replicas = np.shape(intervals.updates)
    claimed = versions_unit.claimed
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
    steps = stepped = gradients_per_step = None
    if aggregated:
        steps = units[1]
        applied = np.asarray(intervals.steps, np.float64)
        stepped = applied > 0
        gradients_per_step = _ratio(claimed[:, -1], applied)
    return FigureStack(
        version=np.asarray(versions, np.int64),
        updates=updates,
        claimed=claimed,
        mean=versions_unit.mean,
        max=versions_unit.max,
        histogram=versions_unit.histogram,
        bins=versions_unit.bins,
        share=share,
        examples_per_second=examples_per_second,
        timed=seconds > 0,
        dropped=dropped,
        lr_scale=lr_scale,
        histograms=histograms,
        steps=steps,
        optimizer_steps=None
        if steps is None or optimizer_steps is None
        else np.asarray(optimizer_steps, np.int64),
        gradients_per_step=gradients_per_step,
        stepped=stepped,
    )
