"""Weight regularizers: replicas push their data's gradient, the store adds
the penalty's gradient once per optimizer step."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tf_diffmap import _tf_internal
from tf_diffmap.store.accumulators import _Dense, _Sparse
from tf_diffmap.updates import aggregation, penalties

# A table of 320 KiB: large enough that a replica step reads it by rows
# (`_tf_internal.ROWS_READ_BYTES`), the penalty's read whole.
ROWS = 20_000


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _model(bias_regularizer=None):
    """A table with an L2 penalty, a Dense kernel with one, and a plain Dense."""
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(
                ROWS, 4, embeddings_regularizer=keras.regularizers.l2(0.05), name="table"
            ),
            keras.layers.Flatten(),
            keras.layers.Dense(
                8,
                activation="tanh",
                kernel_regularizer=keras.regularizers.l1_l2(l1=0.01, l2=0.05),
                bias_regularizer=bias_regularizer,
                name="hidden",
            ),
            keras.layers.Dense(2, name="out"),
        ]
    )


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    # Rows 48 and up are never looked up: only the penalty moves them.
    x = rng.integers(0, 48, size=(n, 3)).astype("int32")
    y = (x.sum(axis=1) % 2).astype("int32")
    return x, y


def _fit(strategy, optimizer_fn, weights, batch_size, epochs=1, n=64, model_fn=_model):
    x, y = _data(n)
    with strategy.scope() if strategy is not None else _no_scope():
        model = model_fn()
        model.set_weights(weights)
        model.compile(
            optimizer_fn(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.05),
    # The loss is scaled by 64, every gradient unscaled by the optimizer.
    "sgd_loss_scaled": lambda: keras.optimizers.SGD(0.5, loss_scale_factor=64.0),
    # Unscaled per push by the wrapper; the store's penalty is not scaled.
    "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=256.0
    ),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_regularized_steps_equal_plain_keras_and_the_table_is_pushed_sparse(optimizer):
    """Fresh windows with a patience no replica reaches: 8 steps of 4
    replicas equal plain Keras' 8 steps with the same regularizers, the
    rows no lookup touches included (only the penalty moves them), and the
    reported loss (the penalties' value included) is plain Keras' too."""
    assert ROWS * 4 * 4 >= _tf_internal.ROWS_READ_BYTES  # the table is read by rows
    weights = _model().get_weights()
    plain, plain_loss = _fit(None, OPTIMIZERS[optimizer], weights, batch_size=16, epochs=2)
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    ours, our_loss = _fit(strategy, OPTIMIZERS[optimizer], weights, batch_size=16, epochs=2)
    windows = strategy.window_statistics()
    assert windows.windows == 8 == int(ours.optimizer.iterations.numpy())
    assert windows.closed_short == 0 and int(strategy.statistics().dropped.sum()) == 0
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    untouched = plain.get_weights()[0][48:]
    assert np.abs(untouched - weights[0][48:]).max() > 1e-3  # the penalty moved them
    np.testing.assert_allclose(our_loss, plain_loss, rtol=1e-4)
    (taken,) = strategy.extended.runtime.aggregations()
    kinds = taken.accumulators._kinds
    variables = [v.path.split("/", 1)[1] for v in taken.variables]
    table = variables.index("table/embeddings")
    assert isinstance(kinds[table], _Sparse)
    assert all(isinstance(kinds[i], _Dense) for i in kinds if i != table)
    assert {variables[i] for i in taken.penalties} == {"table/embeddings", "hidden/kernel"}


def test_without_the_store_s_share_the_steps_would_differ(monkeypatch):
    """The test above can fail: the same training without the penalties'
    gradient added on the store moves away from plain Keras."""
    weights = _model().get_weights()
    plain, _ = _fit(None, OPTIMIZERS["sgd"], weights, batch_size=16)
    monkeypatch.setattr(aggregation, "add_penalty_gradients", lambda gradients, *_: gradients)
    ours, _ = _fit(tf_diffmap.Strategy(patience_margin=1e4), OPTIMIZERS["sgd"], weights, 16)
    gap = max(np.abs(a - b).max() for a, b in zip(ours.get_weights(), plain.get_weights()))
    assert gap > 1e-3


def test_asynchronous_windows_take_the_penalty_once_per_step():
    """Asynchronous windows (`max_step_staleness=1`): the store adds the
    penalty's gradient at the parameters it steps. With one batch a window
    of 4 is plain Keras' step; over many the result stays near it."""
    weights = _model().get_weights()
    plain, _ = _fit(None, OPTIMIZERS["sgd"], weights, batch_size=64, n=64)
    strategy = tf_diffmap.Strategy(max_step_staleness=1)
    ours, _ = _fit(strategy, OPTIMIZERS["sgd"], weights, batch_size=64, n=64)
    assert int(ours.optimizer.iterations.numpy()) == 1
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    (taken,) = strategy.extended.runtime.aggregations()
    assert len(taken.penalties) == 2


def test_a_step_per_push_keeps_the_penalty_in_each_replica_s_gradient():
    """`gradients_per_step=1`: every push is a step of its own, its
    penalty's gradient computed by its replica as before (nothing split)."""
    weights = _model().get_weights()
    strategy = tf_diffmap.Strategy(gradients_per_step=1)
    ours, losses = _fit(strategy, OPTIMIZERS["sgd"], weights, batch_size=16)
    assert not strategy.extended.runtime.aggregations()
    assert int(ours.optimizer.iterations.numpy()) == strategy.version
    assert np.isfinite(losses).all()
    untouched = ours.get_weights()[0][48:]
    assert np.abs(untouched - weights[0][48:]).max() > 1e-3  # the penalty moved them


class _Wrapping(keras.Model):
    """The regularized model inside a model with a custom `train_step`."""

    def __init__(self):
        super().__init__()
        self.body = _model()

    def call(self, inputs):
        return self.body(inputs)


class OwnPenalty(_Wrapping):
    """A custom `train_step` that adds its own L2 penalty on the table and
    leaves `model.losses` out."""

    def train_step(self, data):
        x, y = data
        table = self.body.get_layer("table").embeddings
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_mean(loss) + 0.05 * tf.reduce_sum(tf.square(table))
            loss = loss / tf.distribute.get_strategy().num_replicas_in_sync
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_a_custom_train_step_s_own_penalty_stays_per_replica_and_is_named_once():
    """A custom step that adds its own penalty: nothing is split (its
    table's pushes stay dense), and a warning says once what happens."""
    penalties._warned.clear()
    x, y = _data()
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    with strategy.scope():
        model = OwnPenalty()
        model.compile(keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match="did not take the regularizers") as caught:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert sum("did not take the regularizers" in str(w.message) for w in caught) == 1
    (taken,) = strategy.extended.runtime.aggregations()
    assert taken.penalties == {}
    assert all(isinstance(k, _Dense) for k in taken.accumulators._kinds.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


class OwnTableUpdate(_Wrapping):
    """A custom `train_step` that takes the penalties from `model.losses`
    but updates the table itself, not through the optimizer."""

    def train_step(self, data):
        x, y = data
        table = self.body.get_layer("table").embeddings
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        rest = [(g, v) for g, v in zip(grads, variables) if v is not table]
        self.optimizer.apply_gradients(rest)
        table.assign_sub(0.5 * tf.convert_to_tensor(grads[variables.index(table)]))
        return {"loss": loss}


def test_a_penalty_no_aggregated_optimizer_applies_stays_in_the_replica_s_gradient():
    """The table's gradient, penalty included, is applied by the step
    itself: nothing is split (the step is traced again without), the rows
    only the penalty moves move, and a warning says so once."""
    penalties._warned.clear()
    x, y = _data()
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    with strategy.scope():
        model = OwnTableUpdate()
        model.compile(
            keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    before = model.body.get_layer("table").embeddings.numpy()
    with pytest.warns(UserWarning, match="not applied through an optimizer") as caught:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert sum("not applied through" in str(w.message) for w in caught) == 1
    (taken,) = strategy.extended.runtime.aggregations()
    assert taken.penalties == {}
    after = model.body.get_layer("table").embeddings.numpy()
    assert np.abs(after[48:] - before[48:]).max() > 1e-3


def test_regularizers_are_as_they_were_after_tracing():
    strategy = tf_diffmap.Strategy(patience_margin=1e4)
    with strategy.scope():
        model = _model()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    regularizers = [v.regularizer for v in model.trainable_weights]
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0)
    assert [v.regularizer for v in model.trainable_weights] == regularizers
    assert not any(isinstance(r, penalties.SplitPenalty) for r in regularizers)
    # Evaluation reports the penalties' value, as plain Keras does.
    loss = model.evaluate(*_data(), batch_size=64, verbose=0)
    plain = _model()
    plain.set_weights(model.get_weights())
    plain.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    np.testing.assert_allclose(loss, plain.evaluate(*_data(), batch_size=64, verbose=0), rtol=1e-5)
