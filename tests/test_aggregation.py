"""Asynchronous mini-batching: K pushed shard gradients make one optimizer step."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.store.accumulators import Accumulators
from tf_diffmap.store.gate import Gate

REPLICAS = 4

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.01),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=1, decay_rate=0.5)
    ),
}


def _fit_one_batch(strategy, optimizer_fn, x, y, weights):
    scope = strategy.scope() if strategy is not None else _no_scope()
    with scope:
        model = mlp()
        model.set_weights(weights)
        compile_logits(model, optimizer_fn())
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return model


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("optimizer", [o for o in OPTIMIZERS if o != "clipnorm"])
def test_one_window_is_one_step_of_mirrored_strategy(optimizer):
    """A batch's K = N shard gradients make exactly the synchronous step:
    MirroredStrategy's on the same replicas, with the optimizer's own
    hyperparameters (momentum, moments, weight decay, schedule)."""
    examples = 32
    x, y = classification_data(examples, seed=3)
    weights = mlp().get_weights()
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    mirrored = _fit_one_batch(
        tf.distribute.MirroredStrategy(devices), OPTIMIZERS[optimizer], x, y, weights
    )
    # A patience no replica reaches: the window is checked, not the timer
    # (a shard of 8 examples takes a fraction of a millisecond, under a busy
    # host's scheduling noise).
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    assert strategy.gradients_per_step == REPLICAS
    ours = _fit_one_batch(strategy, OPTIMIZERS[optimizer], x, y, weights)
    for a, b in zip(ours.get_weights(), mirrored.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    stats = strategy.statistics()
    assert stats.steps == 1 == int(ours.optimizer.iterations.numpy())
    assert strategy.version == min(examples, REPLICAS) == int(stats.updates.sum())
    assert stats.overall_max_step_staleness == 0


@pytest.mark.parametrize("optimizer", ["adam", "clipnorm"])
def test_one_window_matches_plain_keras_on_the_whole_batch(optimizer):
    """Clipping included: the window's gradient is clipped as plain Keras
    clips the whole batch's (MirroredStrategy clips each replica's)."""
    x, y = classification_data(64, seed=4)
    weights = mlp().get_weights()
    plain = _fit_one_batch(None, OPTIMIZERS[optimizer], x, y, weights)
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    ours = _fit_one_batch(strategy, OPTIMIZERS[optimizer], x, y, weights)
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def _expected_steps(n, batch, replicas, epochs, k):
    """Windows of K pushes, the last of each epoch flushed at its end."""
    pushes = [min(replicas, b) for b in [batch] * (n // batch) + ([n % batch] if n % batch else [])]
    return epochs * -(-sum(pushes) // k), epochs * sum(pushes)


@pytest.mark.parametrize("k", ["auto", 3, 1])
def test_asynchronous_windows_versions_steps_and_counts_add_up(k):
    """Asynchronous windows (a bound of 1): every push claims a version;
    every window of K is one step of the optimizer (`iterations`); what is
    left at an epoch's end is applied there; nothing is pending after `fit`."""
    x, y = classification_data(250)
    strategy = tf_diffmap.Strategy(gradients_per_step=k, max_step_staleness=1)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.Adam(3e-3))
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    per_step = REPLICAS if k == "auto" else k
    steps, pushes = _expected_steps(len(x), 32, REPLICAS, 3, per_step)
    stats = strategy.statistics()
    assert strategy.version == pushes == int(stats.updates.sum() + stats.dropped.sum())
    if per_step == 1:
        assert stats.steps is None  # every update is a step: nothing aggregated
        assert int(model.optimizer.iterations.numpy()) == pushes
        assert not strategy.extended.runtime.aggregations()
    else:
        assert stats.steps == steps == int(model.optimizer.iterations.numpy())
        assert [a.pending() for a in strategy.extended.runtime.aggregations()] == [0]
    assert int(stats.examples.sum()) == 3 * len(x)


