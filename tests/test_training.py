"""`model.fit` and friends under the strategy, for the models users write."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp

EPOCHS = 2
BATCH = 32


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16)
        self.norm = keras.layers.BatchNormalization()
        self.dropout = keras.layers.Dropout(0.1)
        self.out = keras.layers.Dense(2)

    def call(self, x, training=False):
        h = tf.nn.relu(self.norm(self.hidden(x), training=training))
        return self.out(self.dropout(h, training=training))


class CustomStep(keras.Model):
    """A custom `train_step` that applies its gradients itself."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def functional():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.1)(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def custom_step():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    return CustomStep(inputs, keras.layers.Dense(2)(h))


MODELS = {
    "sequential": mlp,
    "functional": functional,
    "subclassed": Subclassed,
    "custom_train_step": custom_step,
}
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(3e-3),
    "adamw": lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(3e-3),
}


def expected_updates(n, batch, replicas, epochs):
    per_batch = [
        min(replicas, b) for b in [batch] * (n // batch) + ([n % batch] if n % batch else [])
    ]
    return epochs * sum(per_batch)


def assert_windows_add_up(strategy, model, n, batch, epochs):
    """The default's fresh windows: every window is one step of the
    optimizer; every example is trained on or counted as skipped (a shard
    that came after its window was taken, from a replica descheduled on a
    busy host); a window holds about a batch."""
    stats = strategy.statistics()
    windows = strategy.window_statistics()
    assert int(model.optimizer.iterations.numpy()) == stats.steps == windows.windows
    assert windows.examples + windows.skipped == epochs * n
    # A window closes once it holds a batch: by less than a shard more.
    assert windows.examples_per_step < batch + -(-batch // 4)
    assert windows.windows > 0
    assert stats.overall_max_step_staleness == 0


@pytest.mark.parametrize("model_name", MODELS)
def test_models_train_and_every_shard_is_applied(model_name, data):
    x, y = data
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = MODELS[model_name]()
        compile_logits(model, keras.optimizers.Adam(3e-3))
    before = model.evaluate(x, y, batch_size=128, verbose=0)[0]
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    # Judged on the whole data: a custom step's "loss" is one shard's alone.
    assert model.evaluate(x, y, batch_size=128, verbose=0)[0] < before
    assert strategy.version == expected_updates(len(x), BATCH, 4, EPOCHS)
    stats = strategy.statistics()
    # Every push is counted once: applied, or dropped (a replica descheduled
    # on a busy host can miss its window).
    assert int(stats.updates.sum() + stats.dropped.sum()) == strategy.version
    assert_windows_add_up(strategy, model, len(x), BATCH, EPOCHS)


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_keras_optimizers_train(optimizer_name, data):
    x, y = data
    strategy, model = async_mlp(OPTIMIZERS[optimizer_name])
    before = model.evaluate(x, y, verbose=0)[0]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    after = model.evaluate(x, y, verbose=0)[0]
    assert after < before


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_optimizer_by_name(optimizer, data):
    x, y = data
    strategy, model = async_mlp(optimizer)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert strategy.version == expected_updates(len(x), BATCH, 4, 1)


def test_datasets_validation_steps_and_callbacks(tmp_path, data):
    x, y = data
    strategy, model = async_mlp()
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=1).batch(BATCH).repeat()
    val = tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(64)
    checkpoint = tmp_path / "best.weights.h5"
    history = model.fit(
        train,
        steps_per_epoch=6,
        epochs=3,
        validation_data=val,
        verbose=0,
        callbacks=[
            keras.callbacks.ModelCheckpoint(str(checkpoint), save_weights_only=True),
            keras.callbacks.EarlyStopping(monitor="loss", patience=5),
            keras.callbacks.TensorBoard(str(tmp_path / "logs")),
        ],
    )
    assert len(history.history["val_loss"]) == 3
    assert strategy.version == 3 * 6 * 4
    assert checkpoint.exists()
    assert list((tmp_path / "logs" / "train").glob("events.out.tfevents.*"))
    # The checkpoint written at the last epoch end holds what was trained.
    restored = mlp()
    restored.load_weights(str(checkpoint))
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_dataset_of_unknown_length_ends_epochs_cleanly(data):
    x, y = data
    strategy, model = async_mlp()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model.fit(ds, epochs=2, verbose=0)
    assert strategy.version == expected_updates(len(x), BATCH, 4, 2)


def test_evaluate_and_predict_match_a_plain_copy(data):
    x, y = data
    strategy, model = async_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    plain = mlp()
    compile_logits(plain)
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(
        model.predict(x, batch_size=100, verbose=0),
        plain.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=100, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5
    )


def test_partial_last_batch_smaller_than_replica_count():
    x, y = classification_data(34)  # last batch of 2 examples, 4 replicas
    strategy, model = async_mlp()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert strategy.version == 4 + 4 + 2  # empty shards are not stepped


def test_batches_split_into_near_equal_shards_in_the_graph():
    from tf_diffmap.engine.shards import split_in_graph

    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([])])
    def split(x, scale):
        return split_in_graph([x, scale], 4)

    x = tf.reshape(tf.range(20, dtype=tf.float32), [10, 2])
    shards = split(x, tf.constant(3.0))
    assert [int(s[0].shape[0]) for s in shards] == [3, 3, 2, 2]
    np.testing.assert_array_equal(tf.concat([s[0] for s in shards], 0), x)
    assert all(float(s[1]) == 3.0 for s in shards)  # scalars go whole to every shard
    small = split(x[:2], tf.constant(1.0))
    assert [int(s[0].shape[0]) for s in small] == [1, 1, 0, 0]
    assert split_in_graph([x], 1) == [[x]]  # one replica: no split at all


