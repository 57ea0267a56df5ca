"""`tf_diffmap.StalenessTensorBoard`: what it writes, read back from the event files."""

import os
import re
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.store.intervals import difference
from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.tensorboard_plugin import metadata
from tf_diffmap.tensorboard_plugin.figures import interval_figures
from tf_diffmap.tensorboard_plugin.summary import StalenessSummaryWriter

REPLICAS = 4


def read_run(run_dir) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Every tensor series of a run: tag -> [(step, value)], in file order."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {
        tag: [
            (event.step, tf.make_ndarray(event.tensor_proto)) for event in accumulator.Tensors(tag)
        ]
        for tag in accumulator.Tags()["tensors"]
    }


def steps_of(series, tag):
    return [step for step, _ in series[tag]]


def values_of(series, tag):
    return np.array([value for _, value in series[tag]])


def value_at(series, tag, step):
    (value,) = [value for s, value in series[tag] if s == step]
    return float(value)


class Recorder(keras.callbacks.Callback):
    """Keeps the strategy's own statistics at each epoch's end (after ours)."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.snapshots = []

    def on_train_begin(self, logs=None):
        self.snapshots.append(self.strategy.statistics())

    def on_epoch_end(self, epoch, logs=None):
        self.snapshots.append(self.strategy.statistics())


def slowed_model(optimizer=None, seconds=0.004):
    """An MLP whose replica 0 sleeps in each step, so that staleness varies."""
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(seconds, replicas=[0]),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, optimizer or keras.optimizers.Adam(3e-3))
    return strategy, model


def test_epoch_points_are_the_strategys_own_statistics(tmp_path):
    x, y = classification_data(n=640)
    strategy, model = slowed_model()
    recorder = Recorder(strategy)
    epochs = 3
    # Keras' TensorBoard beside it, in the same directory, with an integer
    # update_freq that does not divide the 8 steps per epoch
    # (tensorflow/tensorboard#4975): no staleness point may be lost.
    callbacks = [
        keras.callbacks.TensorBoard(str(tmp_path), update_freq=3),
        tf_diffmap.StalenessTensorBoard(tmp_path),
        recorder,
    ]
    model.fit(
        x, y, batch_size=64, epochs=epochs, validation_split=0.2, verbose=0, callbacks=callbacks
    )

    series = read_run(tmp_path / metadata.RUN_NAME)
    # Keras' recording condition was in force (it records every 3rd batch;
    # in Keras 3.15 it even drops its own epoch summaries of epochs 0 and 1),
    # yet every epoch has its staleness point.
    assert steps_of(read_run(tmp_path / "train"), "batch_loss") == list(range(3, 25, 3))
    assert steps_of(series, metadata.VERSION) == list(range(epochs))
    # No AsyncOptimizer rule: no learning-rate factor. The default's bound on
    # the staleness in steps may drop a gradient (on a busy host it does, now
    # and then), and its drops are written per point like a rule's.
    assert not any(tag.startswith(metadata.LR_SCALE) for tag in series)
    assert strategy.max_step_staleness is not None

    snapshots = recorder.snapshots
    for epoch in range(epochs):
        now, interval = snapshots[epoch + 1], snapshots[epoch + 1].since(snapshots[epoch])
        assert interval.histogram[:, -1].sum() == 0
        assert series[metadata.VERSION][epoch][1] == now.version
        for r in range(REPLICAS):

            def value(name, r=r, epoch=epoch):
                return float(series[metadata.tag(name, r)][epoch][1])

            assert value(metadata.UPDATES) == interval.updates[r]
            assert value(metadata.DROPPED) == interval.dropped[r]
            # A point's mean is over the updates computed, applied or
            # dropped (its histogram); with none dropped, the applied ones'.
            mean = histogram_mean(interval.histogram[r])
            assert value(metadata.MEAN) == pytest.approx(mean, rel=1e-6)
            if interval.dropped[r] == 0:
                assert mean == pytest.approx(interval.mean_staleness[r], rel=1e-6)
            assert value(metadata.MAX) == interval.interval_max_staleness[r]
            assert value(metadata.SHARE) == pytest.approx(interval.work_share[r], rel=1e-6)
            buckets = series[metadata.tag(metadata.DISTRIBUTION, r)][epoch][1]
            counts = np.zeros(interval.histogram.shape[1])
            counts[: len(buckets)] = buckets[:, 2]
            np.testing.assert_array_equal(counts, interval.histogram[r])
            np.testing.assert_array_equal(buckets[:, 0] + 0.5, np.arange(len(buckets)))
        everyone = interval.updates.sum()
        assert float(series[metadata.tag(metadata.UPDATES, None)][epoch][1]) == everyone
        mean = histogram_mean(interval.histogram.sum(0))
        assert float(series[metadata.tag(metadata.MEAN, None)][epoch][1]) == pytest.approx(
            mean, rel=1e-6
        )
        if interval.dropped.sum() == 0:
            assert mean == pytest.approx(interval.overall_mean_staleness, rel=1e-6)
        rates = np.array(
            [
                float(series[metadata.tag(metadata.EXAMPLES_PER_SECOND, r)][epoch][1])
                for r in range(4)
            ]
        )
        assert (rates > 0).all()
        np.testing.assert_allclose(
            rates / rates.sum(), interval.examples / interval.examples.sum(), rtol=1e-5
        )

    # The totals of the last point are the whole run's.
    totals = series[metadata.TOTALS][-1][1]
    run = snapshots[-1].since(snapshots[0])
    np.testing.assert_array_equal(totals[:, 0], run.updates)
    np.testing.assert_array_equal(totals[:, 1], run.dropped)
    np.testing.assert_array_equal(totals[:, 2], run.examples)
    np.testing.assert_array_equal(totals[:, 3], run.staleness_sum)
    largest = [values_of(series, metadata.tag(metadata.MAX, r)).max() for r in range(REPLICAS)]
    np.testing.assert_array_equal(totals[:, 4], largest)
    check_steps_against_statistics(series, snapshots, strategy.statistics())
    check_layout_and_run_info(tmp_path / metadata.RUN_NAME, series)


def histogram_mean(counts):
    """The mean staleness of a histogram's updates (0 if none): the last bin
    is empty in these runs, so the mean is exact."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    return float((np.arange(len(counts)) * counts).sum() / total) if total else 0.0


