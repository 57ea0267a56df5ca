"""Fresh windows: every step from gradients of the current parameters, replicas in step.

Under `Strategy(max_step_staleness=0)` window v takes only gradients whose
read saw v optimizer steps, a replica that pushed into an open window waits
for it to close before it reads again, and the window timer closes (or
fills) a window that waits past its patience on a slow replica.
"""

import threading
import time
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.engine.windows import WindowTimer
from tf_diffmap.store.gate import Gate

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
}


def _fit(strategy, optimizer_fn, x, y, weights, batch_size, epochs=1):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = mlp()
        model.set_weights(weights)
        compile_logits(model, optimizer_fn())
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_fresh_window_of_two_replicas_is_one_plain_keras_step(optimizer):
    """With 2 replicas and no straggler, one window is one step of plain
    Keras on the two shards together (an odd batch: shards of 5 and 4
    examples, weighted by their examples)."""
    x, y = classification_data(9, seed=11)
    weights = mlp().get_weights()
    plain = _fit(None, OPTIMIZERS[optimizer], x, y, weights, batch_size=9)
    # A patience no replica reaches: what is checked is the window, not the
    # timer (a shard of a few examples takes a fraction of a millisecond,
    # under a busy host's scheduling noise).
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0", "CPU:1"], max_step_staleness=0, patience_margin=1e4
    )
    ours = _fit(strategy, OPTIMIZERS[optimizer], x, y, weights, batch_size=9)
    # The window sums its shards in the order they arrive; Adam's first step
    # divides each coordinate by its own size, so the float32 rounding of a
    # coordinate near 0 moves its step by up to ~6e-6 (seen): under 0.1% of
    # one step of 1e-2.
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    windows = strategy.window_statistics()
    assert windows.windows == 1 == int(ours.optimizer.iterations.numpy())
    assert windows.examples == 9 and windows.closed_short == 0
    assert int(strategy.statistics().dropped.sum()) == 0


def test_replicas_in_step_train_as_plain_keras_over_many_steps():
    """With a patience no healthy replica reaches, every window holds one
    shard of every replica: 24 steps equal plain Keras' 24 steps on the
    same batches, momentum included, and nothing is dropped."""
    x, y = classification_data(256, seed=12)
    weights = mlp().get_weights()
    optimizer = OPTIMIZERS["sgd_momentum"]
    plain = _fit(None, optimizer, x, y, weights, batch_size=32, epochs=3)
    strategy = tf_diffmap.Strategy(max_step_staleness=0, patience_margin=1e4)
    ours = _fit(strategy, optimizer, x, y, weights, batch_size=32, epochs=3)
    stats = strategy.statistics()
    windows = strategy.window_statistics()
    assert windows.windows == 24 == stats.steps == int(ours.optimizer.iterations.numpy())
    assert windows.closed_short == 0 and windows.examples_per_step == 32
    assert int(stats.dropped.sum()) == 0 and stats.overall_max_step_staleness == 0
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _straggler_fit(late_window, seconds=0.3, epochs=2, late_shards="skip"):
    x, y = classification_data(256, seed=13)
    strategy = tf_diffmap.Strategy(
        max_step_staleness=0, late_window=late_window, late_shards=late_shards
    )
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(seconds, replicas=[0]),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, keras.optimizers.SGD(0.05, momentum=0.9))
    # A first epoch times every replica's shards (the patience of a fit's
    # first window comes from its opener alone, whose first step runs its
    # functions for the first time); the figures are the next epochs'.
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    strategy.reset_statistics()
    before = (strategy.version, int(model.optimizer.iterations.numpy()))
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return strategy, model, len(x) * epochs, before


@pytest.mark.parametrize("late_window", ["close", "fill"])
def test_a_straggler_is_never_waited_for_past_the_patience(late_window):
    """Replica 0 sleeps 0.3 s a shard, the others take milliseconds: no
    other replica ever waits for it (each wait is far under its shard), its
    gradients arrive stale and are dropped, and every counter agrees."""
    strategy, model, examples, (version, steps) = _straggler_fit(late_window)
    stats = strategy.statistics()
    windows = strategy.window_statistics()
    # Waits end at the patience, a few of the fast replicas' shard times,
    # before the straggler's shard is done: under 0.15 s on a quiet host, up
    # to the patience that a loaded host's slower shards give, never the
    # straggler's 0.3 s. (The bound was 0.15 s; two full-suite runs at load
    # average 13 failed this test once each, which assertion unrecorded,
    # and 8 runs beside three busy loops did not, so each says what it saw.)
    assert max(windows.longest_wait[1:]) < 0.3, windows
    if late_window == "close":
        assert windows.closed_short > 0, windows
    else:
        assert windows.fills > 0, windows
    # A gradient of version v never enters a later window.
    assert stats.overall_max_step_staleness == 0, stats
    assert int(stats.dropped[0]) > 0, stats
    assert int(stats.updates[0]) < int(stats.updates[1:].min()), stats
    # Every count agrees: pushes, versions, steps, and examples (each is
    # trained on, or counted with a dropped gradient).
    assert int(stats.updates.sum() + stats.dropped.sum()) == strategy.version - version
    assert stats.steps == windows.windows == int(model.optimizer.iterations.numpy())
    assert int(stats.examples.sum()) == examples == windows.examples + windows.skipped
    assert windows.skipped > 0
    assert int(stats.step_histogram[:, 0].sum()) >= int(stats.updates.sum())