@pytest.mark.parametrize("examples", [12, 10, 5, 4, 2, 0])
def test_stacked_runs_hold_the_shards_a_split_gives(examples):
    from tf_diffmap.engine.shards import split_in_graph, stack_in_graph, stackable

    spec = [tf.TensorSpec([None, 2]), tf.TensorSpec([])]

    @tf.function(input_signature=spec)
    def both(x, scale):
        return split_in_graph([x, scale], 4), stack_in_graph([x, scale], 4)

    @tf.function(input_signature=spec)
    def even(x, scale):
        return stack_in_graph([x, scale], 4, even=True)

    x = tf.reshape(tf.range(2 * examples, dtype=tf.float32), [examples, 2])
    shards, (runs, count) = both(x, tf.constant(3.0))
    # Unstacked in order, the runs are the split's shards that hold examples.
    unstacked = [[t[i] for t in stacked] for stacked, n in runs for i in range(int(n))]
    kept = [shard for shard in shards if shard[0].shape[0] > 0]
    assert len(unstacked) == len(kept) == int(count) == min(examples, 4)
    for (rows, scale), (shard, whole) in zip(unstacked, kept):
        np.testing.assert_array_equal(rows, shard)
        assert float(scale) == float(whole) == 3.0
    if examples and examples % 4 == 0:  # known to divide: one run of four shards
        [([rows, scales], n)], count = even(x, tf.constant(3.0))
        assert int(n) == count == 4 and rows.shape == (4, examples // 4, 2)
        np.testing.assert_array_equal(tf.reshape(rows, [-1, 2]), x)
    # Shards that would hold no elements (tokens, a zero-sized feature) are
    # queued one by one: TensorFlow's enqueue_many does not take them.
    assert stackable([tf.zeros([3, 2]), tf.constant(3.0)])
    assert not stackable([tf.zeros([4, 0])]) and not stackable([tf.zeros([4, 2])[:, :0]])
    assert not stackable([tf.zeros([0, 2])]) and not stackable([tf.constant(1.0)])


def test_run_eagerly_applies_one_update_per_batch(data):
    x, y = data
    strategy, model = async_mlp(compile_kwargs={"run_eagerly": True})
    model.fit(x[:128], y[:128], batch_size=BATCH, epochs=1, verbose=0)
    assert strategy.version == 4


def test_several_replicas_per_device(data):
    x, y = data
    strategy = tf_diffmap.Strategy(devices=["CPU:0", "CPU:1"], replicas_per_device=3)
    assert strategy.num_replicas_in_sync == 6
    with strategy.scope():
        model = mlp()
        compile_logits(model)
    model.fit(x, y, batch_size=60, epochs=1, verbose=0)
    assert strategy.version == expected_updates(len(x), 60, 6, 1)


def _placed_on(concrete) -> set[str]:
    """The devices the ops of a traced function (and of the functions it
    calls) name."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return {_device_name(n.device) for n in nodes if n.device}


def _device_name(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


@pytest.mark.parametrize(
    "kwargs, functions, arguments, devices",
    [
        # Four replicas on logical CPU devices compute on CPU:0: one loop
        # function for all, the replica an argument of it.
        ({}, 1, 2, 1),
        # Each on its own device, as GPU replicas are: a loop function each,
        # the replica a constant of it.
        ({"colocate_cpu_replicas": False}, 4, 1, 4),
        (
            {
                "colocate_cpu_replicas": False,
                "devices": ["CPU:0", "CPU:1"],
                "replicas_per_device": 3,
            },
            2,
            2,
            2,
        ),
    ],
    ids=["cpu_replicas_on_cpu0", "own_devices", "own_devices_shared"],
)
def test_loop_functions_follow_the_devices_replicas_compute_on(
    kwargs, functions, arguments, devices, data
):
    """A loop function per device replicas compute on; replicas that share
    one share it, the replica an argument. The replicas stay distinct (ids,
    devices, counts): every shard is one update of the replica that took it."""
    x, y = data
    strategy = tf_diffmap.Strategy(**kwargs)
    with strategy.scope():
        model = mlp()
        compile_logits(model)
    model.fit(x, y, batch_size=48, epochs=2, verbose=0)
    replicas = strategy.num_replicas_in_sync
    assert len(set(strategy.replica_devices)) == len(kwargs.get("devices", "0123"))
    (program,) = strategy.extended.runtime.feeds()
    loops = list(program.loop_concretes.values())
    assert len(loops) == functions
    assert all(len(c.structured_input_signature[0]) == arguments for c in loops)
    placed = set().union(*(_placed_on(c) for c in loops))
    assert len(placed) == devices
    assert placed <= {_device_name(d) for d in strategy.replica_devices}
    assert strategy.version == expected_updates(len(x), 48, replicas, 2)
    assert sum(strategy.replica_steps()) == strategy.version
    assert all(steps > 0 for steps in strategy.replica_steps())


def test_gradient_accumulation_is_refused_with_advice():
    strategy, model = async_mlp(lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    x, y = classification_data(64)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*larger batch size"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_custom_training_loop_with_strategy_run(data):
    x, y = data
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1)
        model.build((None, 8))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(features, labels):
        return strategy.run(step, args=(features, labels))

    first = float(loss_fn(y, model(x)))
    for features, labels in tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat(3):
        train(features, labels)
    strategy.drain()
    assert strategy.version == 3 * (len(x) // BATCH) * 4
    assert float(loss_fn(y, model(x))) < first


@pytest.mark.parametrize(
    "steps_per_loop, batch, n, steps_per_execution, colocate",
    [
        (1, 32, 512, 1, True),
        (3, 30, 500, 1, True),
        (32, 64, 514, 4, True),
        (32, 16, 258, 16, True),
        (3, 30, 500, 1, False),
        (32, 16, 258, 16, False),
    ],
)
def test_replica_loops_apply_exactly_one_update_per_shard(
    steps_per_loop, batch, n, steps_per_execution, colocate
):
    """Loops of K shards, odd batch sizes, a last batch smaller than the
    replicas; replicas on CPU:0 and each on its own device (as on GPUs)."""
    x, y = classification_data(n)
    strategy, model = async_mlp(
        "sgd",
        compile_kwargs={"steps_per_execution": steps_per_execution},
        steps_per_loop=steps_per_loop,
        colocate_cpu_replicas=colocate,
    )
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    updates = expected_updates(n, batch, 4, 2)
    stats = strategy.statistics()
    # Every shard claimed one version: its gradient accepted, or dropped
    # (it came after its window was taken).
    assert strategy.version == updates == int(stats.updates.sum() + stats.dropped.sum())
    assert_windows_add_up(strategy, model, n, batch, 2)
    assert sum(strategy.replica_steps()) == updates
    # Every example, once per epoch (a late shard's pushed once more).
    assert int(stats.examples.sum()) == 2 * n + strategy.window_statistics().requeued
    assert strategy.extended.runtime.in_flight() == 0


@pytest.mark.parametrize("batch", [BATCH, 6])
def test_batches_of_static_shape_end_epochs_cleanly(batch, data):
    """Batches of a static shape (`drop_remainder=True`), to the end of the data:
    one that divides over the replicas (queued in one op) and one that does not."""
    x, y = data
    strategy, model = async_mlp()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    assert ds.element_spec[0].shape[0] == batch
    model.fit(ds, epochs=2, verbose=0)
    assert strategy.version == 2 * (len(x) // batch) * 4
    pushed = int(strategy.statistics().examples.sum())
    assert pushed == 2 * (len(x) // batch) * batch + strategy.window_statistics().requeued
    assert strategy.extended.runtime.in_flight() == 0