def histogram_of(series, tag, k, bins):
    """Point k's counts of staleness 0, 1, ... of a distribution series."""
    buckets = series[tag][k][1]
    np.testing.assert_array_equal(buckets[:, 0] + 0.5, np.arange(len(buckets)))
    counts = np.zeros(bins)
    counts[: len(buckets)] = buckets[:, 2]
    return counts


def check_steps_against_statistics(series, snapshots, final):
    """The staleness in optimizer steps of epoch points: each point the
    strategy's own figures of its epoch, and the last the whole run's."""
    assert final.aggregated, "4 replicas aggregate 4 gradients to a step by default"
    bins = final.step_histogram.shape[1]
    for epoch in range(len(snapshots) - 1):
        now, interval = snapshots[epoch + 1], snapshots[epoch + 1].since(snapshots[epoch])
        assert interval.step_histogram[:, -1].sum() == 0
        assert value_at(series, metadata.OPTIMIZER_STEPS, epoch) == now.steps
        # An epoch ends with a drain that applies its last, partial window.
        assert value_at(series, metadata.GRADIENTS_PER_STEP, epoch) == pytest.approx(
            interval.gradients_per_step, rel=1e-6
        )
        for r in [*range(REPLICAS), None]:
            tag = metadata.tag
            if r is None:
                applied, counts = (
                    interval.overall_mean_step_staleness,
                    interval.step_histogram.sum(0),
                )
                dropped = interval.dropped.sum()
            else:
                applied, counts = interval.mean_step_staleness[r], interval.step_histogram[r]
                dropped = interval.dropped[r]
            mean = histogram_mean(counts)
            assert value_at(series, tag(metadata.STEP_MEAN, r), epoch) == pytest.approx(mean)
            if dropped == 0:
                assert mean == pytest.approx(applied)
            assert value_at(series, tag(metadata.STEP_MAX, r), epoch) == np.flatnonzero(counts)[-1]
            np.testing.assert_array_equal(
                histogram_of(series, tag(metadata.STEP_DISTRIBUTION, r), epoch, bins), counts
            )
    # The running step totals at the last point: the strategy's at the end.
    run = snapshots[-1].since(snapshots[0])
    step_totals = series[metadata.STEP_TOTALS][-1][1]
    np.testing.assert_array_equal(step_totals[:, 0], run.step_staleness_sum)
    # The largest is the STEP_MAX series' (applied or dropped updates); with
    # none dropped, the largest of the applied ones.
    largest = [values_of(series, metadata.tag(metadata.STEP_MAX, r)).max() for r in range(REPLICAS)]
    np.testing.assert_array_equal(step_totals[:, 1], largest)
    if run.dropped.sum() == 0:
        np.testing.assert_array_equal(step_totals[:, 1], final.step_staleness_max)
    assert step_totals[:, 0].sum() / run.updates.sum() == pytest.approx(
        final.overall_mean_step_staleness
    )
    assert values_of(series, metadata.OPTIMIZER_STEPS)[-1] == final.steps


