"""Evaluation and prediction split over every replica, on one host (issue 48).

A step that applies no update (Keras' `evaluate`, `predict`, the validation
inside `fit`, a custom loop's evaluation step) runs each batch as
`MirroredStrategy` does: one shard per replica, all at once. What plain
Keras computes on the same weights and data is the reference for
per-example metrics, and `MirroredStrategy` for a model that couples a
batch's examples.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tf_diffmap.engine.inference import SplitInference

REPLICAS = 4
EXAMPLES = 1003  # odd: every batch size below leaves a partial last batch
FEATURES = 8


def binary_data(n: int = EXAMPLES, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :4].sum(axis=1) + 0.5 * rng.normal(size=n) > 0).astype("float32")[:, None]
    return x, y


def binary_mlp() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer="adam",
        loss="binary_crossentropy",
        metrics=[
            "accuracy",
            keras.metrics.AUC(name="auc"),
            keras.metrics.Precision(name="precision"),
            keras.metrics.Recall(thresholds=[0.3, 0.7], name="recall"),
            keras.metrics.BinaryCrossentropy(name="crossentropy"),
        ],
    )
    return model


def same_weights_models(**strategy_kwargs):
    """A plain Keras model and one under the strategy, with equal weights."""
    keras.utils.set_random_seed(0)
    plain = binary_mlp()
    strategy = tf_diffmap.Strategy(**strategy_kwargs)
    with strategy.scope():
        model = binary_mlp()
    model.set_weights(plain.get_weights())
    return plain, strategy, model


@pytest.fixture(
    scope="module", params=[{}, {"gradients_per_step": 1}], ids=["windows", "per-shard"]
)
def models(request):
    return same_weights_models(**request.param)


def assert_same_logs(expected: dict, found: dict) -> None:
    assert set(found) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(found[name], value, rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("batch_size", [64, 7, 3, 1])
def test_evaluate_equals_plain_keras_on_the_same_weights(models, batch_size):
    plain, _, model = models
    x, y = binary_data()
    expected = plain.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    found = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert_same_logs(expected, found)


def test_evaluate_with_steps_and_a_dataset_of_unknown_length(models):
    plain, _, model = models
    x, y = binary_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(10)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    for steps in (None, 7):
        expected = plain.evaluate(data, steps=steps, verbose=0, return_dict=True)
        found = model.evaluate(data, steps=steps, verbose=0, return_dict=True)
        assert_same_logs(expected, found)


@pytest.mark.parametrize("batch_size", [64, 7, 3])
def test_predict_returns_the_outputs_in_input_order(models, batch_size):
    plain, _, model = models
    x, _ = binary_data()
    np.testing.assert_allclose(
        model.predict(x, batch_size=batch_size, verbose=0),
        plain.predict(x, batch_size=batch_size, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_predict_of_an_identity_model_gives_back_its_input():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Identity()])
    x = np.arange(3 * 45, dtype="float32").reshape(45, 3)
    data = tf.data.Dataset.from_tensor_slices(x).filter(lambda _: True).batch(6)
    np.testing.assert_array_equal(model.predict(data, verbose=0), x)


class ShardRecorder(keras.layers.Layer):
    """Identity layer that records, per call, its replica and shard size."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def _record(self, replica, examples):
        with self.lock:
            if replica >= 0:
                self.calls.append((int(replica), int(examples)))
        return np.bool_(True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, inputs):
        context = tf.distribute.get_replica_context()  # None while Keras builds the model
        replica = -1 if context is None else context.replica_id_in_sync_group
        examples = tf.shape(inputs)[0]
        done = tf.numpy_function(self._record, [replica, examples], tf.bool)
        with tf.control_dependencies([done]):
            return tf.identity(inputs)