@pytest.mark.parametrize("k", ["auto", 3])
def test_fresh_windows_versions_steps_and_examples_add_up(k):
    """Fresh windows (the default): every push claims a version, applied or
    dropped; every window is one step; every example is trained on or
    counted as skipped; a window is at most a global batch's share of K
    (K = 3 of 4 replicas: the fourth shard of a batch arrives stale)."""
    x, y = classification_data(250)
    strategy = tf_diffmap.Strategy(gradients_per_step=k)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.Adam(3e-3))
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    _, pushes = _expected_steps(len(x), 32, REPLICAS, 3, 1)
    stats = strategy.statistics()
    windows = strategy.window_statistics()
    # Every shard is pushed once, a late one (requeued) once more.
    assert strategy.version == int(stats.updates.sum() + stats.dropped.sum())
    assert strategy.version >= pushes
    assert stats.steps == windows.windows == int(model.optimizer.iterations.numpy())
    assert [a.pending() for a in strategy.extended.runtime.aggregations()] == [0]
    # Pushes count a requeued shard's examples once more.
    assert int(stats.examples.sum()) == 3 * len(x) + windows.requeued
    assert windows.examples + windows.skipped == 3 * len(x)
    assert stats.overall_max_step_staleness == 0
    per_step = REPLICAS if k == "auto" else k
    assert windows.examples_per_step <= 32 * per_step / REPLICAS + 8


def test_one_replica_applies_every_batch_as_a_step():
    strategy = tf_diffmap.Strategy(devices=["CPU:0"])
    assert strategy.gradients_per_step == 1
    x, y = classification_data(64)
    with strategy.scope():
        model = mlp()
        compile_logits(model, "adam")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == strategy.version == 4
    assert strategy.statistics().steps is None


