"""Large embedding tables: lookups read rows, sparse gradients update rows."""

import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tf_diffmap import _tf_internal
from tf_diffmap.updates import sparse

IDS = 16  # ids an example


def bag_of_ids(rows: int, width: int = 8) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((IDS,), dtype="int32"),
            keras.layers.Embedding(rows, width),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )


def id_data(rows: int, n: int = 512, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, rows, (n, IDS)).astype("int32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def live_ops(graph) -> set:
    """The ops of a function graph that run: those its outputs and control
    outputs need (TensorFlow prunes the rest), and those of the functions
    it calls (an aggregated step's window is applied in a conditional)."""
    seen = set()
    for nested in _tf_internal.nested_graphs(graph):
        stack = [t.op for t in nested.outputs] + list(nested.control_outputs)
        while stack:
            op = stack.pop()
            if op not in seen:
                seen.add(op)
                stack.extend(t.op for t in op.inputs)
                stack.extend(op.control_inputs)
    return seen


def replica_step_graph(strategy):
    (feed,) = strategy.extended.runtime.feeds()
    return next(iter(feed.step.concretes.values())).graph


def table_sized(ops, rows: int) -> list[str]:
    return [
        f"{op.type} {op.name}"
        for op in ops
        for t in op.outputs
        if t.shape.rank and t.shape[0] == rows
    ]


def elements(ops) -> int:
    """Elements of every output of `ops` whose shape is known."""
    return sum(
        t.shape.num_elements() for op in ops for t in op.outputs if t.shape.is_fully_defined()
    )


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "gap": lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.5), staleness="gap"),
    "dc": lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.5), staleness="dc"),
    "adam_inverse": lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-2), "inverse"),
    "momentum_rule": lambda: tf_diffmap.AsyncOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), staleness="momentum"
    ),
}


# The per-update rules apply where every shard's gradient is a step.
PER_SHARD_RULES = ("gap", "dc", "adam_inverse", "momentum_rule")


def trained_step_graph(rows: int, optimizer: str):
    strategy = tf_diffmap.Strategy(gradients_per_step=1 if optimizer in PER_SHARD_RULES else "auto")
    with strategy.scope():
        model = bag_of_ids(rows)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    x, y = id_data(rows)
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    return strategy, model, replica_step_graph(strategy)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_an_update_reads_and_writes_the_same_elements_whatever_the_table_size(optimizer):
    counts = {}
    for rows in (20_000, 200_000):
        _, model, graph = trained_step_graph(rows, optimizer)
        ops = live_ops(graph)
        # Nothing of the table's size runs: no whole read, no dense gradient,
        # no dense update of the table or its slots.
        assert table_sized(ops, rows) == []
        assert any(op.type == "ResourceGather" for op in ops)
        counts[rows] = elements(ops)
        assert np.isfinite(model.get_weights()[0]).all()
    assert counts[20_000] == counts[200_000]


def test_keras_dense_semantics_touch_the_whole_table_when_asked_for():
    strategy = tf_diffmap.Strategy()
    rows = 20_000
    with strategy.scope():
        model = bag_of_ids(rows)
        optimizer = tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-2), sparse_updates="dense")
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(*id_data(rows), batch_size=128, epochs=1, verbose=0)
    assert table_sized(live_ops(replica_step_graph(strategy)), rows)