def test_a_straggler_s_late_shards_are_requeued_and_trained_by_the_others():
    """With `late_shards="requeue"` a shard whose gradient came too late
    goes back on the queue: the fast replicas train it, and every example
    of the epochs is trained on (none counted as skipped but one whose
    late step ran in Keras' own graph, the first of an epoch)."""
    strategy, model, examples, (version, steps) = _straggler_fit(
        "fill", seconds=0.1, late_shards="requeue"
    )
    stats = strategy.statistics()
    windows = strategy.window_statistics()
    assert int(stats.dropped[0]) > 0 and windows.requeued > 0
    # Each requeued shard is pushed once more: versions count every push.
    assert int(stats.updates.sum() + stats.dropped.sum()) == strategy.version - version
    assert int(stats.examples.sum()) == examples + windows.requeued
    assert windows.examples + windows.skipped == examples
    assert windows.skipped <= 2 * 8  # at most one shard of each epoch's first step
    assert stats.steps == windows.windows == int(model.optimizer.iterations.numpy())
    assert stats.overall_max_step_staleness == 0


@pytest.mark.timeout(60)
def test_a_drain_applies_the_window_a_replica_waits_on_without_the_timer():
    """The last batch of each epoch has one example: its one shard opens a
    window that no other push will fill, and its replica waits for that
    window's close before it can take its STOP. With a patience no window
    reaches (the timer never closes it), the epoch's drain applies it
    itself: three epochs end in seconds, where each drain would wait 30 s
    for the waiting replica's thread (the test's timeout)."""
    strategy = tf_diffmap.Strategy(
        devices=["CPU:1", "CPU:2"], patience_margin=1e9, worker_timeout=None
    )
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(0.05))
    x, y = classification_data(65)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    windows = strategy.window_statistics()
    # Per epoch: two full windows and the one-example window, applied.
    assert windows.windows == 9 == int(model.optimizer.iterations.numpy())
    assert windows.closed_short == 0 and windows.examples == 3 * 65
    strategy.shutdown()


def test_fresh_windows_refuse_what_contradicts_them():
    with pytest.raises(ValueError, match="late_window must be one of 'close', 'fill'"):
        tf_diffmap.Strategy(max_step_staleness=0, late_window="wait")
    with pytest.raises(ValueError, match="patience_margin must be a number >= 0"):
        tf_diffmap.Strategy(max_step_staleness=0, patience_margin=-1)
    with pytest.raises(ValueError, match="max_staleness=2 bounds"):
        tf_diffmap.Strategy(max_step_staleness=0, max_staleness=2)
    with pytest.raises(ValueError, match="late_shards must be one of 'requeue', 'skip'"):
        tf_diffmap.Strategy(late_shards="drop")


