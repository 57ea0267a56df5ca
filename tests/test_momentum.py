"""Momentum under asynchrony: when the warning is due, and what it says.

Where staleness is real, `test_convergence_regimes.py` trains momentum SGD
under the default, which aggregates shard gradients into steps; the
warning's advice (an `AsyncOptimizer` rule) is for a step per shard.
"""

import dataclasses
import inspect
import warnings

import keras
import numpy as np
import pytest

import tf_diffmap
from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.updates.momentum import MomentumWatch, momentum_warning


def stats(mean_staleness: float, updates: int = 100, replicas: int = 4) -> StalenessStats:
    per = np.full(replicas, updates // replicas)
    return StalenessStats(
        version=int(per.sum()),
        updates=per,
        dropped=np.zeros(replicas, np.int64),
        staleness_sum=(per * mean_staleness).astype(np.int64),
        staleness_max=np.full(replicas, 2 * int(mean_staleness)),
        histogram=np.zeros((replicas, 64), np.int64),
    )


def sgd_momentum():
    return keras.optimizers.SGD(0.2, momentum=0.9)


def test_warning_names_the_momentum_the_staleness_and_the_fix():
    message = momentum_warning(sgd_momentum(), stats(9.0))
    # 9 / (1 + 9) = 0.9 added to 0.9: a total of 1.8.
    assert "momentum 0.9" in message
    assert "mean staleness is 9.0 (max 18) over 4 replicas" in message
    assert "about 0.90 of momentum" in message and "a total of 1.80" in message
    assert "tf_diffmap.AsyncOptimizer" in message and 'staleness="linear"' in message
    assert "number of replicas (4)" in message


@pytest.mark.parametrize(
    "optimizer, mean_staleness, min_updates",
    [
        (lambda: keras.optimizers.SGD(0.2, momentum=0.5), 0.9, 0),  # 0.5 + 0.47 < 1
        (lambda: keras.optimizers.SGD(0.2), 9.0, 0),  # no momentum of its own
        (lambda: keras.optimizers.Adam(1e-3), 9.0, 0),
        (lambda: tf_diffmap.AsyncOptimizer(sgd_momentum()), 9.0, 0),  # the default corrects
        (lambda: tf_diffmap.AsyncOptimizer(sgd_momentum(), staleness="momentum"), 9.0, 0),
        (sgd_momentum, 9.0, 1000),  # too few updates measured yet
    ],
)
def test_no_warning_when_nothing_is_wrong_yet(optimizer, mean_staleness, min_updates):
    assert momentum_warning(optimizer(), stats(mean_staleness), min_updates) is None


def test_no_warning_where_gradients_are_aggregated_into_steps():
    """The optimizer then takes the steps of synchronous training."""
    aggregated = dataclasses.replace(stats(8.0), steps=25)
    assert momentum_warning(sgd_momentum(), aggregated) is None
    assert momentum_warning(sgd_momentum(), stats(8.0)) is not None


def test_an_uncorrected_rule_is_warned_about():
    optimizer = tf_diffmap.AsyncOptimizer(sgd_momentum(), staleness="dc")
    assert momentum_warning(optimizer, stats(9.0)) is not None


def test_watch_warns_once_and_reads_statistics_only_when_it_checks():
    watch = MomentumWatch(check_every=2, min_updates=0)
    reads = []

    def read():
        reads.append(1)
        return stats(9.0)

    watch.check(read)  # nothing watched yet
    watch.watch(keras.optimizers.Adam())
    watch.check(read)
    assert reads == []
    watch.watch(sgd_momentum())
    with pytest.warns(UserWarning, match="momentum 0.9") as caught:
        for _ in range(6):
            watch.check(read)
    assert len(caught) == 1 and len(reads) == 1
    watch.watch(watch._optimizer)  # the same model again: already warned
    watch.check(read)
    watch.check(read)
    assert len(reads) == 1
    with pytest.warns(UserWarning, match="momentum 0.9"):  # a new model's optimizer
        watch.watch(sgd_momentum())
        watch.check(read)
        watch.check(read)


def test_the_warning_from_fit_names_the_users_line(data):
    """The warning is due at an epoch's end, deep inside Keras' `fit` and the
    strategy's drain; it names the line that called `fit`, not the package's."""
    x, y = data
    strategy = tf_diffmap.Strategy(gradients_per_step=1)
    with strategy.scope():
        # Replica 0 computes each gradient while the others push theirs, so
        # that its updates are stale and momentum is added: replicas that
        # ran in step could leave no update stale, and no warning due.
        delay = tf_diffmap.testing.ReplicaDelay(0.01, replicas=[0])
        model = keras.Sequential([keras.Input((8,)), delay, keras.layers.Dense(2)])
        model.compile(
            keras.optimizers.SGD(0.01, momentum=0.999),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # Check at every drain, trusting the first update: momentum 0.999 plus
    # any staleness's own is past 1.
    watch = strategy.extended.runtime.momentum_watch
    watch.check_every, watch.min_updates = 1, 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    found = [w for w in caught if "applies momentum 0.999" in str(w.message)]
    assert strategy.statistics().overall_mean_staleness > 0
    assert len(found) == 1, [str(w.message) for w in caught]
    assert (found[0].filename, found[0].lineno) == (__file__, line)