def check_layout_and_run_info(run_dir, series):
    """The custom-scalars layout matches the tags written; the run is described."""
    (layout_tensor,) = values_of(series, custom_scalar_metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout.FromString(layout_tensor.item())
    assert [c.title for c in layout.category] == [metadata.LAYOUT_CATEGORY]
    charts = {c.title: c.multiline.tag[0] for c in layout.category[0].chart}
    mean_chart = next(
        regex for title, regex in charts.items() if title.startswith("Mean staleness")
    )
    mean_tags = sorted(t for t in series if re.search(mean_chart, t))
    assert mean_tags == sorted(
        [metadata.tag(metadata.MEAN, r) for r in range(REPLICAS)]
        + [metadata.tag(metadata.MEAN, None)]
    )
    for regex in charts.values():
        assert any(re.search(regex, t) for t in series), regex
    assert any("optimizer steps" in title for title in charts)
    # The dashboard's own data: running totals, with the run described.
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    totals_metadata = accumulator.SummaryMetadata(metadata.TOTALS)
    assert totals_metadata.plugin_data.plugin_name == metadata.PLUGIN_NAME
    assert totals_metadata.data_class == summary_pb2.DATA_CLASS_TENSOR
    info = metadata.RunInfo.from_bytes(totals_metadata.plugin_data.content)
    assert info.num_replicas == REPLICAS and info.step_unit == "epoch" and info.rule is None
    assert len(info.devices) == REPLICAS and info.gradients_per_step == REPLICAS


@pytest.mark.parametrize("update_freq, max_overhead", [(2, None), ("batch", None), ("batch", 1e-6)])
def test_batch_points_add_up_beside_keras_tensorboard(tmp_path, caplog, update_freq, max_overhead):
    x, y = classification_data(n=7 * 64)  # 7 steps per epoch: not a multiple of 2 or 3
    strategy, model = slowed_model()
    callback = tf_diffmap.StalenessTensorBoard(
        tmp_path, update_freq=update_freq, max_overhead=max_overhead
    )
    drains = []
    in_batch_hook = []
    pool = strategy.extended.runtime
    original_drain = pool.drain

    def counting_drain(*args, **kwargs):
        if in_batch_hook:
            drains.append(1)
        return original_drain(*args, **kwargs)

    pool.drain = counting_drain
    original_hook = callback.on_train_batch_end

    def batch_hook(batch, logs=None):
        in_batch_hook.append(1)
        try:
            original_hook(batch, logs)
        finally:
            in_batch_hook.pop()

    callback.on_train_batch_end = batch_hook
    before = strategy.statistics()
    model.fit(
        x,
        y,
        batch_size=64,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path), update_freq=3), callback],
    )
    after = strategy.statistics()

    every = 1 if update_freq == "batch" else update_freq
    expected_steps = list(range(every, 14 + 1, every))
    series = read_run(tmp_path / metadata.RUN_NAME)
    if max_overhead is not None:
        # With a budget of a millionth, a point's cost rules out the next for
        # minutes: after the first, only the epochs' last batches have theirs
        # (they are always written), and the batches between count in them.
        expected_steps = [1, 7, 14]
    for tag in (metadata.VERSION, metadata.tag(metadata.UPDATES, None), metadata.TOTALS):
        assert steps_of(series, tag) == expected_steps, tag
    for r in range(REPLICAS):
        # Every update lands in exactly one point.
        assert values_of(series, metadata.tag(metadata.UPDATES, r)).sum() == (
            after.updates[r] - before.updates[r]
        )
    assert series[metadata.VERSION][-1][1] == after.version
    np.testing.assert_array_equal(
        series[metadata.TOTALS][-1][1][:, 0], after.updates - before.updates
    )
    check_batch_steps(series, expected_steps, before, after)
    assert not drains, "a batch-level point waited for the replicas"
    # The thread took every point but the epochs' last (written at the epochs' ends).
    thread_points = [step for step in expected_steps if step % 7]
    assert len(callback.point_cpu_seconds) == len(thread_points)
    assert all(seconds > 0 for seconds in callback.point_cpu_seconds)
    coarsened = [r for r in caplog.records if "max_overhead" in r.getMessage()]
    if max_overhead is None:
        assert not coarsened
    else:
        # Logged once, when the budget first made a point cover more batches.
        assert len(coarsened) == 1 and coarsened[0].levelname == "WARNING"
        assert coarsened[0].name == "tf_diffmap"
    # Keras' own batch summaries were written too (its record_if was active).
    assert steps_of(read_run(tmp_path / "train"), "batch_loss") == [3, 6, 9, 12]

    # Another fit with the same callback goes on counting batches and totals;
    # its last batches, short of N, get a point at the end of training.
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[callback])
    series = read_run(tmp_path / metadata.RUN_NAME)
    more = list(range(14 + every, 21 + 1, every)) + ([21] if 21 % every else [])
    if max_overhead is not None:
        more = [15, 21]
    assert steps_of(series, metadata.VERSION) == expected_steps + more
    final = strategy.statistics()
    np.testing.assert_array_equal(
        series[metadata.TOTALS][-1][1][:, 0], final.updates - before.updates
    )


