"""What makes the strategy asynchronous, and correct."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp

LR = 0.125  # a power of two: every multiple below is exact in float32


def constant_gradient_model():
    """With x of ones, sum over outputs of x @ w has gradient 1 per weight."""
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros")]
    )


def per_example_loss(y_true, y_pred):
    return tf.reduce_sum(y_pred, axis=-1)


class ScalarLossStep(keras.Model):
    def train_step(self, data):
        x, _ = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(self(x, training=True), axis=-1))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@pytest.mark.parametrize(
    "colocate, per_step",
    [(True, 1), (False, 1), (True, "auto"), (False, "auto")],
    ids=["on_cpu0", "own_devices", "on_cpu0_aggregated", "own_devices_aggregated"],
)
def test_no_update_is_lost_with_eight_contending_replicas(colocate, per_step):
    strategy = tf_diffmap.Strategy(
        replicas_per_device=2, colocate_cpu_replicas=colocate, gradients_per_step=per_step
    )
    assert strategy.num_replicas_in_sync == 8
    with strategy.scope():
        model = constant_gradient_model()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=per_example_loss)
    x, y = np.ones((1024, 4), "float32"), np.zeros((1024, 3), "float32")
    model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    updates = strategy.version
    assert updates == 3 * (1024 // 64) * 8
    stats = strategy.statistics()
    if per_step == 1:
        assert int(stats.updates.sum()) == updates
        steps = updates
    else:
        # Fresh windows: a push is applied, or dropped (it came after its
        # window was taken: a replica descheduled on a busy host), its
        # examples counted as skipped; each step is its window's mean,
        # the constant gradient.
        assert int(stats.updates.sum() + stats.dropped.sum()) == updates
        windows = strategy.window_statistics()
        assert windows.examples + windows.skipped == 3 * 1024
        steps = stats.steps
        assert steps == windows.windows > 0
    # Each update moves LR per weight; aggregated, each step does (the
    # examples-weighted mean of the window's pushes).
    np.testing.assert_array_equal(model.get_weights()[0], np.full((4, 3), -steps * LR, "float32"))
    assert int(model.optimizer.iterations.numpy()) == steps


@pytest.mark.parametrize("per_step", [1, "auto"], ids=["per_shard", "aggregated"])
def test_scalar_loss_is_not_rescaled(per_step):
    """A custom step's scalar loss is the replica's, as under any
    tf.distribute strategy: per shard each update moves by its gradient;
    aggregated, a step sums its replicas' gradients, as MirroredStrategy's
    all-reduce does. (A patience no replica reaches: a window the timer
    closed short or filled is a step too, of the batch's scale.)"""
    strategy = tf_diffmap.Strategy(gradients_per_step=per_step, patience_margin=1e4)
    with strategy.scope():
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros")(inputs)
        model = ScalarLossStep(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(LR))
    x = np.ones((256, 4), "float32")
    model.fit(x, np.zeros((256, 3), "float32"), batch_size=32, epochs=1, verbose=0)
    updates = strategy.version
    assert updates == 8 * 4
    np.testing.assert_array_equal(model.get_weights()[0], np.full((4, 3), -updates * LR, "float32"))


def test_num_replicas_in_sync_reads_one_inside_a_replica_step():
    strategy = tf_diffmap.Strategy()
    seen = []

    def step():
        seen.append(tf.distribute.get_replica_context().num_replicas_in_sync)
        return tf.constant(1.0)

    strategy.run(step)
    assert seen == [1] and strategy.num_replicas_in_sync == 4


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_replica_matches_plain_keras(optimizer):
    x, y = classification_data(256)
    plain = mlp()
    initial = plain.get_weights()
    compile_logits(plain, optimizer)
    strategy, model = async_mlp(optimizer, devices=["CPU:1"])
    model.set_weights(initial)
    plain_history = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_history.history["loss"], history.history["loss"], rtol=1e-5)
    assert strategy.statistics().overall_max_staleness == 0


