"""`tf_diffmap.StalenessTensorBoard`: staleness in TensorBoard, from `model.fit`.

The callback decides *when* to write: each point covers the updates between
two snapshots of the strategy's counters (their difference:
`tf_diffmap/store/intervals.py`). *What* is written, and how, is in
`tf_diffmap/tensorboard_plugin/` (`figures.py`, `summary.py`).

Epoch points read the counters (`Strategy.statistics()`) at the epoch's end.
Batch-level points come from snapshots that Keras' graph itself takes at the
end of each step (`tf_diffmap/store/snapshots.py`), which a thread of the
callback's own reads in bulk and writes: the training loop only counts
batches: reading the counters from Python at each batch would run eager
ops that wait for the interpreter lock and for a CPU the replicas hold.
"""

from __future__ import annotations

import logging
import os
import time

import keras
import numpy as np

from tf_diffmap.engine.threads import Background
from tf_diffmap.store.gate import WindowStats
from tf_diffmap.store.intervals import difference, differences
from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.strategy import Strategy
from tf_diffmap.tensorboard_plugin import metadata
from tf_diffmap.tensorboard_plugin.summary import StalenessSummaryWriter
from tf_diffmap.updates.optimizer import AsyncOptimizer, find_in_chain

__all__ = ["StalenessTensorBoard"]

_logger = logging.getLogger("tf_diffmap")


def _active_rule(optimizer) -> str | None:
    """A description of the model's AsyncOptimizer rule, or None if none acts."""
    optimizer = find_in_chain(optimizer, AsyncOptimizer)
    if optimizer is None:
        return None
    rule = optimizer.rule
    name = getattr(rule, "__name__", "callable") if callable(rule) else str(rule)
    if optimizer.drop_above is not None:
        return f"{name} (drop_above={optimizer.drop_above})"
    return None if name == "none" else name