def check_batch_steps(series, steps, before, after):
    """Batch-level points in optimizer steps: every point has them, from the
    ring of snapshots, and they add up to the strategy's counts."""
    assert before.steps is None, "nothing was traced yet: no step counted"
    for tag in (metadata.OPTIMIZER_STEPS, metadata.STEP_TOTALS):
        assert steps_of(series, tag) == steps, tag
    optimizer_steps = values_of(series, metadata.OPTIMIZER_STEPS)
    assert (np.diff(optimizer_steps) >= 0).all() and optimizer_steps[-1] == after.steps
    bins = after.step_histogram.shape[1]
    for r in range(REPLICAS):
        tag = metadata.tag(metadata.STEP_DISTRIBUTION, r)
        counts = sum(histogram_of(series, tag, k, bins) for k in range(len(series[tag])))
        np.testing.assert_array_equal(counts, after.step_histogram[r] - before.step_histogram[r])
    np.testing.assert_array_equal(
        series[metadata.STEP_TOTALS][-1][1][:, 0],
        after.step_staleness_sum - before.step_staleness_sum,
    )


def test_every_batch_has_its_point_with_steps_per_execution(tmp_path):
    # Keras calls batch hooks once per call of its graph, here every 3
    # batches; the graph's own snapshots still give every batch its point.
    x, y = classification_data(n=7 * 64)
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(0.05), steps_per_execution=3)
    hooks = []

    class Hooks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            hooks.append(batch)

    every, every_other = (
        tf_diffmap.StalenessTensorBoard(tmp_path / "every", "batch", max_overhead=None),
        tf_diffmap.StalenessTensorBoard(tmp_path / "two", 2, max_overhead=None),
    )
    before = strategy.statistics()
    model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[every, every_other, Hooks()])
    after = strategy.statistics()
    assert len(hooks) < 14, "Keras should call the batch hooks once per call of its graph"
    for callback, steps in ((every, list(range(1, 15))), (every_other, [2, 4, 6, 8, 10, 12, 14])):
        series = read_run(callback.run_dir)
        assert steps_of(series, metadata.VERSION) == steps
        for r in range(REPLICAS):
            assert values_of(series, metadata.tag(metadata.UPDATES, r)).sum() == (
                after.updates[r] - before.updates[r]
            )
        assert series[metadata.VERSION][-1][1] == after.version
        # Each point's version is the store's at its batch: never behind the previous.
        assert (np.diff(values_of(series, metadata.VERSION)) >= 0).all()
    # With both callbacks done, the graph takes no more snapshots.
    assert not strategy.extended.runtime.snapshots.on.numpy()