def test_a_slow_replica_takes_fewer_shards():
    x, y = classification_data(1024)
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(0.03, replicas=[0]),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    stats = strategy.statistics()
    # Shards taken: gradients accepted, and those the default's bound dropped
    # (the slow replica's, computed more than a step before their step).
    updates = stats.updates + stats.dropped
    assert int(updates.sum()) == 2 * 32 * 4
    assert all(updates[0] < updates[r] for r in (1, 2, 3)), updates
    # Updates of the fast replicas land while the slow one computes: staleness,
    # read from the distribution of all its gradients (the accepted ones alone
    # can be one or two, computed right after a step).
    histogram = stats.histogram[0]
    assert (histogram * np.arange(len(histogram))).sum() / histogram.sum() > 1, histogram


def test_store_sharded_over_parameter_devices():
    x, y = classification_data(256)
    strategy, model = async_mlp(parameter_device=["CPU:2", "CPU:3"])
    devices = {w.value.device for w in model.trainable_weights}
    assert {tf.DeviceSpec.from_string(d).device_index for d in devices} == {2, 3}
    # Each slot lives with its variable.
    for slot in model.optimizer.variables[2:]:
        assert slot.value.device.endswith(("CPU:2", "CPU:3"))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert strategy.version == 8 * 4


def test_reading_weights_during_fit_sees_every_dispatched_update():
    x, y = classification_data(512)
    strategy = tf_diffmap.Strategy()
    versions = []

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.get_weights()  # an eager read drains first
            versions.append(strategy.version)

    with strategy.scope():
        model = mlp()
        compile_logits(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Reader()])
    assert versions == [4 * (i + 1) for i in range(16)]


def test_step_knows_the_parameters_its_forward_pass_read():
    """Delay compensation needs w_read: the value the forward pass used."""
    from tf_diffmap.updates.step import current_step

    strategy = tf_diffmap.Strategy(devices=["CPU:0"])
    with strategy.scope():
        variable = tf.Variable(1.0)

    @tf.function
    def run():
        def step():
            forward = variable * 2.0
            with tf.control_dependencies([forward]):
                variable.assign_add(5.0)
            with tf.control_dependencies([variable.read_value()]):
                return current_step().read_value_of(variable), forward

        return strategy.run(step)

    read, forward = run()
    assert float(read) == 1.0 and float(forward) == 2.0
    assert float(variable.numpy()) == 6.0


IDLE_RACE_SCRIPT = textwrap.dedent(
    """
    import json, os, random, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf, tf_diffmap
    from tf_diffmap.engine import feed, workers
    tf_diffmap.split_devices(4, "CPU")
    # The idle monitor looks every 10 ms and stops the loops after 20 ms
    # without a shard put or applied; the steps pause for 15 to 40 ms every
    # fifth step, so that idle stops meet arriving steps, and for 0.3 s every
    # hundredth, so that some stops end in a drained mark even on a busy
    # host (one run beside the other slow tests had every stop meet a step).
    workers.POLL_SECONDS, workers.IDLE_SECONDS = 0.002, 0.02
    marks = []
    stop_if_idle = feed.StepFeed.stop_if_idle
    def counted(self):
        marked = stop_if_idle(self)
        marks.append(marked)
        return marked
    feed.StepFeed.stop_if_idle = counted

    class Pauses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch % 100 == 50:
                time.sleep(0.3)
            elif batch % 5 == 0:
                time.sleep(random.uniform(0.015, 0.04))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * 100, 8)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).batch(16).repeat()
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(data, steps_per_epoch=600, epochs=1, verbose=0, callbacks=[Pauses()])
    print(json.dumps({"version": strategy.version, "marks": marks.count(True),
                      "resumed": marks.count(False)}))
    """
)


@pytest.mark.slow
def test_steps_that_meet_an_idle_stop_are_applied_and_never_block():
    """The loops stop by themselves when idle, while Keras may be putting a
    step's shards: none may be left in the queue with no loop to take it (the
    steps after it would block once it is full), and none may be lost.

    In a subprocess, so that a hang ends with its timeout (which kills it);
    slow, as every test that starts a process.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", IDLE_RACE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["version"] == 600 * 4  # one update per shard, none lost
    assert report["marks"] >= 1, report  # idle stops did meet the steps