class Tied(keras.layers.Layer):
    """Multiplies by the transposed table of an `Embedding` (tied embeddings)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


def tied_model(rows: int, width: int) -> keras.Model:
    """Looks the table up, and multiplies by it: one table used both ways."""
    inputs = keras.Input((IDS,), dtype="int32")
    embedding = keras.layers.Embedding(rows, width)
    pooled = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    return keras.Model(inputs, Tied(embedding)(pooled))


def test_a_table_also_used_whole_is_read_whole_and_trains():
    rows, width = 4_096, 64
    x = np.random.default_rng(1).integers(0, rows, (256, IDS)).astype("int32")
    y = x[:, :1]
    keras.utils.set_random_seed(3)
    plain = tied_model(rows, width)
    plain.compile(optimizer=keras.optimizers.SGD(1.0), loss=_logits_loss())
    keras.utils.set_random_seed(3)
    strategy = tf_diffmap.Strategy(devices=["/device:CPU:0"])
    with strategy.scope():
        model = tied_model(rows, width)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=_logits_loss())
    np.testing.assert_array_equal(model.get_weights()[0], plain.get_weights()[0])
    for m in (plain, model):
        m.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    ops = live_ops(replica_step_graph(strategy))
    assert any(op.type == "ReadVariableOp" and op.outputs[0].shape[:1] == [rows] for op in ops)
    np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], atol=1e-5)


def _logits_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize(
    "optimizer, sparse_updates, same_as_keras",
    [
        ("sgd", "lazy", True),
        ("adam", "dense", True),
        ("momentum", "dense", True),
        ("adam", "lazy", False),
        ("momentum", "lazy", False),
    ],
)
def test_one_replica_matches_keras_where_the_semantics_are_keras(
    optimizer, sparse_updates, same_as_keras
):
    rows = 512
    x, y = id_data(rows, n=256, seed=2)
    keras.utils.set_random_seed(5)
    plain = bag_of_ids(rows)
    plain.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    keras.utils.set_random_seed(5)
    strategy = tf_diffmap.Strategy(devices=["/device:CPU:0"])
    with strategy.scope():
        model = bag_of_ids(rows)
        wrapped = tf_diffmap.AsyncOptimizer(
            OPTIMIZERS[optimizer](), staleness="none", sparse_updates=sparse_updates
        )
        model.compile(optimizer=wrapped, loss="mse")
    for m in (plain, model):
        m.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    table, expected = model.get_weights()[0], plain.get_weights()[0]
    if same_as_keras:
        np.testing.assert_allclose(table, expected, rtol=1e-5, atol=1e-6)
    else:
        # Rows that the last batches did not touch kept their value here,
        # and kept moving with their momentum or moments under Keras.
        assert not np.allclose(table, expected, rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(rows), x.ravel())
        np.testing.assert_array_equal(table[untouched], _initial_table(rows)[untouched])


def _initial_table(rows):
    keras.utils.set_random_seed(5)
    return bag_of_ids(rows).get_weights()[0]


@pytest.mark.parametrize("per_step", [1, "auto"], ids=["per_shard", "aggregated"])
def test_no_row_increment_is_lost_with_four_contending_replicas(per_step):
    """Every example looks up rows 0..15; each update (or step) subtracts exactly."""
    rows, lr = 1_000, 0.125
    strategy = tf_diffmap.Strategy(gradients_per_step=per_step)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IDS,), dtype="int32"),
                keras.layers.Embedding(rows, 4, embeddings_initializer="zeros"),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(lr), loss=_sum_loss)
    x = np.tile(np.arange(IDS, dtype="int32"), (1024, 1))
    model.fit(x, np.zeros((1024, IDS, 4), "float32"), batch_size=64, epochs=2, verbose=0)
    updates = strategy.version
    assert updates == 2 * (1024 // 64) * 4
    table = model.get_weights()[0]
    # The loss is the sum over a shard of its rows' sums divided by the shard
    # size: each update adds -lr to each element of rows 0..15, and so does
    # each aggregated step (the sum of 4 pushes of a quarter of that each).
    steps = updates if per_step == 1 else strategy.statistics().steps
    if per_step != 1:
        # Fresh windows: one step per window of a batch's examples, where a
        # late shard (dropped, its examples skipped) may leave a window short.
        windows = strategy.window_statistics()
        assert steps == windows.windows > 0
        assert windows.examples + windows.skipped == 2 * 1024
    np.testing.assert_array_equal(table[:IDS], np.full((IDS, 4), -steps * lr, "float32"))
    np.testing.assert_array_equal(table[IDS:], 0.0)


def _sum_loss(y_true, y_pred):
    return tf.reduce_sum(y_pred, axis=[1, 2])


# -- each optimizer's row update against a hand computation -----------------


def _numpy_rows(name, opt, table, slots, ids, grad, lr, step):
    """The row update written out in numpy: returns the new table and slots."""
    table, slots = table.copy(), {k: v.copy() for k, v in slots.items()}
    unique = np.unique(ids)
    g = np.stack([grad[ids == i].sum(0) for i in unique])
    if name == "sgd":
        table[unique] -= lr * g
    elif name in ("momentum", "nesterov"):
        m = slots["momentum"][unique] * opt.momentum - lr * g
        slots["momentum"][unique] = m
        table[unique] += m * opt.momentum - lr * g if name == "nesterov" else m
    elif name == "adagrad":
        slots["accumulator"][unique] += g * g
        table[unique] -= lr * g / np.sqrt(slots["accumulator"][unique] + opt.epsilon)
    elif name in ("adam", "amsgrad"):
        b1, b2 = opt.beta_1, opt.beta_2
        alpha = lr * np.sqrt(1 - b2**step) / (1 - b1**step)
        m = slots["momentum"][unique] = b1 * slots["momentum"][unique] + (1 - b1) * g
        v = slots["velocity"][unique] = b2 * slots["velocity"][unique] + (1 - b2) * g * g
        if name == "amsgrad":
            v = slots["velocity_hat"][unique] = np.maximum(slots["velocity_hat"][unique], v)
        table[unique] -= alpha * m / (np.sqrt(v) + opt.epsilon)
    elif name == "ftrl":
        p = -opt.learning_rate_power
        a, w = slots["accumulator"][unique], table[unique]
        a_new = a + g * g
        linear = slots["linear"][unique] + g - (a_new**p - a**p) / lr * w
        l2 = opt.l2_regularization_strength + opt.beta / (2 * lr)
        quadratic = a_new**p / lr + 2 * l2
        l1 = opt.l1_regularization_strength
        table[unique] = (np.clip(linear, -l1, l1) - linear) / quadratic
        slots["linear"][unique], slots["accumulator"][unique] = linear, a_new
    return table, slots


ROW_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "adam": lambda: keras.optimizers.Adam(0.1),
    "amsgrad": lambda: keras.optimizers.Adam(0.1, amsgrad=True),
    "ftrl": lambda: keras.optimizers.Ftrl(0.5, l1_regularization_strength=0.01),
}


@pytest.mark.parametrize("name", list(ROW_OPTIMIZERS))
def test_row_update_matches_the_formula_and_leaves_other_rows_alone(name):
    rng = np.random.default_rng(7)
    optimizer = ROW_OPTIMIZERS[name]()
    initial = rng.normal(size=(10, 3)).astype("float32")
    variable = keras.Variable(initial)
    optimizer.build([variable])
    slots = {k: v.numpy() for k, v in _tf_internal.optimizer_slots(optimizer, variable).items()}
    table = initial.copy()
    lr = float(optimizer.learning_rate.numpy())
    for step in (1, 2, 3):
        ids = rng.choice([1, 2, 4, 7], size=5).astype("int64")  # repeats included
        grad = rng.normal(size=(5, 3)).astype("float32")
        assert sparse.updates_rows(optimizer)
        gradient = tf.IndexedSlices(tf.constant(grad), tf.constant(ids))
        sparse.update_rows(optimizer, variable.value, gradient, lr)
        optimizer.iterations.assign_add(1)
        table, slots = _numpy_rows(name, optimizer, table, slots, ids, grad, lr, step)
        np.testing.assert_allclose(variable.numpy(), table, rtol=2e-5, atol=1e-6)
        got = {k: v.numpy() for k, v in _tf_internal.optimizer_slots(optimizer, variable).items()}
        for key, value in slots.items():
            np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
    untouched = [0, 3, 5, 6, 8, 9]
    np.testing.assert_array_equal(variable.numpy()[untouched], initial[untouched])


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_exact_row_updates_equal_keras_dense_update(name):
    """Against Keras given the dense gradient: Keras' own Adagrad, given an
    `IndexedSlices` with an id twice, adds the squares of the two rows to
    its accumulator rather than the square of their sum."""
    rng = np.random.default_rng(8)
    initial = rng.normal(size=(10, 3)).astype("float32")
    rows_variable, dense_variable = keras.Variable(initial), keras.Variable(initial)
    rows_optimizer, dense_optimizer = ROW_OPTIMIZERS[name](), ROW_OPTIMIZERS[name]()
    rows_optimizer.build([rows_variable])
    for _ in range(3):
        ids = tf.constant(rng.choice([1, 2, 4, 7], size=6).astype("int64"))
        values = tf.constant(rng.normal(size=(6, 3)).astype("float32"))
        grad = tf.IndexedSlices(values, ids, tf.constant([10, 3], tf.int64))
        sparse.update_rows(rows_optimizer, rows_variable.value, grad, 0.5)
        dense_optimizer.apply([tf.convert_to_tensor(grad)], [dense_variable])
    np.testing.assert_allclose(rows_variable.numpy(), dense_variable.numpy(), rtol=1e-5)


def test_an_optimizer_without_a_row_update_says_so_once_and_falls_back():
    optimizer = keras.optimizers.RMSprop(0.1)
    variable = keras.Variable(np.ones((4, 2), "float32"))
    grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1], tf.int64))
    sparse._warned.discard(keras.optimizers.RMSprop)
    with pytest.warns(UserWarning, match="RMSprop's updates of a sparse gradient"):
        assert not sparse.updates_rows(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sparse.updates_rows(optimizer)
    with pytest.raises(ValueError, match="RMSprop has no row update"):
        sparse.update_rows(optimizer, variable.value, grad, 0.1)
    assert sparse.row_update_kind(keras.optimizers.AdamW()) == "adam"

    class OwnStep(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    assert sparse.row_update_kind(OwnStep()) is None


def test_the_optimizer_of_an_update_is_found_in_keras_closure():
    optimizer = keras.optimizers.SGD(0.1)
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer.build([variable])
    seen = []

    class Extended:
        def update(self, var, fn, args=(), kwargs=None, group=True):
            seen.append(fn)

    class Distribution:
        extended = Extended()

    optimizer._distributed_tf_update_step(Distribution(), [(tf.ones(2), variable.value)], 0.1)
    assert _tf_internal.optimizer_of_update(seen[0]) is optimizer
    assert _tf_internal.optimizer_of_update(lambda v: v) is None


def test_sparse_updates_is_checked_and_saved():
    with pytest.raises(ValueError, match="sparse_updates must be one of"):
        tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(), sparse_updates="eager")
    optimizer = tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(), sparse_updates="dense")
    again = tf_diffmap.AsyncOptimizer.from_config(optimizer.get_config())
    assert again.sparse_updates == "dense"


def _custom_loop(step_body):
    """A one-replica strategy, an embedding table of 20,000 rows, SGD(1.0),
    and a `tf.function` that runs `step_body(table, optimizer, ids)` in it."""
    strategy = tf_diffmap.Strategy(devices=["/device:CPU:0"])
    with strategy.scope():
        table = keras.layers.Embedding(20_000, 8)
        table.build((None, IDS))
        optimizer = keras.optimizers.SGD(1.0)

    @tf.function
    def train(ids):
        return strategy.run(step_body, args=(table, optimizer, ids))

    return table, train


def test_rows_read_before_the_update_keep_their_value_when_used_after_it():
    def step(table, optimizer, ids):
        with tf.GradientTape() as tape:
            rows = table(ids)
            loss = tf.reduce_sum(rows)
        grads = tape.gradient(loss, table.trainable_variables)
        optimizer.apply_gradients(zip(grads, table.trainable_variables))
        # Both made after the update: the rows as the forward pass read them.
        return rows, tf.reduce_sum(rows, axis=-1)

    table, train = _custom_loop(step)
    ids = tf.constant(np.arange(IDS, dtype="int32")[None])
    before = table.embeddings.numpy()[:IDS].copy()
    rows, sums = train(ids)
    np.testing.assert_allclose(rows.numpy()[0], before)
    # A row's sum can nearly cancel (0.0017 from terms of about 0.05): its
    # rounding, in TensorFlow's order against NumPy's, is relative to the
    # terms, not to the sum (1.9e-9 off was seen, over rtol 1e-6 of 0.0017).
    np.testing.assert_allclose(
        sums.numpy()[0], before.sum(-1), rtol=1e-6, atol=1e-6 * np.abs(before).sum(-1).max()
    )
    np.testing.assert_allclose(table.embeddings.numpy()[:IDS], before - 1.0)


def test_a_whole_value_used_only_after_the_update_is_refused_clearly():
    def step(table, optimizer, ids):
        whole = tf.convert_to_tensor(table.embeddings)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(ids))
        grads = tape.gradient(loss, table.trainable_variables)
        optimizer.apply_gradients(zip(grads, table.trainable_variables))
        return tf.reduce_sum(whole)

    _, train = _custom_loop(step)
    with pytest.raises(ValueError, match="read before this step's update is used after"):
        train(tf.constant(np.arange(IDS, dtype="int32")[None]))


def test_row_writes_from_concurrent_threads_lose_no_increment():
    """TensorFlow's `scatter_add` on a float variable runs under a shared
    lock and loses increments when threads add to the same rows at once
    (measured: 34 of 512,000 here); `sparse.write_rows` takes the lock."""
    variable = tf.Variable(tf.zeros([1_000, 4]))
    ids = tf.range(IDS, dtype=tf.int64)
    ones = tf.ones([IDS, 4])

    @tf.function
    def add_fifty_times():
        for _ in range(50):
            sparse.write_rows(variable, "add", ids, ones)

    def work():
        for _ in range(40):
            add_fifty_times()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.testing.assert_array_equal(variable.numpy()[:IDS], 4 * 40 * 50)
    np.testing.assert_array_equal(variable.numpy()[IDS:], 0)