def test_lost_replicas_are_marked_from_the_first_loss(tmp_path):
    # Replica 1's worker is "lost" during epoch 1 and back in epoch 2: the
    # strategy's own record of it, as the replicas' record on a cluster keeps it.
    from tf_diffmap.engine.replicas import ReplicaReport

    x, y = classification_data(n=256)
    strategy, model = slowed_model(seconds=0.0)
    states = {"state": "running", "since": None, "lost": 0}

    def replica_states():
        return [
            ReplicaReport(r, d, **(states if r == 1 else {"state": "running"}))
            for r, d in enumerate(strategy.replica_devices)
        ]

    strategy.replica_states = replica_states

    class Faults(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                states.update(state="lost", since=time.time(), lost=1)
            elif epoch == 2:
                states.update(state="running", since=time.time())

    model.fit(
        x,
        y,
        batch_size=64,
        epochs=3,
        verbose=0,
        callbacks=[Faults(), tf_diffmap.StalenessTensorBoard(tmp_path)],
    )
    series = read_run(tmp_path / metadata.RUN_NAME)
    # Nothing before the first loss; then 1 while lost, 0 once back.
    assert steps_of(series, metadata.tag(metadata.LOST, 1)) == [1, 2]
    assert values_of(series, metadata.tag(metadata.LOST, 1)).tolist() == [1.0, 0.0]
    assert values_of(series, metadata.tag(metadata.LOST, 0)).tolist() == [0.0, 0.0]
    assert values_of(series, metadata.tag(metadata.LOST, None)).tolist() == [1.0, 0.0]


def test_rule_series_follow_the_async_optimizer(tmp_path):
    x, y = classification_data(n=512)
    # A learning-rate rule applies where every shard's gradient is a step.
    strategy = tf_diffmap.Strategy(gradients_per_step=1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(0.01, replicas=[0]),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(
            model,
            tf_diffmap.AsyncOptimizer(
                keras.optimizers.SGD(0.05), staleness="inverse", drop_above=1
            ),
        )
    recorder = Recorder(strategy)
    model.fit(
        x,
        y,
        batch_size=64,
        epochs=2,
        verbose=0,
        callbacks=[tf_diffmap.StalenessTensorBoard(tmp_path), recorder],
    )
    series = read_run(tmp_path / metadata.RUN_NAME)
    run = recorder.snapshots[-1].since(recorder.snapshots[0])
    assert run.dropped.sum() > 0, "the slowed replica should have had stale updates to drop"
    second_epoch = recorder.snapshots[2].since(recorder.snapshots[1])
    for r in range(REPLICAS):
        assert values_of(series, metadata.tag(metadata.DROPPED, r)).sum() == run.dropped[r]
        if second_epoch.updates[r]:
            assert value_at(series, metadata.tag(metadata.LR_SCALE, r), 1) == pytest.approx(
                second_epoch.mean_lr_scale[r], rel=1e-6
            )
    layout = layout_pb2.Layout.FromString(
        series[custom_scalar_metadata.CONFIG_SUMMARY_TAG][0][1].item()
    )
    titles = [chart.title for chart in layout.category[0].chart]
    assert any("Dropped" in t for t in titles) and any("learning-rate" in t for t in titles)
    # Every update a step of its own: the staleness in versions says it all.
    assert not recorder.snapshots[-1].aggregated
    assert not [t for t in series if "steps" in t or t == metadata.GRADIENTS_PER_STEP]
    assert not any("optimizer steps" in t for t in titles)


def test_a_failed_point_stops_the_fit_and_leaves_no_thread(tmp_path):
    x, y = classification_data(n=256)
    strategy, model = slowed_model(seconds=0.0)

    class Failing(tf_diffmap.StalenessTensorBoard):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)

            def write(*args, **kwargs):
                raise OSError("No space left on device")

            self._writer.write = write

    with pytest.raises(OSError, match="No space left"):
        model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[Failing(tmp_path, "batch")])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        t.name == "tf_diffmap-staleness-points" for t in threading.enumerate()
    ):
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "tf_diffmap-staleness-points"]


