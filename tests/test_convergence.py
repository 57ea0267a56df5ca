"""Every staleness rule still trains a real problem with a straggler.

scikit-learn's bundled digits (no download), 4 logical CPU replicas, replica 0
slowed so that its updates arrive stale.
"""

import keras
import numpy as np
import pytest

import tf_diffmap

# Per rule: the `AsyncOptimizer`'s arguments (None: the plain optimizer) and
# the strategy's. The per-update rules apply where every shard's gradient is
# a step of its own; the others run with the default aggregation.
PER_SHARD = {"gradients_per_step": 1}
RULES = {
    "plain optimizer": (None, {}),
    "none": ({"staleness": "none"}, {}),
    "drop": ({"staleness": "drop", "drop_above": 6}, {}),
    "every gradient accepted": (None, {"max_step_staleness": None}),
    "plain optimizer per shard": (None, PER_SHARD),
    "inverse": ({"staleness": "inverse"}, PER_SHARD),
    "dc": ({"staleness": "dc"}, PER_SHARD),
}


@pytest.mark.parametrize("rule", RULES)
def test_rule_converges_with_a_straggler(rule, digits):
    x, y, x_val, y_val = digits
    wrapper, strategy_kwargs = RULES[rule]
    strategy = tf_diffmap.Strategy(**strategy_kwargs)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                tf_diffmap.testing.ReplicaDelay(0.01, replicas=[0]),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        optimizer = keras.optimizers.Adam(3e-3)
        if wrapper is not None:
            optimizer = tf_diffmap.AsyncOptimizer(optimizer, **wrapper)
        model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=8, verbose=0)
    accuracy = model.evaluate(x_val, y_val, verbose=0)[1]
    stats = strategy.statistics()
    assert accuracy > 0.9, (rule, accuracy, str(stats))
    # The straggler really was one: its updates were fewer and staler. The
    # staleness of every claim counts, dropped ones too (the histogram): the
    # `drop` rule applies only the straggler's freshest updates.
    claims = stats.updates + stats.dropped
    assert claims[0] < claims[1:].min()
    bins = np.arange(stats.histogram.shape[1])
    claimed_staleness = (stats.histogram * bins).sum(axis=1) / stats.histogram.sum(axis=1)
    assert claimed_staleness[0] > claimed_staleness[1:].max()
