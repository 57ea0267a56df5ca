"""TensorFlow's inter-op pool: nothing of the strategy may wait while holding it.

A one-CPU host gives TensorFlow a single inter-op thread, which every
function's ops run on, the workers' replica steps included. These tests run
in a subprocess with exactly that pool (it is fixed once TensorFlow starts).
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import async_mlp, classification_data

SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras, numpy as np, tf_diffmap
    tf_diffmap.split_devices(4, "CPU")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, verbose=0)
    report = {"version": strategy.version, "loss": history.history["loss"],
              "may_wait": strategy.extended.runtime.graph_may_wait}

    # A custom loop that runs a whole-model step while replica steps are in
    # flight gets told what to do instead of hanging. Every training step
    # waits for a token of `gate` (a queue's dequeue holds no thread while it
    # waits), so the replica steps stay in flight until the test lets them go.
    gate = tf.queue.FIFOQueue(100, [tf.int32], shapes=[[]])

    class Gate(keras.layers.Layer):
        def call(self, t, training=None):
            if not training:
                return t
            with tf.control_dependencies([gate.dequeue()]):
                return tf.identity(t)

    with strategy.scope():
        slow = keras.Sequential([keras.Input((8,)), Gate(), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    def train(features):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(slow(features, training=True) ** 2)
        grads = tape.gradient(loss, slow.trainable_variables)
        optimizer.apply_gradients(zip(grads, slow.trainable_variables))
        return loss

    @tf.function
    def train_step(features):
        return strategy.run(train, args=(features,))

    @tf.function
    def eval_step(features):
        # One value per replica (the batch split over them), reduced as under
        # any tf.distribute strategy.
        per_replica = strategy.run(lambda f: tf.reduce_mean(slow(f)), args=(features,))
        return strategy.reduce("MEAN", per_replica, axis=None)

    gate.enqueue(0)  # the first step after a drain runs in the caller's graph
    train_step(tf.constant(x[:64]))
    train_step(tf.constant(x[:64]))
    report["in_flight"] = strategy.extended.runtime.in_flight()
    try:
        eval_step(tf.constant(x[:64]))
        report["in_flight_error"] = None
    except Exception as error:
        report["in_flight_error"] = str(error)
    gate.enqueue_many(tf.zeros([7], tf.int32))
    strategy.drain()
    report["after_drain"] = float(eval_step(tf.constant(x[:64])))
    report["custom_loop_version"] = strategy.version
    print(json.dumps(report))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_inter_op_thread_trains_and_never_hangs():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["may_wait"] is False
    assert report["version"] == 2 * 6 * 4  # 192 training examples, batches of 32, 4 shards
    assert all(np.isfinite(report["loss"]))
    error = report["in_flight_error"]
    assert error is not None and "strategy.drain()" in error and "single inter-op thread" in error
    assert report["in_flight"] == 7
    assert np.isfinite(report["after_drain"])
    assert report["custom_loop_version"] == report["version"] + 2 * 4  # no update lost


def test_first_batch_of_each_epoch_reports_real_outputs():
    x, y = classification_data(256)
    strategy, model = async_mlp()
    seen = []

    class FirstBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                seen.append(dict(logs))

    model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[FirstBatch()])
    assert len(seen) == 3
    for logs in seen:
        # The first step after a drain applies its first shard before it
        # returns, and returns that step's metrics: a real loss, an
        # accuracy of a real batch.
        assert logs["loss"] > 0.05 and np.isfinite(logs["loss"])
        assert 0.0 < logs["accuracy"] <= 1.0
    assert strategy.version == 3 * 4 * 4


def test_an_ordinary_step_passes_no_tensor_of_its_batch_through_a_conditional():
    x, y = classification_data(256)
    strategy, model = async_mlp()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)

    @tf.function
    def step(features, labels):
        return strategy.run(model.train_step, args=((features, labels),))

    graph = step.get_concrete_function(
        tf.TensorSpec([64, 8], tf.float32), tf.TensorSpec([64], tf.int32)
    ).graph
    conditionals = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    # The first step's conditional, and the counter snapshots' one.
    assert len(conditionals) >= 2
    for op in conditionals:
        # Each takes its predicate and variables only: a batch tensor
        # through a conditional costs every step a `Switch` for it.
        assert op.inputs[0].dtype == tf.bool
        assert all(t.dtype == tf.resource for t in op.inputs[1:]), [t.dtype for t in op.inputs[1:]]