def test_every_replica_runs_a_shard_of_every_batch():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        recorder = ShardRecorder()
        model = keras.Sequential([keras.Input((FEATURES,)), recorder, keras.layers.Dense(1)])
        model.compile(loss="mse")
    x, y = binary_data(64 * 3 + 10)  # three full batches and one of 10
    model.evaluate(x, y, batch_size=64, verbose=0)
    calls = sorted(recorder.calls)
    last = [(0, 3), (1, 3), (2, 2), (3, 2)]  # 10 examples: shards differ by one at most
    assert calls == sorted([(r, 16) for r in range(REPLICAS)] * 3 + last)
    recorder.calls.clear()
    model.predict(x[:3], batch_size=64, verbose=0)  # fewer examples than replicas
    assert sorted(recorder.calls) == [(0, 1), (1, 1), (2, 1), (3, 0)]
    assert isinstance(next(iter(strategy.extended._steps.values())), SplitInference)


def test_the_replicas_run_their_shards_at_the_same_time():
    """Each shard waits at a barrier of two: run one after the other, the
    first would wait there alone until the barrier's timeout broke it."""
    if (tf.config.threading.get_inter_op_parallelism_threads() or 2) < 2:
        pytest.skip("one inter-op thread runs one sleeping shard at a time")
    barrier = threading.Barrier(2, timeout=60)
    met = []

    def meet():
        barrier.wait()
        met.append(1)
        return np.bool_(True)

    class Meet(keras.layers.Layer):
        def call(self, inputs):
            done = tf.numpy_function(meet, [], tf.bool)
            with tf.control_dependencies([done]):
                return tf.identity(inputs)

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), Meet(), keras.layers.Dense(1)])
    x, _ = binary_data(8)
    model.predict(x, batch_size=8, verbose=0)
    assert len(met) == REPLICAS