def test_refuses_a_model_not_trained_by_tf_diffmap(tmp_path):
    x, y = classification_data(n=64)
    model = mlp()
    compile_logits(model)
    with pytest.raises(ValueError, match=r"tf_diffmap\.Strategy\(\)\.scope\(\)"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[tf_diffmap.StalenessTensorBoard(tmp_path)])


@pytest.mark.parametrize("update_freq", ["sometimes", 0, -2, True, 1.5])
def test_refuses_a_bad_update_freq(update_freq):
    with pytest.raises(ValueError, match="update_freq"):
        tf_diffmap.StalenessTensorBoard("logs", update_freq=update_freq)


@pytest.mark.parametrize("max_overhead", [0, -0.1, 1.5])
def test_refuses_a_bad_max_overhead(max_overhead):
    with pytest.raises(ValueError, match="max_overhead"):
        tf_diffmap.StalenessTensorBoard("logs", update_freq="batch", max_overhead=max_overhead)


def stats(
    histogram,
    updates=None,
    dropped=None,
    lr_scale_sum=None,
    examples=None,
    version=0,
    step_histogram=None,
    steps=None,
):
    histogram = np.array(histogram, np.int64)
    n = histogram.shape[0]
    updates = np.array(updates if updates is not None else histogram.sum(axis=1))
    in_steps = {}
    if step_histogram is not None:
        step_histogram = np.array(step_histogram, np.int64)
        in_steps = dict(
            steps=steps,
            step_histogram=step_histogram,
            step_staleness_sum=(step_histogram * np.arange(step_histogram.shape[1])).sum(axis=1),
            step_staleness_max=np.zeros(n, np.int64),
        )
    return StalenessStats(
        version=version,
        updates=updates,
        dropped=np.array(dropped if dropped is not None else [0] * n),
        staleness_sum=(histogram * np.arange(histogram.shape[1])).sum(axis=1),
        staleness_max=np.zeros(n, np.int64),
        histogram=histogram,
        lr_scale_sum=None if lr_scale_sum is None else np.array(lr_scale_sum, np.float64),
        examples=None if examples is None else np.array(examples),
        **in_steps,
    )


def test_interval_figures_by_hand():
    interval = stats(
        [[2, 1, 0, 0, 0], [0, 0, 3, 0, 0], [0, 0, 0, 0, 0]],
        lr_scale_sum=[2.5, 1.0, 0.0],
        examples=[30, 30, 0],
    )
    figures = interval_figures(interval, version=17, seconds=2.0)
    np.testing.assert_array_equal(figures.updates, [3, 3, 0, 6])
    np.testing.assert_allclose(figures.mean, [1 / 3, 2, 0, 7 / 6])
    np.testing.assert_array_equal(figures.max, [1, 2, 0, 2])
    np.testing.assert_array_equal(figures.histogram, [[2, 1, 0], [0, 0, 3], [0, 0, 0], [2, 1, 3]])
    np.testing.assert_allclose(figures.share, [0.5, 0.5, 0])
    np.testing.assert_allclose(figures.examples_per_second, [15, 15, 0, 30])
    np.testing.assert_allclose(figures.lr_scale, [2.5 / 3, 1 / 3, 0, 3.5 / 6])
    # A replica's work counts the updates a rule dropped; its mean staleness too.
    dropping = interval_figures(
        stats([[1, 1], [2, 0]], updates=[1, 2], dropped=[1, 0]), version=4, seconds=1.0
    )
    np.testing.assert_allclose(dropping.share, [0.5, 0.5])
    np.testing.assert_allclose(dropping.mean, [0.5, 0, 0.25])
    np.testing.assert_array_equal(dropping.dropped, [1, 0, 1])
    # Without examples or time there is no rate; without a rule every factor is 1.
    plain = interval_figures(stats([[1, 1]]), version=2, seconds=0.0)
    assert plain.examples_per_second is None
    np.testing.assert_allclose(plain.lr_scale, [1, 1])
    assert plain.step_mean is None and plain.optimizer_steps is None
    assert plain.gradients_per_step is None