def test_concurrent_pushes_land_in_exactly_one_window_each():
    """Pushes from many threads at once: each window holds exactly K
    pushes, and every pushed gradient is in exactly one window."""
    strategy = tf_diffmap.Strategy()
    store = strategy.extended.runtime.store
    pushes, k = 240, 3
    with tf.init_scope():
        variable = tf.Variable(tf.zeros([pushes]))
    accumulators = Accumulators(store, [variable], k, Gate(store.host, REPLICAS))

    @tf.function(autograph=False)
    def push(index):
        window = accumulators.push([tf.one_hot(index, pushes)], tf.constant(True))
        return window.taken, window.pushes, window.weight, window.sums[0]

    windows, lock = [], threading.Lock()

    def run(indices):
        for i in indices:
            taken, count, weight, total = push(tf.constant(i))
            if bool(taken):
                with lock:
                    windows.append((int(count), float(weight), total.numpy()))

    threads = [threading.Thread(target=run, args=(range(t, pushes, 8),)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(windows) == pushes // k
    assert all(count == k and weight == k for count, weight, _ in windows)
    landed = np.sum([total for _, _, total in windows], axis=0)
    np.testing.assert_array_equal(landed, np.ones(pushes))
    assert int(accumulators.pending.numpy()) == 0


def test_a_rejected_push_counts_in_its_window_and_adds_nothing():
    strategy = tf_diffmap.Strategy()
    store = strategy.extended.runtime.store
    with tf.init_scope():
        variable = tf.Variable(tf.zeros([2]))
    accumulators = Accumulators(store, [variable], 2, Gate(store.host, REPLICAS))

    @tf.function(autograph=False)
    def push(value, accepted):
        window = accumulators.push([value], accepted)
        return window.taken, window.weight, window.gradients(4)[0]

    taken, _, _ = push(tf.constant([1.0, 2.0]), tf.constant(True))
    assert not bool(taken)
    taken, weight, gradient = push(tf.constant([100.0, 100.0]), tf.constant(False))
    assert bool(taken) and float(weight) == 1.0
    # The one accepted gradient, scaled from 1 of 4 replicas' to the step's.
    np.testing.assert_allclose(gradient.numpy(), [4.0, 8.0])


def test_gradients_staler_than_the_bound_are_dropped_and_counted():
    x, y = classification_data(512)
    strategy = tf_diffmap.Strategy(max_step_staleness=0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(0.02, replicas=[0]),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, keras.optimizers.SGD(0.05))
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    stats = strategy.statistics()
    # The slow replica's gradients are computed on parameters older than
    # the step that uses them: most of them are dropped.
    assert stats.dropped[0] > 0
    assert int(stats.step_histogram[:, 1:].sum()) >= int(stats.dropped.sum())
    assert stats.overall_max_step_staleness == 0  # of the applied ones
    assert int(stats.updates.sum() + stats.dropped.sum()) == strategy.version
    assert stats.steps == int(model.optimizer.iterations.numpy())


def _embedding_model():
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(200, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_windows_match_dense_ones_on_the_touched_rows(optimizer):
    """A sparse window (the rows of an embedding's lookups, queued) makes
    the step that the same window made dense does, and that plain Keras
    makes on the whole batch. Each id is looked up once: plain Keras' Adam
    squares each lookup's row of an `IndexedSlices` apart, where a dense
    gradient (and the row updates) square their sum."""
    rng = np.random.default_rng(0)
    x = rng.permutation(96).reshape(32, 3).astype("int32")  # rows 96-199: never touched
    # Three labels in four are 1: with balanced labels the output bias'
    # gradient sums to about 0, and Adam's step of a coordinate near its
    # epsilon turns the order in which a window adds (which varies) into
    # differences of 1e-4 of the step.
    y = rng.permutation(np.arange(32) < 24).astype("int32")
    make = {"sgd": lambda: keras.optimizers.SGD(0.5), "adam": lambda: keras.optimizers.Adam(0.1)}
    weights = _embedding_model().get_weights()
    results = {}
    for name, semantics in (("lazy", "lazy"), ("dense", "dense"), ("plain", None)):
        if semantics is None:
            model = _embedding_model()
            model.set_weights(weights)
            compile_logits(model, make[optimizer]())
        else:
            # A patience no replica reaches: the windows are checked, not the timer.
            strategy = tf_diffmap.Strategy(patience_margin=1e4)
            with strategy.scope():
                model = _embedding_model()
                model.set_weights(weights)
                compile_logits(
                    model,
                    tf_diffmap.AsyncOptimizer(make[optimizer](), sparse_updates=semantics),
                )
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        results[name] = model.get_weights()
    touched = np.unique(x)
    # A window sums its gradients in the order they arrive, which varies
    # from run to run; Adam's first step divides each coordinate by its own
    # size. Measured over 5 runs: at most 1.8e-7 beyond rtol.
    atol = 1e-5 if optimizer == "adam" else 1e-6
    for a, b, c in zip(results["lazy"], results["dense"], results["plain"]):
        if a.shape == (200, 4):
            a, b, c = a[touched], b[touched], c[touched]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=atol)


def test_a_partial_window_is_applied_at_the_drain():
    x, y = classification_data(32)
    strategy = tf_diffmap.Strategy(gradients_per_step=3, max_step_staleness=1)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # 4 pushes: a window of 3, then 1 applied when the epoch's end drains.
    assert strategy.statistics().steps == 2 == int(model.optimizer.iterations.numpy())
    assert strategy.extended.runtime.aggregations()[0].pending() == 0


def test_rules_that_change_each_update_are_refused_under_aggregation():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = mlp()
        optimizer = tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1), staleness="linear")
        compile_logits(model, optimizer)
    x, y = classification_data(64)
    with pytest.raises(ValueError, match="gradients_per_step=1"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_auto_rule_is_the_plain_step_under_aggregation_and_drop_counts():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        wrapped = tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        assert wrapped.rule == "none"
        model = mlp()
        dropping = tf_diffmap.AsyncOptimizer(
            keras.optimizers.SGD(0.1), staleness="drop", drop_above=0
        )
        compile_logits(model, dropping)
    x, y = classification_data(512)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    stats = strategy.statistics()
    assert int(stats.updates.sum() + stats.dropped.sum()) == strategy.version
    assert stats.steps == int(model.optimizer.iterations.numpy())


def test_a_custom_loop_optimizer_named_by_the_step_aggregates():
    """A custom training loop's step names its optimizer as a free variable."""
    strategy = tf_diffmap.Strategy(patience_margin=1e4)  # one window per batch

    x, y = classification_data(128)
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_object(labels, model(features, training=True)), global_batch_size=32
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(batch):
        return strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    )
    for batch in data:
        train(batch)
    strategy.drain()
    assert strategy.statistics().steps == 4 == int(optimizer.iterations.numpy())


