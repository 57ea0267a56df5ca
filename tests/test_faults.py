"""Errors reach the caller as raised; nothing hangs; no thread is left."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp


def wait_for_no_threads(strategy, seconds=10.0):
    deadline = time.monotonic() + seconds
    while strategy.worker_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return strategy.worker_threads()


@pytest.mark.timeout(60)
def test_replica_error_reaches_fit_as_raised_and_threads_stop():
    x, y = classification_data(512)
    x[300] = np.nan  # one shard fails its check, in a worker thread
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Lambda(lambda t: tf.debugging.check_numerics(t, "bad input row")),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model)
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad input row") as raised:
        model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert time.monotonic() - start < 30
    # The error raised is the replica's own, not a wrapper from the dispatch op.
    assert "tf_diffmap_dispatch" not in str(raised.value)
    assert wait_for_no_threads(strategy) == []
    # The strategy is usable again once the data is fixed.
    x[300] = 0.0
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


@pytest.mark.timeout(60)
def test_a_replica_out_of_range_error_is_raised_not_taken_for_the_end_of_data():
    """Keras ends an epoch on OutOfRangeError from its own loop; a replica's is an error."""
    x, y = classification_data(512)
    calls = tf.Variable(0, dtype=tf.int64)  # made outside the scope: a plain counter

    def count(t):
        # The sixth training step raises OutOfRangeError ("Reached limit of 5").
        tick = tf.raw_ops.ResourceCountUpTo(resource=calls.handle, limit=5, T=tf.int64)
        with tf.control_dependencies([tick]):
            return tf.identity(t)

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Lambda(count), keras.layers.Dense(2)]
        )
        compile_logits(model)
    with pytest.raises(tf.errors.OutOfRangeError, match="Reached limit of 5"):
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert wait_for_no_threads(strategy) == []
    assert strategy.version == 5


@pytest.mark.timeout(60)
def test_keyboard_interrupt_during_fit_leaves_no_threads():
    x, y = classification_data(1024)
    strategy = tf_diffmap.Strategy()

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise KeyboardInterrupt

    with strategy.scope():
        model = mlp()
        compile_logits(model)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Interrupt()])
    assert wait_for_no_threads(strategy) == []
    # What was dispatched before the interrupt was applied, not lost.
    assert strategy.version == 6 * 4


def test_shutdown_stops_threads_at_once():
    x, y = classification_data(256)
    strategy, model = async_mlp()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    strategy.shutdown()
    assert strategy.worker_threads() == []