def test_interval_figures_in_optimizer_steps_by_hand():
    # Six gradients in versions 0-3, aggregated into 2 steps: in steps,
    # replica 1's gradients were all a step late.
    interval = stats(
        [[2, 1, 0, 0], [0, 0, 3, 0]], step_histogram=[[3, 0, 0, 0], [0, 3, 0, 0]], steps=2
    )
    figures = interval_figures(interval, version=6, seconds=1.0, optimizer_steps=9)
    np.testing.assert_allclose(figures.step_mean, [0, 1, 0.5])
    np.testing.assert_array_equal(figures.step_max, [0, 1, 1])
    np.testing.assert_array_equal(figures.step_histogram, [[3, 0], [0, 3], [3, 3]])
    np.testing.assert_allclose(figures.mean, [1 / 3, 2, 7 / 6])  # versions: as ever
    assert figures.optimizer_steps == 9 and figures.gradients_per_step == 3.0
    # An interval that applied no step has no figure of gradients per step.
    idle = interval_figures(
        stats([[1, 0]], step_histogram=[[1, 0]], steps=0), version=7, seconds=1.0
    )
    assert idle.gradients_per_step is None and idle.step_mean.tolist() == [0, 0]


def test_points_written_together_are_the_points_written_one_by_one(tmp_path):
    """`write_many` (the callback's thread) writes what `write` would, point
    by point: running totals, a replica with no update, no time, losses."""
    from tensorboard.backend.event_processing import event_file_loader

    info = metadata.RunInfo(2, ("CPU:0", "CPU:1"), 4, "batch", rule="inverse")
    # In optimizer steps: no step at point 2; replica 0's update of point 3 a step late.
    in_steps = [
        {"step_histogram": [[3, 0, 0, 0], [0, 0, 0, 0]], "steps": 1},
        {"step_histogram": [[1, 0, 0, 0], [2, 0, 0, 0]], "steps": 0},
        {"step_histogram": [[3, 1, 0, 0], [2, 0, 0, 0]], "steps": 2},
    ]
    versions = [
        (([[1, 2, 0, 0], [0, 0, 0, 0]], [3, 0], [0, 0], [2.0, 0.0], [24, 0]), 0.5, None),
        (([[0, 0, 0, 1], [2, 0, 0, 0]], [0, 2], [1, 0], [0.0, 2.0], [8, 16]), 0.0, None),
        (([[4, 0, 0, 0], [0, 1, 1, 0]], [4, 2], [0, 0], [4.0, 1.5], [32, 16]), 0.25, [1, 0]),
    ]
    points = [
        (stats(*counts, **steps), seconds, lost)
        for (counts, seconds, lost), steps in zip(versions, in_steps, strict=True)
    ]
    one_by_one = StalenessSummaryWriter(tmp_path / "one", info, rules=True)
    for step, (interval, seconds, lost) in enumerate(points, start=1):
        lost = None if lost is None else np.array(lost, bool)
        one_by_one.write(
            step, interval, version=10 * step, seconds=seconds, lost=lost, optimizer_steps=step
        )
    together = StalenessSummaryWriter(tmp_path / "many", info, rules=True)
    together.write_many(
        [1, 2, 3],
        StalenessStats(
            version=0,
            staleness_max=points[0][0].staleness_max,
            **{
                name: np.stack([getattr(p[0], name) for p in points])
                for name in ("updates", "dropped", "staleness_sum", "histogram")
                + ("lr_scale_sum", "examples", "steps", "step_staleness_sum", "step_histogram")
            },
        ),
        np.array([10, 20, 30]),
        np.array([p[1] for p in points]),
        [None if p[2] is None else np.array(p[2], bool) for p in points],
        optimizer_steps=np.array([1, 2, 3]),
    )
    for writer in (one_by_one, together):
        writer.close()
    np.testing.assert_array_equal(together.totals, one_by_one.totals)
    np.testing.assert_array_equal(together.step_totals, [[1, 1], [0, 0]])
    np.testing.assert_array_equal(together.step_totals, one_by_one.step_totals)
    events = [
        [
            (event.step, event.summary)
            for event in event_file_loader.EventFileLoader(writer.path).Load()
            if event.HasField("summary")
        ]
        for writer in (one_by_one, together)
    ]
    assert len(events[0]) == 3 and events[0] == events[1]
    tags = [{value.tag for value in summary.value} for _, summary in events[0]]
    # Replica 1 had no update at step 1, step 2 took no time, step 3 lost one.
    mean, rate, lost = (metadata.MEAN, metadata.EXAMPLES_PER_SECOND, metadata.LOST)
    assert metadata.tag(mean, 0) in tags[0] and metadata.tag(mean, 1) not in tags[0]
    assert metadata.tag(rate, 0) in tags[0] and metadata.tag(rate, 0) not in tags[1]
    assert metadata.tag(lost, 0) in tags[2] and metadata.tag(lost, 0) not in tags[1]
    np.testing.assert_array_equal(together.totals[:, 0], [7, 4])
    # In steps: where versions have a point, and no gradients per step without a step.
    step_mean, per_step = metadata.STEP_MEAN, metadata.GRADIENTS_PER_STEP
    assert metadata.tag(step_mean, 0) in tags[0] and metadata.tag(step_mean, 1) not in tags[0]
    assert per_step in tags[0] and per_step not in tags[1] and per_step in tags[2]
    assert all({metadata.OPTIMIZER_STEPS, metadata.STEP_TOTALS} <= t for t in tags)


