"""`AsyncOptimizer`: a composing wrapper whose rules do what they say."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp

LR = 0.125  # a power of two: multiples of it are exact in float32


def constant_gradient_model():
    """With x of ones, the summed output has gradient 1 for every weight."""
    return keras.Sequential(
        [
            keras.Input((4,)),
            tf_diffmap.testing.ReplicaDelay(0.02, replicas=[0]),
            keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
        ]
    )


def summed_output(y_true, y_pred):
    return tf.reduce_sum(tf.cast(y_pred, tf.float32), axis=-1)


def train_constant(optimizer_fn, **strategy_kwargs):
    """Two epochs of a constant gradient. By default every shard's gradient
    is a step of its own (`gradients_per_step=1`), where the per-update
    rules apply."""
    strategy_kwargs.setdefault("gradients_per_step", 1)
    strategy = tf_diffmap.Strategy(**strategy_kwargs)
    with strategy.scope():
        model = constant_gradient_model()
        model.compile(optimizer=optimizer_fn(), loss=summed_output)
    x, y = np.ones((512, 4), "float32"), np.zeros((512, 3), "float32")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return strategy, model


def test_delegates_to_the_inner_optimizer():
    with tf_diffmap.Strategy().scope():
        inner = keras.optimizers.Adam(learning_rate=0.01)
        optimizer = tf_diffmap.AsyncOptimizer(inner, staleness="inverse")
    assert optimizer.iterations is inner.iterations
    assert float(optimizer.learning_rate) == pytest.approx(0.01)
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight_decay": 0.1}, "does not take `weight_decay`: set it on the inner optimizer"),
        ({"clipnorm": 1.0}, "does not take `clipnorm`"),
        (
            {"weight_decay": 0.1, "clipnorm": 1.0},
            "does not take `weight_decay`, `clipnorm`: set them on the inner optimizer",
        ),
        ({"momentum": 0.9}, "does not support the argument `momentum`;"),
        ({"momentum": 0.9, "nesterov": True}, "the arguments `momentum`, `nesterov`;"),
        ({"staleness": "sqrt"}, "staleness must be one of"),
        ({"staleness": "drop"}, "needs drop_above"),
        ({"drop_above": -1}, "drop_above must be an int >= 0, received -1"),
        ({"dc_momentum": 1.0}, "dc_momentum must be in"),
        ({"staleness_decay": 1.0}, "staleness_decay must be in"),
        ({"gap_decay": -0.1}, "gap_decay must be in"),
        ({"staleness": "momentum"}, "SGD with momentum > 0.*momentum 0.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(), **kwargs)


def test_the_momentum_rule_names_the_optimizer_class_it_was_given():
    with pytest.raises(ValueError) as raised:
        tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-3), staleness="momentum")
    message = str(raised.value)
    assert "received Adam with momentum 0.0" in message
    assert "<" not in message and "object at" not in message


def test_wraps_only_optimizers():
    with pytest.raises(ValueError, match="wraps a keras.optimizers.Optimizer instance"):
        tf_diffmap.AsyncOptimizer("adam")


@pytest.mark.parametrize(
    "inner, rule",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "linear"),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), "linear"),
        (lambda: keras.optimizers.SGD(0.1), "gap"),
        (lambda: keras.optimizers.Adam(1e-3), "none"),
        (lambda: keras.optimizers.AdamW(1e-3), "none"),
        (lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9), "none"),
    ],
)
def test_auto_picks_a_rule_per_optimizer(inner, rule):
    optimizer = tf_diffmap.AsyncOptimizer(inner())
    assert optimizer.staleness == "auto" and optimizer.rule == rule


def test_config_round_trip():
    optimizer = tf_diffmap.AsyncOptimizer(
        keras.optimizers.SGD(0.3, momentum=0.5), staleness="dc", dc_lambda=0.1, drop_above=7
    )
    clone = tf_diffmap.AsyncOptimizer.from_config(optimizer.get_config())
    assert clone.staleness == "dc" and clone.drop_above == 7 and clone.dc_lambda == 0.1
    assert isinstance(clone.inner_optimizer, keras.optimizers.SGD)
    assert clone.inner_optimizer.momentum == 0.5
    assert float(clone.learning_rate) == pytest.approx(0.3)
    default = tf_diffmap.AsyncOptimizer(
        keras.optimizers.SGD(0.3, momentum=0.5), staleness_decay=0.5
    )
    clone = tf_diffmap.AsyncOptimizer.from_config(default.get_config())
    assert clone.staleness == "auto" and clone.staleness_decay == 0.5
    gap = tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(), staleness="gap", gap_decay=0.9)
    clone = tf_diffmap.AsyncOptimizer.from_config(gap.get_config())
    assert clone.staleness == "gap" and clone.gap_decay == 0.9


def test_model_with_async_optimizer_saves_and_loads(tmp_path):
    x, y = classification_data(256)
    strategy = tf_diffmap.Strategy(gradients_per_step=1)
    with strategy.scope():
        model = mlp()
        compile_logits(
            model, tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-2), staleness="inverse")
        )
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, tf_diffmap.AsyncOptimizer)
    assert loaded.optimizer.staleness == "inverse"
    np.testing.assert_allclose(loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0))


@pytest.mark.parametrize("inner", ["sgd", "sgd_momentum", "adam"])
@pytest.mark.parametrize("rule", ["none", "dc", "gap", "auto"])
def test_one_replica_equals_the_inner_optimizer(inner, rule):
    """Staleness is 0 with one replica: every rule reduces to the inner one."""
    make = {
        "sgd": lambda: keras.optimizers.SGD(0.05),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(1e-2),
    }
    x, y = classification_data(256)
    plain = mlp()
    initial = plain.get_weights()
    compile_logits(plain, make[inner]())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy, model = async_mlp(
        lambda: tf_diffmap.AsyncOptimizer(make[inner](), staleness=rule), devices=["CPU:1"]
    )
    model.set_weights(initial)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_without_a_strategy_it_is_the_inner_optimizer():
    x, y = classification_data(128)
    plain = mlp()
    initial = plain.get_weights()
    compile_logits(plain, keras.optimizers.SGD(0.1))
    wrapped = mlp()
    wrapped.set_weights(initial)
    compile_logits(wrapped, tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1), "inverse"))
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    wrapped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_inverse_rule_scales_each_update_by_its_staleness():
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(LR), staleness="inverse")
    )
    stats = strategy.statistics()
    assert int(stats.updates.sum()) == 2 * 16 * 4
    total_scale = float(stats.lr_scale_sum.sum())
    assert total_scale < stats.updates.sum()  # some updates were stale
    np.testing.assert_allclose(model.get_weights()[0], -LR * total_scale, rtol=1e-5)


def test_momentum_rule_scales_the_learning_rate_by_the_smoothed_staleness():
    # With staleness_decay=0 the smoothed staleness is each update's own, so
    # each factor is 1 / (1 + staleness), and their sum follows the histogram.
    strategy, _ = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(
            keras.optimizers.SGD(LR, momentum=0.5), staleness="momentum", staleness_decay=0.0
        )
    )
    stats = strategy.statistics()
    histogram = stats.histogram.sum(axis=0)
    assert histogram[-1] == 0  # no staleness in the open-ended last bin
    expected = sum(count / (1 + s) for s, count in enumerate(histogram))
    assert expected < stats.updates.sum()  # some updates were stale
    assert float(stats.lr_scale_sum.sum()) == pytest.approx(expected, rel=1e-5)


def test_linear_rule_divides_every_update_by_the_replica_count():
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(LR), staleness="linear")
    )
    stats = strategy.statistics()
    updates = int(stats.updates.sum())
    assert updates == 2 * 16 * 4 and stats.num_replicas == 4
    np.testing.assert_allclose(stats.mean_lr_scale, 0.25)
    assert str(stats).count("learning-rate factor 0.25") == 4
    # Whatever each update's staleness, it moved LR / 4: exact in float32.
    np.testing.assert_array_equal(
        model.get_weights()[0], np.full((4, 3), -LR / 4 * updates, "float32")
    )


def test_gap_rule_learns_the_typical_step_from_the_steps_taken():
    # One replica, a constant gradient of 1: each update steps exactly -LR, so
    # the bias-corrected mean square of the steps is LR**2, and no gap is seen.
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(LR), staleness="gap"),
        devices=["CPU:1"],
    )
    optimizer = model.optimizer
    (square,) = optimizer._step_squares.values()
    weight = float(optimizer._step_weight.numpy())
    assert weight == pytest.approx(1 - 0.99 ** (2 * 16), rel=1e-5)
    np.testing.assert_allclose(square.numpy() / weight, LR**2, rtol=1e-4)
    np.testing.assert_array_equal(model.get_weights()[0], np.full((4, 3), -LR * 32, "float32"))


def test_gap_rule_shrinks_only_the_updates_whose_parameters_moved():
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(LR), staleness="gap")
    )
    stats = strategy.statistics()
    assert stats.overall_max_staleness > 0  # replica 0 is slow: its updates are stale
    moved = -model.get_weights()[0]
    full = LR * int(stats.updates.sum())
    # Stale updates met parameters that others had moved: they took smaller
    # steps. Fresh ones (staleness 0) were not penalized, so most of the
    # distance is still covered.
    assert np.all(moved < full - LR / 2), (moved, full)
    assert np.all(moved > full * int(stats.histogram[:, 0].sum()) / int(stats.updates.sum()))


def test_drop_rule_skips_stale_updates_and_counts_them():
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(LR), staleness="drop", drop_above=1)
    )
    stats = strategy.statistics()
    applied, dropped = int(stats.updates.sum()), int(stats.dropped.sum())
    assert applied + dropped == 2 * 16 * 4 == strategy.version
    assert dropped > 0
    np.testing.assert_array_equal(model.get_weights()[0], np.full((4, 3), -LR * applied, "float32"))
    assert int(model.optimizer.iterations.numpy()) == applied
    assert int(stats.staleness_max.max()) <= 1


def test_callable_rule_sets_the_learning_rate_factor():
    strategy, model = train_constant(
        lambda: tf_diffmap.AsyncOptimizer(
            keras.optimizers.SGD(LR),
            staleness=lambda s: tf.constant(0.5) + 0.0 * tf.cast(s, tf.float32),
        )
    )
    updates = strategy.version
    np.testing.assert_array_equal(
        model.get_weights()[0], np.full((4, 3), -LR * 0.5 * updates, "float32")
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize(
    "wrapped, per_step", [(False, 1), (True, 1), (False, "auto")], ids=["plain", "linear", "steps"]
)
def test_mixed_precision_keeps_updates_exact(policy, wrapped, per_step):
    """Loss scaling (float16) is undone before the update (or the push), and only that."""
    keras.mixed_precision.set_global_policy(policy)
    try:

        def optimizer():
            sgd = keras.optimizers.SGD(LR)
            return tf_diffmap.AsyncOptimizer(sgd, staleness="linear") if wrapped else sgd

        strategy, model = train_constant(optimizer, gradients_per_step=per_step)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    updates = strategy.version
    assert updates == 2 * 16 * 4
    if per_step == 1:
        # Wrapped with "linear": every step divided by the 4 replicas, exactly.
        moved = (LR / 4 if wrapped else LR) * updates
    else:
        # Each step is its window's examples-weighted mean gradient: the
        # constant one. Replica 0 straggles (0.02 s a shard): windows it
        # misses are filled by the others, its late gradients dropped.
        stats = strategy.statistics()
        windows = strategy.window_statistics()
        assert stats.steps == windows.windows == int(model.optimizer.iterations.numpy())
        assert stats.steps > 0
        assert windows.examples + windows.skipped == 2 * 512
        moved = LR * stats.steps
    np.testing.assert_array_equal(model.get_weights()[0], np.full((4, 3), -moved, "float32"))


@pytest.mark.parametrize(
    "bound, colocate", [(0, True), (2, True), (2, False)], ids=["0", "2", "2_own_devices"]
)
def test_bounded_staleness_is_never_exceeded(bound, colocate):
    x, y = classification_data(1024)
    # Asynchronous windows: fresh ones keep replicas in step already.
    strategy = tf_diffmap.Strategy(
        max_staleness=bound, colocate_cpu_replicas=colocate, max_step_staleness=1
    )
    spreads = []

    class Spread(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps = strategy.replica_steps()
            spreads.append(max(steps) - min(steps))

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(0.02, replicas=[0]),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Spread()])
    stats = strategy.statistics()
    assert stats.overall_max_staleness <= tf_diffmap.staleness_bound(4, bound)
    # Fast replicas use the slack the bound gives, and no more.
    assert max(spreads) <= bound + 1
    assert max(spreads) >= bound
    waited = strategy.seconds_held_back()
    assert max(waited[1:]) > 0


@pytest.mark.parametrize("per_step", [1, "auto"])
def test_skipped_float16_steps_claim_no_version(per_step):
    """A loss-scaled step with non-finite gradients applies (or pushes)
    nothing, claims nothing."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        strategy = tf_diffmap.Strategy(gradients_per_step=per_step)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
                ]
            )
            model.compile(optimizer=keras.optimizers.SGD(LR), loss=summed_output)
        x = np.ones((256, 4), "float32")
        x[:32] = 6e4  # the first batch overflows float16 once loss-scaled
        model.fit(
            x, np.zeros((256, 3), "float32"), batch_size=32, epochs=1, shuffle=False, verbose=0
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    store = strategy.extended.runtime.store
    assert strategy.version < 8 * 4
    assert store.completed_claims() == strategy.version
    weights = model.get_weights()[0]
    assert np.all(np.isfinite(weights))
    # Per shard, each update moved LR; aggregated, each step did (a step's
    # gradient is the batch's, whatever its number of gradients).
    steps = strategy.statistics().steps
    moved = LR * (strategy.version if per_step == 1 else steps)
    if per_step != 1:
        assert 0 < steps < strategy.version
    np.testing.assert_array_equal(weights, np.full((4, 3), -moved, "float32"))


def test_loss_scale_is_read_once_per_replica_step():
    """Another replica may halve the scale between a step's two reads of it."""
    from tf_diffmap.updates.step import tracing_step

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        scale = tf.Variable(2.0)
        plain = tf.Variable(2.0)
    scale.snapshot_in_steps()

    @tf.function
    def step():
        with tracing_step(None):
            reads = []
            for variable in (scale, plain):
                first = variable.read_value()
                variable.assign(first * 0.5)  # as a skipped step elsewhere would
                # Read again inside a branch, as Keras unscales gradients.
                again = tf.cond(tf.constant(True), variable.read_value, lambda first=first: first)
                reads.append((first, again))
            return reads

    (scale_first, scale_again), (plain_first, plain_again) = step()
    assert float(scale_first) == float(scale_again) == 2.0
    assert float(plain_first) == 2.0 and float(plain_again) == 1.0  # what it guards against
    assert float(scale.numpy()) == float(plain.numpy()) == 1.0


def test_no_learning_rate_factor_is_reported_where_no_rule_scales_it():
    """A plain optimizer (and a rule that scales no learning rate) reports no
    factor: the statistics say only what applies."""
    for make in (
        lambda: keras.optimizers.Adam(1e-3),
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-3)),  # "none"
    ):
        strategy, _ = train_constant(make)
        stats = strategy.statistics()
        assert stats.updates.sum() + stats.dropped.sum() == 2 * 16 * 4
        assert stats.lr_scale_sum is None
        np.testing.assert_array_equal(stats.mean_lr_scale, 1.0)
        assert "learning-rate factor" not in str(stats)