class StalenessTensorBoard(keras.callbacks.Callback):
    """Writes the staleness of asynchronous training for TensorBoard.

    Use it beside (or instead of) `keras.callbacks.TensorBoard`, with the same
    log directory: it writes into its own run, `log_dir/staleness`, one point
    per epoch (or per `update_freq` batches) of:

    - `staleness/mean/replica_<i>` and `staleness/max/replica_<i>`: the mean
      and largest staleness of the replica's updates in the interval, and
      `staleness/distribution/replica_<i>`, their histogram (one bucket per
      staleness); `.../all` for every replica together;
    - `work/updates/...`, `work/share/replica_<i>` and
      `work/examples_per_second/...`: the work each replica did;
    - `store/version`: the parameter store's version;
    - where the store aggregates shard gradients into optimizer steps
      (`tf_diffmap.Strategy(gradients_per_step=K)`, K > 1, the default
      with several replicas), the staleness in optimizer steps beside the
      staleness in versions: `staleness/steps/mean/...`,
      `staleness/steps/max/...` and `staleness/steps/distribution/...`, with
      `store/optimizer_steps` and `store/gradients_per_step`;
    - `rule/dropped/...` and `rule/lr_scale/...` when the model's
      `tf_diffmap.AsyncOptimizer` has an active rule, and `rule/dropped/...`
      where the strategy's `max_step_staleness` (the default with
      aggregation) may drop stale gradients;
    - a custom-scalars layout that puts every replica's line of a series in
      one chart, and the data of the "Staleness" tab that tf_diffmap adds to
      TensorBoard.

    Points are written from the strategy's counters only, read without
    waiting for the replicas. For batch-level points, Keras' graph copies the
    counters at the end of every step while the callback reads them (a few
    native ops, so that every batch can have its point, with
    `steps_per_execution` too), and
    a thread of the callback's own reads the copies in bulk and writes the
    points; the training loop only counts batches. A point costs a few
    hundredths of a millisecond of CPU (`point_cpu_seconds` has the figures
    of the latest `fit`); as a safety net, the points of a `fit` are kept from
    costing more than `max_overhead` of its training time: when steps are so
    short that a point every `update_freq` batches would cost more, a point
    covers more batches, and the callback logs a warning the first time it
    does so. An epoch's point is written after the epoch's updates have all
    landed (as Keras' epoch-end metrics wait for them anyway); with
    `update_freq="batch"` or `N`, the point of an epoch's last batch waits
    for the epoch's end too, and the updates still in flight at another point
    count in the next one, so that the points add up to every update.

    Args:
        log_dir: the log directory, shared with `keras.callbacks.TensorBoard`
            if you use it.
        update_freq: `"epoch"` (a point per epoch, at step = epoch), `"batch"`
            (a point per batch), or an int N (a point every N batches); the
            step of a batch-level point counts the batches since the callback's
            first training began, as Keras' batch-level summaries do within a
            `fit`.
        max_overhead: with batch-level points, the largest share of the
            training time that taking them may cost: a point is skipped (its
            batches count in the next one) while the CPU time the points of
            this `fit` took exceeds `max_overhead` times the training time so
            far (validation excluded). None takes a point every `update_freq`
            batches whatever it costs.

    Raises:
        ValueError: an `update_freq` or `max_overhead` out of range; or, when
            training begins, a model that is not trained by a
            `tf_diffmap.Strategy`.

    Examples:
        >>> import keras, numpy as np, tf_diffmap
        >>> strategy = tf_diffmap.Strategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
        >>> callbacks = [keras.callbacks.TensorBoard("logs"),
        ...              tf_diffmap.StalenessTensorBoard("logs")]
        >>> _ = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
        >>> import os
        >>> sorted(os.listdir("logs"))  # Keras' run, and the callback's own
        ['staleness', 'train']
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        update_freq: str | int = "epoch",
        max_overhead: float | None = 0.02,
    ):
        super().__init__()
        if update_freq not in ("epoch", "batch") and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                'update_freq must be "epoch", "batch" or an int >= 1 (a point every '
                f"that many batches), received {update_freq!r}."
            )
        if max_overhead is not None and not 0 < max_overhead <= 1:
            raise ValueError(
                "max_overhead must be a fraction of the training time in (0, 1], or None "
                f"to take every point whatever it costs, received {max_overhead!r}."
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.max_overhead = max_overhead
        # The overhead budget of batch-level points, per fit: the CPU seconds
        # the points took, and the training time they may take a share of.
        self._point_cpu: list[float] = []
        self._spent = 0.0
        self._train_start = 0.0
        self._validation = 0.0
        self._coarsened = False  # logged once per callback
        self._every = (
            None if update_freq == "epoch" else 1 if update_freq == "batch" else update_freq
        )
        self._writer: StalenessSummaryWriter | None = None
        self._window_writer = None  # the windows' scalars (`_write_windows`)
        self._points = Background("tf_diffmap-staleness-points")
        self._point_error: BaseException | None = None
        self._totals = None
        self._step_totals = None
        self._snapshot: StalenessStats | None = None
        # Batches since the callback's first training; at this fit's start
        # (the steps of the graph's snapshots count from there) and at this
        # epoch's start.
        self._batches = 0
        self._fit_start_batch = 0
        self._epoch_start_batch = 0
        self._steps_per_epoch: int | None = None
        self._last_point = -1  # the step of the latest point written
        self._ring_start = 0  # the snapshot of this fit's first batch
        self._ring_index = 0  # the next snapshot to read
        self._read_batch = 0  # batches at the latest request to read
        self._read_time = 0.0
        self._training = False
        # Wall-clock time: where the current interval began, and validation
        # runs (not training time) as (start, end).
        self._interval_start = 0.0
        self._pauses: list[tuple[float, float]] = []
        self._test_start: float | None = None
        # Per replica, how often it had been lost at the latest point.
        self._lost_counts: np.ndarray | None = None
        self._replica_states: list = []

    @property
    def run_dir(self) -> str:
        """Where the summaries go: `log_dir/staleness`."""
        return os.path.join(self.log_dir, metadata.RUN_NAME)

    def _strategy(self) -> Strategy:
        strategy = getattr(self.model, "distribute_strategy", None)
        if not isinstance(strategy, Strategy):
            raise ValueError(
                "StalenessTensorBoard reports the staleness of a tf_diffmap.Strategy, "
                f"but this model is trained by {type(strategy).__name__}. Build and "
                "compile the model inside `with tf_diffmap.Strategy().scope():`, or "
                "drop StalenessTensorBoard from the callbacks."
            )
        return strategy

    # -- training ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        strategy = self._strategy()
        if self._writer is not None:  # a fit that raised: Keras skipped on_train_end
            self._close()
        self._snapshot = strategy.statistics()
        rule = _active_rule(getattr(self.model, "optimizer", None))
        run_info = metadata.RunInfo(
            num_replicas=self._snapshot.num_replicas,
            devices=tuple(strategy.replica_devices),
            histogram_bins=int(self._snapshot.histogram.shape[1]),
            step_unit="epoch" if self._every is None else "batch",
            rule=rule,
            gradients_per_step=strategy.gradients_per_step
            if strategy.gradients_per_step > 1
            else None,
        )
        if self._totals is not None and self._totals.shape[0] != run_info.num_replicas:
            self._totals = self._step_totals = None
        self._writer = StalenessSummaryWriter(
            self.run_dir,
            run_info,
            rules=rule is not None,
            totals=self._totals,
            faults=strategy.extended.runtime.worker_hosts is not None,
            step_totals=self._step_totals,
            dropping=strategy.gradients_per_step > 1 and strategy.max_step_staleness is not None,
        )
        self._writer.write_layout()
        self._point_error = None
        self._point_cpu = []
        self._spent = 0.0
        self._train_start = time.perf_counter()
        self._validation = 0.0
        self._training = True
        self._pauses = []
        self._startinterval()
        if self._every is not None:
            steps = self.params.get("steps") if self.params else None
            self._steps_per_epoch = steps
            self._fit_start_batch = self._epoch_start_batch = self._batches
            self._read_batch = self._batches
            self._read_time = time.monotonic()
            self._ring_start = self._ring_index = strategy.extended.runtime.snapshots.start(self)

    def on_train_end(self, logs=None):
        if self._writer is None:
            return
        try:
            if self._every is not None:
                self._wait_for_points()
                strategy = self._strategy()
                strategy.extended.runtime.snapshots.stop(self)
                self._write_snapshots(strategy)
                self._count_batches()
                # Whatever landed after the last point (at most the batches
                # after the last multiple of N): training is over, so draining
                # costs nothing here.
                strategy.drain()
                now = strategy.statistics()
                if difference(now, self._snapshot).histogram.any():
                    self._write(self._batches, now)
            self._writer.flush()
        finally:
            self._close()

    def _close(self) -> None:
        self._points.wait()
        if self._every is not None and self._training:
            self._strategy().extended.runtime.snapshots.stop(self)
        if self._writer is None:
            return
        self._totals = self._writer.totals
        self._step_totals = self._writer.step_totals
        self._writer.close()
        self._writer = None
        if self._window_writer is not None:
            self._window_writer.close()
            self._window_writer = None
        self._training = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._every is None:
            self._startinterval()
        else:
            self._epoch_start_batch = self._batches

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is None:
            return
        self._wait_for_points()
        strategy = self._strategy()
        if self._every is not None:
            self._write_snapshots(strategy)
            self._count_batches()
        if self._every is None or (self._due(self._batches) and self._last_point != self._batches):
            # Keras has read the epoch's metrics, which waits for every update
            # in flight; draining again is free and makes the point complete
            # whatever the model's metrics are.
            strategy.drain()
            self._write(epoch if self._every is None else self._batches, strategy.statistics())
        self._write_windows(epoch, strategy.window_statistics())
        self._writer.flush()

    def _write_windows(self, epoch: int, windows: WindowStats | None) -> None:
        """At an epoch's end, what the optimizer's windows did, as scalars
        of the run (TensorBoard's Scalars dashboard, tags `windows/...`):
        windows closed short and filled, examples per step and skipped, the
        patience, and each replica's time waiting (all since the fit began
        or the statistics were reset)."""
        if windows is None:
            return
        import tensorflow as tf

        if self._window_writer is None:
            self._window_writer = tf.summary.create_file_writer(self.run_dir)
        figures = {
            "windows/closed_short": windows.closed_short,
            "windows/filled": windows.fills,
            "windows/examples_per_step": windows.examples_per_step,
            "windows/examples_skipped": windows.skipped,
        }
        if windows.patience is not None:
            figures["windows/patience_ms"] = windows.patience * 1e3
        for replica, seconds in enumerate(windows.seconds_waiting):
            figures[f"windows/seconds_waiting/replica_{replica}"] = float(seconds)
        with self._window_writer.as_default():
            for tag, value in figures.items():
                tf.summary.scalar(tag, float(value), step=epoch)
        self._window_writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        if self._every is None or self._writer is None:
            return
        # Keras numbers the batches of an epoch from 0, and with
        # `steps_per_execution` calls this at the last batch of each call
        # (a count that the epoch's end corrects from the graph's own).
        self._batches = self._epoch_start_batch + batch + 1
        # Reads are asked for often enough that the ring of snapshots never
        # laps the reader, and at least every second.
        due = self._batches - self._read_batch >= self._read_every()
        if due or time.monotonic() - self._read_time >= 1.0:
            self._raise_point_error()
            self._read_batch, self._read_time = self._batches, time.monotonic()
            self._points.submit(self._write_snapshots, self._strategy())

    def _count_batches(self) -> None:
        """The batches seen, from the graph's own count of its steps (Keras'
        batch numbers run past an epoch's end with `steps_per_execution`)."""
        self._batches = self._fit_start_batch + self._ring_index - self._ring_start

    def _read_every(self) -> int:
        return max(1, self._strategy().extended.runtime.snapshots.capacity // 4)

    def _due(self, step: int) -> bool:
        """Whether batch `step` (counted since the first training) has a point."""
        return (step - self._fit_start_batch) % self._every == 0

    @property
    def point_cpu_seconds(self) -> tuple[float, ...]:
        """CPU seconds of each batch-level point of the latest `fit`.

        Measured where the points are written, from reading the snapshots
        to writing the events, a bulk read shared by the points it brought:
        what `max_overhead` budgets. The points of the epochs' last batches,
        written from the counters after the epoch's updates have landed, are
        not among them.
        """
        return tuple(self._point_cpu)

    def _training_seconds(self) -> float:
        return time.perf_counter() - self._train_start - self._validation

    def _over_budget(self) -> bool:
        if self.max_overhead is None:
            return False
        return self._spent > self.max_overhead * self._training_seconds()

    def _log_coarsening(self, reason: str, advice: str) -> None:
        if self._coarsened:
            return
        self._coarsened = True
        points = self._point_cpu
        per_point = f"{1000 * sum(points) / len(points):.3f} ms" if points else "unmeasured"
        batches = max(self._batches - self._fit_start_batch, 1)
        _logger.warning(
            "StalenessTensorBoard(update_freq=%r): %s, so some points now cover more "
            "batches (CPU per point: %s; time per batch: %.2f ms). %s (Logged once.)",
            self.update_freq,
            reason,
            per_point,
            1000 * self._training_seconds() / batches,
            advice,
        )

    # -- validation inside fit: not training time -------------------------

    def on_test_begin(self, logs=None):
        if self._training:
            self._wait_for_points()  # so that only this thread keeps the clock now
            self._test_start = time.perf_counter()
            self._test_wall = time.time()

    def on_test_end(self, logs=None):
        if self._training and self._test_start is not None:
            self._validation += time.perf_counter() - self._test_start
            self._pauses.append((self._test_wall, time.time()))
            self._test_start = None

    # -- writing ----------------------------------------------------------

    def _write_snapshots(self, strategy: Strategy) -> None:
        """Writes the points of the snapshots Keras' graph has taken since the
        last read (in the callback's thread, or at an epoch's end)."""
        try:
            cpu = time.thread_time()
            read = strategy.extended.runtime.snapshots.read(self._ring_index)
            self._ring_index = read.next_index
            self._replica_states = strategy.replica_states()
            if read.lost:
                self._log_coarsening(
                    f"{read.lost} snapshot(s) of the counters were overwritten before "
                    "the callback's thread read them",
                    "The host was too busy to run that thread.",
                )
            # The ring takes a snapshot at each step while this reads it.
            steps = self._fit_start_batch + read.indices - self._ring_start + 1
            due = [
                k
                for k in range(len(read))
                # An epoch's last is written at its end, once its updates
                # landed; a snapshot sampled when read has its point wherever.
                if (read.sampled or self._due(int(steps[k])))
                and not self._epoch_last(int(steps[k]))
            ]
            shared = time.thread_time() - cpu  # counted with the points it brought
            before = len(self._point_cpu)
            while due:
                if self._over_budget():
                    self._log_coarsening(
                        f"a point every {self._every} batch(es) would cost more than "
                        f"max_overhead={self.max_overhead:g} of the training time",
                        "Pass a larger max_overhead, or max_overhead=None for every "
                        "point whatever it costs.",
                    )
                    break  # their batches count in the next point
                # Points go in chunks, the fit's first alone (its cost is not
                # known yet): the budget is checked between chunks.
                size = len(due) if self.max_overhead is None else 1 if not self._point_cpu else 64
                chunk, due = due[:size], due[size:]
                start = time.thread_time()
                self._write_many(read, chunk, steps)
                cost = time.thread_time() - start
                self._spent += cost
                self._point_cpu += [cost / len(chunk)] * len(chunk)
            self._spent += shared
            new = len(self._point_cpu) - before
            for n in range(before, len(self._point_cpu)):
                self._point_cpu[n] += shared / new
        except BaseException as error:  # raised in the training thread, next batch
            self._point_error = self._point_error or error

    def _write_many(self, read, keep: list[int], steps: np.ndarray) -> None:
        """Writes the points of snapshots `keep` of `read`, in one go."""
        before = self._snapshot
        intervals = differences(read.stats(keep, before), before)
        seconds, lost = [], []
        for at in read.times[keep].tolist():
            seconds.append(self._seconds_to(at))
            self._startinterval(at)
            lost.append(self._lost_at(at))
        self._writer.write_many(
            [int(steps[k]) for k in keep],
            intervals,
            read.versions[keep],
            np.array(seconds),
            lost,
            None if read.optimizer_steps is None else read.optimizer_steps[keep],
        )
        last = keep[-1]
        self._snapshot = read.stats(last, before)
        self._last_point = int(steps[last])

    def _lost_at(self, at: float) -> np.ndarray | None:
        """Per replica, whether it was lost at time `at` or since the
        previous point; None until a replica has been lost.

        From the replicas' states when the points are written (at most a
        second after a batch-level point's batch): a replica that is lost,
        or rejoining, since a time before `at`, or that has been lost more
        often than at the previous point.
        """
        reports = self._replica_states
        if self._lost_counts is None and not any(report.lost for report in reports):
            return None  # no replica was ever lost: the common case, cheaply
        counts = np.array([report.lost for report in reports], np.int64)
        if self._lost_counts is None or len(self._lost_counts) != len(counts):
            self._lost_counts = np.zeros_like(counts)
        if not counts.any():
            return None
        lost = np.array(
            [
                report.state in ("lost", "rejoining")
                and (report.since is None or report.since <= at)
                for report in reports
            ]
        )
        lost |= counts > self._lost_counts
        self._lost_counts = counts
        return lost

    def _epoch_last(self, step: int) -> bool:
        """Whether `step` is the last batch of an epoch of this fit."""
        steps = self._steps_per_epoch
        return steps is not None and (step - self._fit_start_batch) % steps == 0

    def _raise_point_error(self) -> None:
        if self._point_error is not None:
            error, self._point_error = self._point_error, None
            self._close()  # the fit fails here: keep what was written
            raise error

    def _wait_for_points(self) -> None:
        """Waits for the points the thread has still to write, and raises
        the error that writing one met, if any."""
        self._points.wait()
        self._raise_point_error()

    def _startinterval(self, at: float | None = None) -> None:
        """A new interval begins at wall-clock time `at` (now by default);
        validation runs that ended before it no longer count."""
        self._interval_start = time.time() if at is None else at
        self._pauses = [p for p in self._pauses if p[1] > self._interval_start]

    def _seconds_to(self, at: float) -> float:
        """Training seconds from the current interval's start to `at`."""
        paused = sum(
            max(0.0, min(end, at) - max(start, self._interval_start)) for start, end in self._pauses
        )
        return max(at - self._interval_start - paused, 0.0)

    def _write(self, step: int, now: StalenessStats) -> None:
        """Writes the point of the interval from the previous one to `now`,
        counters read just now."""
        at = time.time()
        self._replica_states = self._strategy().replica_states()
        seconds = self._seconds_to(at)
        self._writer.write(
            step,
            difference(now, self._snapshot),
            now.version,
            seconds,
            self._lost_at(at),
            now.steps,
        )
        self._snapshot = now
        self._last_point = step
        self._startinterval(at)
