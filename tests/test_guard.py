"""The collapse guard: a diverging run is named while it trains, a healthy
one is not, and the warning names the user's line."""

import inspect
import math
import time
import warnings

import keras
import numpy as np
import pytest

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.engine.guard import Collapse, CollapseGuard


def test_noise_near_a_loss_of_zero_is_not_a_collapse_but_a_climb_back_is():
    collapse = Collapse(rise_of_start=0.25, min_readings=3)
    # An issue's run at 0.999 training accuracy: an epoch's first batches
    # read 4.3 times the lowest loss, which the former rule (4 times the
    # lowest) called a collapse. Against the start, 2.3, it is nothing.
    for loss in (2.3, 1.2, 0.6, 0.8, 0.2, 0.00269, 0.0116, 0.004, 0.03):
        assert collapse.observe(loss) is None
    # One reading above the threshold is a torn read of the running mean
    # (its total and count read between another step's two updates): a
    # collapse shows in the next reading too.
    assert collapse.observe(1.9) is None
    assert collapse.observe(1.9) is None
    assert collapse.observe(0.005) is None
    assert collapse.observe(1.6) is None
    assert collapse.observe(1.6) is None
    what = collapse.observe(1.7)
    assert what == (
        "the loss rose to 1.7 from its lowest, 0.00269, by 74% of its level at the start, 2.3"
    )
    assert collapse.observe(math.inf) == "the loss is inf"
    fresh = Collapse(rise_of_start=0.25, min_readings=3)
    assert fresh.observe(0.1) is None and fresh.observe(9.0) is None  # too early to judge
    # A loss that starts below 0 has no scale to judge a rise against.
    negative = Collapse(rise_of_start=0.25, min_readings=3)
    assert [negative.observe(x) for x in (-0.2, -0.5, -0.9, -0.95, -0.3)] == [None] * 5
    assert negative.observe(math.nan) == "the loss is nan"


def test_a_reading_of_zero_is_a_step_not_written_yet_and_is_skipped():
    collapse = Collapse(rise_of_start=0.25, min_readings=3)
    # Read as a loss, the 0 would be the lowest and the level at the start
    # would lose one of its readings.
    for loss in (0.0, 2.3, 1.0, 0.5, 1.2, 1.2):
        assert collapse.observe(loss) is None
    assert collapse.observe(1.2) == (
        "the loss rose to 1.2 from its lowest, 0.5, by 30% of its level at the start, 2.3"
    )


def test_a_collapse_the_watcher_sees_is_said_on_the_training_thread():
    """The watcher's thread has no frame of the user's: raised there, the
    warning would name the guard's own file. It waits for the training
    thread's next drain, and names the line that drained."""
    losses = iter([2.3, 1.0, 0.5, math.nan])
    guard = CollapseGuard(
        lambda: next(losses, None), training=lambda: True, advice=lambda: "Try this.", period=0.01
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.start()
        deadline = time.monotonic() + 30
        while guard._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert caught == [] and not guard.warned
        line = inspect.currentframe().f_lineno + 1
        guard.check(read=False)
        guard.check(read=False)  # once
    said = "Training is collapsing: the loss is nan. Try this."
    assert [str(w.message) for w in caught] == [said]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


class _Epochs(keras.callbacks.Callback):
    """Records, at each epoch's end, how many collapse warnings were given."""

    def __init__(self, caught):
        super().__init__()
        self.caught = caught
        self.counts = []

    def on_epoch_end(self, epoch, logs=None):
        self.counts.append(sum("Training is collapsing" in str(w.message) for w in self.caught))


def _train(per_step, learning_rate, epochs=6):
    x, y = classification_data(2048)
    strategy = tf_diffmap.Strategy(gradients_per_step=per_step)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(learning_rate, momentum=0.9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs_seen = _Epochs(caught)
        model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=[epochs_seen])
    messages = [str(w.message) for w in caught if "Training is collapsing" in str(w.message)]
    return messages, epochs_seen.counts


@pytest.mark.parametrize("per_step", [1, "auto"], ids=["per_shard", "aggregated"])
def test_a_diverging_run_is_named_during_training_with_what_to_try(per_step):
    messages, counts = _train(per_step, learning_rate=40.0)
    assert len(messages) == 1, messages  # once
    # Said while training went on, not after it.
    assert counts[0] == 1 and counts[-1] == 1, counts
    message = messages[0]
    assert "mean staleness" in message
    if per_step == 1:
        assert "gradients_per_step=1" in message and 'gradients_per_step="auto"' in message
    else:
        assert "aggregates 4 shard gradients" in message and "lower learning rate" in message
        # The default's windows are fresh already: no other bound is advised.
        assert "max_step_staleness=0)" in message
        assert "Strategy(max_step_staleness=" not in message


def test_a_run_that_trains_is_not_warned_about():
    messages, counts = _train("auto", learning_rate=0.05, epochs=3)
    assert messages == [] and counts == [0, 0, 0]
    np.testing.assert_equal(len(counts), 3)


# Every replica sleeps this long in each training step (emulated device
# time: a replica that waits on its device uses no CPU), so that an epoch
# lasts long enough for the guard to read inside it, and at its start.
DEVICE_SECONDS = 0.002
# The guard reads this often here (once a second in use): each run is read
# at many epochs' starts, where the loss read (Keras' running mean of the
# epoch) covers a few batches only and wanders most.
READ_EVERY = 0.02


def _fit_watched(seed, epochs, optimizer, per_step="auto"):
    """Trains the two-class MLP with device time; returns the collapse
    warnings, the line that called `fit`, the epochs' losses and the
    guard's readings."""
    keras.utils.set_random_seed(seed)
    x, y = classification_data(1024, seed=seed)
    strategy = tf_diffmap.Strategy(gradients_per_step=per_step)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(DEVICE_SECONDS, replicas=range(4)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, optimizer())
    guard = strategy.extended.runtime.guard
    guard.period = READ_EVERY
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
    found = [w for w in caught if "Training is collapsing" in str(w.message)]
    return found, line, history.history["loss"], guard.collapse.readings


@pytest.mark.parametrize("seed", [7, 8])
def test_a_long_healthy_run_that_ends_near_zero_loss_is_not_warned_about(seed):
    """Seeds and data untouched when the guard's threshold was chosen."""
    found, _, losses, readings = _fit_watched(
        seed, 20, lambda: keras.optimizers.SGD(0.1, momentum=0.9)
    )
    assert losses[-1] < 0.03, losses  # near zero, where the former rule cried wolf
    assert readings >= 60, readings  # read across the epochs' starts
    assert found == [], [str(w.message) for w in found]


def test_a_step_per_shard_with_no_rule_collapses_and_the_warning_names_the_fit():
    found, line, losses, _ = _fit_watched(
        3,
        8,
        lambda: tf_diffmap.AsyncOptimizer(
            keras.optimizers.SGD(0.5, momentum=0.9), staleness="none"
        ),
        per_step=1,
    )
    assert len(found) == 1, losses
    assert "gradients_per_step=1" in str(found[0].message)
    assert (found[0].filename, found[0].lineno) == (__file__, line)