def test_counters_that_went_back_start_a_new_count():
    before = stats([[4, 4]])
    after_reset = stats([[1, 0]])
    assert difference(after_reset, before).updates.tolist() == [1]
    assert difference(stats([[5, 6]]), before).updates.tolist() == [3]


def test_optimizer_steps_count_from_a_store_that_did_not_aggregate_yet():
    # Before the first trace the store counts no step (steps None): it had applied none.
    before = stats([[4, 4]])
    now = stats([[5, 6]], step_histogram=[[9, 2]], steps=7)
    interval = difference(now, before)
    assert interval.steps == 7 and interval.step_histogram is None
    # The statistics reset, the store's steps go on: an interval's steps stay a difference.
    later = difference(stats([[1, 0]], step_histogram=[[1, 0]], steps=9), now)
    assert later.updates.tolist() == [1] and later.steps == 2
    assert later.step_histogram.tolist() == [[1, 0]]


def test_a_recording_condition_left_off_cannot_drop_points(tmp_path):
    info = metadata.RunInfo(2, ("CPU:0", "CPU:1"), 8, "batch")
    other = tf.summary.create_file_writer(str(tmp_path / "other"))
    writer = StalenessSummaryWriter(tmp_path / "run", info, rules=False)
    # As Keras' TensorBoard leaves things between its recording steps.
    with other.as_default(step=5), tf.summary.record_if(lambda: False):
        for step in (1, 2):
            writer.write(
                step, stats([[1, 2], [3, 0]], examples=[3, 3]), version=step * 6, seconds=0.5
            )
    writer.close()
    series = read_run(tmp_path / "run")
    assert steps_of(series, metadata.VERSION) == [1, 2]
    assert os.listdir(tmp_path / "run")[0].startswith("events.out.tfevents.")
