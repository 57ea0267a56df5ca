"""On one host the strategy needs nothing of the cluster's package."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tf_diffmap

    tf_diffmap.split_devices(2)

    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(data, epochs=2, verbose=0)
    model.evaluate(data, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    assert [r.state for r in strategy.replica_states()] == ["stopped", "stopped"], (
        strategy.replica_states()
    )
    # Two epochs of 8 batches, each split into a shard per replica.
    assert sum(strategy.replica_steps()) == 2 * 8 * 2, strategy.replica_steps()
    strategy.shutdown()
    print([m for m in sys.modules if m.startswith("tf_diffmap.cluster")])
    """
)


@pytest.mark.slow  # a process of its own
def test_training_on_one_host_imports_nothing_of_the_cluster():
    # A process of its own: modules that other tests imported do not count.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