def test_the_windows_figures_reach_tensorboard(tmp_path):
    """Each epoch's end writes the windows' figures beside the staleness."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = classification_data(256, seed=14)
    strategy = tf_diffmap.Strategy(max_step_staleness=0)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(0.05))
    callback = tf_diffmap.StalenessTensorBoard(tmp_path)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[callback])
    events = EventAccumulator(callback.run_dir)
    events.Reload()
    tags = events.Tags()["tensors"]
    for tag in ("windows/closed_short", "windows/examples_per_step", "windows/patience_ms"):
        assert tag in tags, tags
    assert "windows/seconds_waiting/replica_3" in tags
    per_step = [
        tf.make_ndarray(e.tensor_proto) for e in events.Tensors("windows/examples_per_step")
    ]
    windows = strategy.window_statistics()
    assert len(per_step) == 2 and float(per_step[-1]) == pytest.approx(windows.examples_per_step)


def test_the_window_timer_never_holds_the_training_thread_on_a_store_that_does_not_answer():
    """A ps that stops answering holds the timer's own threads only:
    `start` makes no call to it, and once the store is known lost, `stop`
    leaves the timer's thread to its call instead of joining it."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    calls = {"present": threading.Event(), "close": threading.Event()}
    answers = {"present": threading.Event(), "close": threading.Event()}

    def present():  # the first store call of `start` was telling the gate this
        calls["present"].set()
        answers["present"].wait()
        return [0, 1]

    def close_late(number, fill):  # a call to a ps that does not answer
        calls["close"].set()
        answers["close"].wait()
        return 0, 0

    lost, errors = [], []
    timer = WindowTimer(
        SimpleNamespace(gate=gate, close_late=close_late),
        "close",
        0.0,
        present=present,
        may_fill=lambda: False,
        on_error=errors.append,
        store_lost=lambda: bool(lost),
    )

    def in_thread(fn):
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        thread.join(timeout=30)
        return not thread.is_alive()

    others = set(threading.enumerate())  # other tests' timers, in this process
    assert in_thread(timer.start), "start waited on the store"
    assert calls["present"].wait(timeout=30)  # the timer's thread makes that call
    answers["present"].set()
    # A window that opened long ago: its patience ran out, the timer closes it.
    gate.opened.enqueue(
        [np.int64(0), time.time() - 10.0, time.time() - 10.0, np.zeros([2], np.float64)]
    )
    assert calls["close"].wait(timeout=30)
    lost.append(True)
    assert in_thread(timer.stop), "stop waited on a lost store"
    left = [t for t in threading.enumerate() if t.name == "tf_diffmap-windows" and t not in others]
    assert len(left) == 1  # left to its call
    answers["close"].set()  # the call returns: the thread ends, and reports nothing
    left[0].join(timeout=30)
    assert not left[0].is_alive() and errors == []
    assert int(gate.opened.size()) == 0


def _recording_timer(gate: Gate, margin: float, present: list[int], **transient):
    """A window timer over `gate` whose store records each window it
    closes: `(timer, closed, closing)`, the numbers closed, and an event
    set at the first."""
    closed = []
    closing = threading.Event()

    def close_late(number, fill):
        closed.append(number)
        closing.set()
        return 1, 0

    timer = WindowTimer(
        SimpleNamespace(gate=gate, close_late=close_late),
        "close",
        margin,
        present=lambda: present,
        may_fill=lambda: False,
        on_error=pytest.fail,
        **transient,
    )
    return timer, closed, closing