def test_an_unreachable_optimizer_is_named_in_a_warning():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = mlp()
        holder = {"optimizer": keras.optimizers.SGD(0.1)}

    def step(features):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(features))
        grads = tape.gradient(loss, model.trainable_variables)
        holder["optimizer"].apply_gradients(zip(grads, model.trainable_variables))
        return loss

    import tf_diffmap.updates.aggregation as aggregation

    aggregation._warned_custom = False
    with pytest.warns(UserWarning, match="found no Keras optimizer"):
        tf.function(lambda v: strategy.run(step, args=(v,)))(tf.ones([8, 8]))


class Recommender(keras.Model):
    """Users and movies as embeddings with an L2 regularizer, their dot
    product and biases through a sigmoid (keras-io's collaborative
    filtering model)."""

    def __init__(self, users, movies, width=8, coupled=False):
        super().__init__()
        self.coupled = coupled
        regularizer = keras.regularizers.l2(1e-6)
        self.user = keras.layers.Embedding(users, width, embeddings_regularizer=regularizer)
        self.user_bias = keras.layers.Embedding(users, 1)
        self.movie = keras.layers.Embedding(movies, width, embeddings_regularizer=regularizer)
        self.movie_bias = keras.layers.Embedding(movies, 1)

    def call(self, inputs):
        user, movie = self.user(inputs[:, 0]), self.movie(inputs[:, 1])
        if self.coupled:
            # As keras-io's example writes it: a sum over the whole batch too.
            dot = tf.tensordot(user, movie, 2)
        else:
            dot = tf.reduce_sum(user * movie, axis=1, keepdims=True)
        return tf.nn.sigmoid(dot + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1]))


def _ratings(users=300, movies=400, n=24_000, seed=0):
    rng = np.random.default_rng(seed)
    truth_u, truth_m = rng.normal(size=(users, 4)), rng.normal(size=(movies, 4))
    pairs = np.stack([rng.integers(0, users, n), rng.integers(0, movies, n)], axis=1)
    scores = np.sum(truth_u[pairs[:, 0]] * truth_m[pairs[:, 1]], axis=1) / 2
    ratings = 1 / (1 + np.exp(-scores)) + rng.normal(scale=0.05, size=n)
    return pairs.astype("int32"), np.clip(ratings, 0, 1).astype("float32")


@pytest.mark.parametrize("coupled", [False, True], ids=["per_example", "batch_coupled"])
def test_a_regularized_embedding_trained_with_adam_matches_plain_keras(coupled):
    """The regularizer makes each table's gradient dense: one dense Adam
    step per batch, as plain Keras takes, not one per shard."""
    x, y = _ratings()
    train, val = slice(0, 20_000), slice(20_000, None)
    losses = {}
    for name in ("plain", "tf_diffmap"):
        keras.utils.set_random_seed(0)
        strategy = tf_diffmap.Strategy() if name == "tf_diffmap" else None
        with strategy.scope() if strategy is not None else _no_scope():
            model = Recommender(300, 400, coupled=coupled)
            model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
        model.fit(x[train], y[train], batch_size=64, epochs=3, verbose=0)
        losses[name] = float(model.evaluate(x[val], y[val], batch_size=512, verbose=0))
    assert losses["tf_diffmap"] <= 1.10 * losses["plain"], losses