class BatchCentered(keras.layers.Layer):
    """Subtracts the batch's mean: each output depends on the whole batch."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)


def coupled_model() -> keras.Model:
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1), BatchCentered()])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_a_batch_coupled_model_is_evaluated_as_mirrored_strategy_evaluates_it():
    keras.utils.set_random_seed(1)
    plain = coupled_model()
    mirrored = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    with mirrored.scope():
        reference = coupled_model()
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = coupled_model()
    reference.set_weights(plain.get_weights())
    model.set_weights(plain.get_weights())
    x, y = binary_data(640)
    y = y + x[:, :1]
    expected = reference.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    found = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert_same_logs(expected, found)
    # Whole batches (plain Keras) give another figure: the unit differs.
    whole = plain.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert abs(whole["loss"] - found["loss"]) > 1e-3
    # Each shard is centred on its own mean, as MirroredStrategy's would be.
    predictions = model.predict(x[:64], batch_size=64, verbose=0)
    np.testing.assert_allclose(predictions.reshape(REPLICAS, 16).mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(
        predictions, reference.predict(x[:64], batch_size=64, verbose=0), rtol=1e-5, atol=1e-5
    )


class Logged(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def test_validation_inside_fit_reports_plain_keras_figures_to_callbacks():
    _, strategy, model = same_weights_models()
    plain = binary_mlp()
    x, y = binary_data()
    logged = Logged()
    stopping = keras.callbacks.EarlyStopping(monitor="val_auc", mode="max", patience=5)
    model.fit(
        x[:800],
        y[:800],
        validation_data=(x[800:], y[800:]),
        batch_size=32,
        epochs=2,
        verbose=0,
        callbacks=[logged, stopping],
    )
    plain.set_weights(model.get_weights())
    expected = plain.evaluate(x[800:], y[800:], batch_size=32, verbose=0, return_dict=True)
    last = {k[len("val_") :]: v for k, v in logged.logs[-1].items() if k.startswith("val_")}
    assert_same_logs(expected, last)
    assert stopping.best == max(epoch["val_auc"] for epoch in logged.logs)


def test_a_custom_evaluation_loop_runs_split_and_reduces_as_mirrored_strategy():
    """TensorFlow's custom-training tutorial's evaluation: metrics updated in
    the step, `strategy.run` over `experimental_distribute_dataset`, and the
    step's per-example losses reduced and gathered."""
    keras.utils.set_random_seed(2)
    plain = binary_mlp()
    strategy = tf_diffmap.Strategy()
    global_batch = 40
    with strategy.scope():
        model = binary_mlp()
        test_loss = keras.metrics.Mean(name="test_loss")
        test_accuracy = keras.metrics.BinaryAccuracy(name="test_accuracy")
        loss_object = keras.losses.BinaryCrossentropy(reduction=None)
    model.set_weights(plain.get_weights())
    recorder_replicas = []

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        per_example = loss_object(labels, predictions)
        test_loss.update_state(per_example)
        test_accuracy.update_state(labels, predictions)
        recorder_replicas.append(tf.distribute.get_replica_context().replica_id_in_sync_group)
        return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch), per_example

    @tf.function
    def distributed_test_step(inputs):
        mean, per_example = strategy.run(test_step, args=(inputs,))
        return (
            strategy.reduce(tf.distribute.ReduceOp.SUM, mean, axis=None),
            strategy.reduce(tf.distribute.ReduceOp.MEAN, per_example, axis=0),
            strategy.gather(per_example, axis=0),
            len(strategy.experimental_local_results(per_example)),
        )

    x, y = binary_data(200)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    for inputs in strategy.experimental_distribute_dataset(data):
        summed, mean, gathered, replicas = distributed_test_step(inputs)
        images, labels = inputs
        per_example = keras.losses.BinaryCrossentropy(reduction=None)(labels, plain(images))
        np.testing.assert_allclose(gathered, per_example, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(summed, np.mean(per_example), rtol=1e-5)
        np.testing.assert_allclose(mean, np.mean(per_example), rtol=1e-5)
        assert replicas == REPLICAS
    expected = plain.evaluate(x, y, batch_size=global_batch, verbose=0, return_dict=True)
    np.testing.assert_allclose(test_loss.result(), expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(test_accuracy.result(), expected["accuracy"], rtol=1e-5)
    assert int(test_loss.count) == len(x)


def test_a_step_that_assigns_a_variable_runs_whole_with_a_warning():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        largest = tf.Variable(0.0, trainable=False)

    def step(batch):
        largest.assign(tf.reduce_max(batch))
        return tf.shape(batch)[0]

    @tf.function
    def run(batch):
        return strategy.run(step, args=(batch,))

    with pytest.warns(UserWarning, match="runs each batch whole"):
        examples = run(tf.range(10, dtype=tf.float32))
    assert int(examples) == 10  # the whole batch, on one replica
    assert float(largest.numpy()) == 9.0


def test_a_step_traced_with_its_writes_held_writes_nothing_and_returns_them():
    """On a cluster a step that applies no update is traced with its writes
    held (`ReplicaStep(defer_writes=True)`): what it would add to a variable,
    or assign it, is an output, and the variable is left as it was."""
    from tf_diffmap.engine.replica_step import ReplicaStep

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        mean = keras.metrics.Mean()
        peak = tf.Variable(0.0, trainable=False)

    def step(x):
        mean.update_state(x)
        peak.assign(tf.reduce_max(x))
        return mean.result()

    x = tf.constant([1.0, 2.0, 3.0])
    runtime = strategy.extended.runtime
    held = ReplicaStep(runtime, strategy, step, (x,), {}, defer_writes=True)
    assert set(held.concretes) == set(runtime.compute_devices)
    _, _, values = held.concretes[runtime.compute_devices[0]](tf.constant(0), x)
    written = sorted((plain, float(value)) for (_, plain), value in zip(held.deferred, values))
    assert written == [(False, 3.0), (False, 6.0), (True, 3.0)]  # count, total; peak
    assert float(mean.result()) == 0.0 and float(peak) == 0.0