def test_a_window_whose_opening_was_never_told_is_timed_once_replicas_are_lost():
    """A push whose call is cut off (its worker died) after the store opened
    its window never tells the timer: the runtime's `recheck` has the timer
    time the window open now, and close it once its patience runs out, also
    while it still times an older window."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    gate.shard_seconds.assign([0.05, 0.05])  # a patience of 0.1 s at margin 1
    timer, closed, closing = _recording_timer(gate, 1.0, [0])
    timer.start()
    try:
        # Window 2 opened and was told, with a patience far off; window 3
        # opened and was not (the windows taken so far say which is open).
        now = time.time()
        gate.opened.enqueue([np.int64(2), now, now, np.full([2], 1e4)])
        gate.windows.assign(3)
        time.sleep(0.5)
        assert closed == []  # nothing was due: window 2's patience is far off
        timer.recheck()
        assert closing.wait(timeout=30), "the window open now was never closed"
        assert closed == [3]
        assert int(gate.present.numpy()) == 1  # the lost replica no longer counts
    finally:
        timer.stop()


def test_a_timer_started_while_it_stops_still_times_windows():
    """TensorFlow's threads start the timer (a step's first shard) and stop
    it (a drain in a graph), at times at once. Here a start comes while a
    stop tells the reader to end (in the gate's queue): once both return,
    the timer runs one reader and one timer thread, and closes a window
    whose patience has run out."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    timer, closed, closing = _recording_timer(gate, 0.0, [0, 1])
    queue_of_gate = gate.opened
    starting = []

    class StartedMeanwhile:
        """The gate's queue, but a start comes (from another thread) as the
        stop puts the reader's end in it: the start runs through, or waits
        for the stop, up to a second."""

        def enqueue(self, values):
            if not starting and int(values[0]) < 0:
                starting.append(threading.Thread(target=timer.start, daemon=True))
                starting[0].start()
                starting[0].join(timeout=1.0)
            return queue_of_gate.enqueue(values)

        def __getattr__(self, name):
            return getattr(queue_of_gate, name)

    others = set(threading.enumerate())  # other tests' timers, in this process
    timer.start()
    gate.opened = StartedMeanwhile()
    try:
        timer.stop()
        starting[0].join(timeout=30)
        assert not starting[0].is_alive(), "the start never returned"
        time.sleep(0.2)  # a thread told to end has ended by now
        mine = [t for t in threading.enumerate() if t.name.startswith("tf_diffmap-windows")]
        mine = sorted(t.name for t in mine if t not in others and t.is_alive())
        assert mine == ["tf_diffmap-windows", "tf_diffmap-windows-read"]
        past = time.time() - 10.0
        gate.opened.enqueue([np.int64(5), past, past, np.zeros([2], np.float64)])
        assert closing.wait(timeout=30), "the started timer never closed the window"
        assert closed == [5]
    finally:
        gate.opened = queue_of_gate
        timer.stop()


def _timer_over(gate: Gate, close_late, errors: list, **transient) -> WindowTimer:
    """A window timer (close short, margin 0, two replicas present) over
    `gate`, whose store's call is `close_late`; its errors go to `errors`."""
    return WindowTimer(
        SimpleNamespace(gate=gate, close_late=close_late),
        "close",
        0.0,
        present=lambda: [0, 1],
        may_fill=lambda: False,
        on_error=errors.append,
        **transient,
    )


def _until(condition, seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.05)


def test_a_timer_call_that_a_workers_loss_failed_is_made_again():
    """On a cluster a call to the ps made as a worker dies or restarts can
    fail naming the worker: the timer makes it again a patience later and
    goes on, where any other error stops it (and ends training)."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    calls, errors = [], []
    closing = threading.Event()
    worker_lost = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 is gone")

    def close_late(number, fill):
        calls.append(number)
        if len(calls) < 3:
            raise worker_lost
        closing.set()
        return 1, 0

    timer = _timer_over(gate, close_late, errors, transient=lambda e, since: e is worker_lost)
    timer.start()
    try:
        past = time.time() - 10.0
        gate.opened.enqueue([np.int64(4), past, past, np.zeros([2], np.float64)])
        assert closing.wait(timeout=30), "the timer stopped at the failed call"
        assert calls == [4, 4, 4] and errors == []
    finally:
        timer.stop()
    # Any other error stops the timer, and is handed on.
    timer = _timer_over(gate, close_late, errors)
    calls.clear()
    timer.start()
    try:
        gate.opened.enqueue([np.int64(5), past, past, np.zeros([2], np.float64)])
        _until(lambda: errors)
        assert errors == [worker_lost] and calls == [5]
    finally:
        timer.stop()


def test_a_timer_call_that_fails_for_good_is_not_made_again_past_the_bound():
    """The timer makes a failing call again only while `transient` lets it
    pass, told since when its calls fail: past the runtime's bound
    (`Runtime.may_call_again`) the error stops the timer and is handed on,
    where a call that fails for ever would have been made for ever."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    calls, errors, told = [], [], []
    no_task = tf.errors.UnavailableError(None, None, "connection reset by peer")

    def close_late(number, fill):
        calls.append(number)
        raise no_task

    def transient(error, failing_since):
        told.append(failing_since)
        return time.monotonic() - failing_since < 0.3

    timer = _timer_over(gate, close_late, errors, transient=transient)
    timer.start()
    try:
        past = time.time() - 10.0
        gate.opened.enqueue([np.int64(4), past, past, np.zeros([2], np.float64)])
        _until(lambda: errors)
        assert errors == [no_task], "the timer never gave up on a call that always fails"
        # Made again a patience (at least 50 ms) later until the bound, told
        # one start of the failing throughout.
        assert len(calls) >= 3 and set(calls) == {4}
        assert len(set(told)) == 1 and len(told) == len(calls)
    finally:
        timer.stop()


def test_a_timer_goes_on_after_any_error_the_runtime_lets_pass(caplog):
    """An error of the timer's own work (here its reading of a window's
    patience) that the runtime lets pass leaves the timer running, with one
    warning: a stopped timer would close no window again."""
    gate = Gate("/job:localhost/replica:0/task:0/device:CPU:0", 2)
    timer, closed, closing = _recording_timer(
        gate,
        0.0,
        [0, 1],
        transient=lambda error, since: isinstance(error, tf.errors.CancelledError),
    )
    failures = []
    patience_for = timer.patience_for

    def fails_once(*args):
        if not failures:
            failures.append(True)
            raise tf.errors.CancelledError(None, None, "cut off as a worker left")
        return patience_for(*args)

    timer.patience_for = fails_once
    timer.start()
    try:
        past = time.time() - 10.0
        with caplog.at_level("WARNING", logger="tf_diffmap"):
            gate.opened.enqueue([np.int64(6), past, past, np.zeros([2], np.float64)])
            gate.opened.enqueue([np.int64(7), past, past, np.zeros([2], np.float64)])
            assert closing.wait(timeout=30), "the timer stopped at the error"
        assert failures and closed == [7]
        warned = [r for r in caplog.records if "window timer" in r.getMessage()]
        assert len(warned) == 1 and "CancelledError" in warned[0].getMessage()
    finally:
        timer.stop()
