"""What is saved is what was trained, and loads without tf_diffmap."""

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp


def trained(tmp_path, optimizer=lambda: "adam"):
    x, y = classification_data(256)
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.BatchNormalization()(h)
        model = keras.Model(inputs, keras.layers.Dense(2)(h))
        compile_logits(model, optimizer())
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return strategy, model, x, y


@pytest.mark.slow  # a process of its own
def test_keras_file_round_trip_and_load_without_the_package(tmp_path):
    strategy, model, x, _ = trained(tmp_path)
    path = tmp_path / "model.keras"
    model.save(path)
    expected = model.predict(x[:16], verbose=0)
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x[:16], verbose=0), expected, rtol=1e-6)
    np.save(tmp_path / "x.npy", x[:16])
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, keras
        model = keras.models.load_model({str(path)!r})
        got = model.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
        np.testing.assert_allclose(got, np.load({str(tmp_path / "expected.npy")!r}), rtol=1e-5)
        assert "tf_diffmap" not in sys.modules
        print("loaded without tf_diffmap")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loaded without tf_diffmap" in result.stdout


@pytest.mark.slow  # a process of its own
def test_keras_file_with_async_optimizer_loads_as_the_readme_says(tmp_path):
    """A `.keras` file names its optimizer's class: without tf_diffmap it
    loads with `compile=False` (and Keras' error names the module to import);
    with `import tf_diffmap` first it loads whole, AsyncOptimizer and all."""
    _, model, x, _ = trained(
        tmp_path,
        lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
    )
    path = tmp_path / "async.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x[:16])
    np.save(tmp_path / "expected.npy", model.predict(x[:16], verbose=0))
    check = textwrap.dedent(
        f"""
        got = model.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
        np.testing.assert_allclose(got, np.load({str(tmp_path / "expected.npy")!r}), rtol=1e-5)
        """
    )
    without = (
        textwrap.dedent(
            f"""
        import sys, numpy as np, keras
        try:
            keras.models.load_model({str(path)!r})
        except TypeError as error:
            assert "tf_diffmap.updates.optimizer" in str(error), error
            assert "AsyncOptimizer" in str(error), error
        else:
            raise AssertionError("loaded an AsyncOptimizer without tf_diffmap")
        model = keras.models.load_model({str(path)!r}, compile=False)
        """
        )
        + check
        + textwrap.dedent(
            """
        assert "tf_diffmap" not in sys.modules
        print("predicts without tf_diffmap")
        """
        )
    )
    whole = (
        textwrap.dedent(
            f"""
        import numpy as np, keras, tf_diffmap
        model = keras.models.load_model({str(path)!r})
        """
        )
        + check
        + textwrap.dedent(
            """
        optimizer = model.optimizer
        assert isinstance(optimizer, tf_diffmap.AsyncOptimizer), optimizer
        assert optimizer.rule == "linear", optimizer.rule
        assert float(optimizer.inner_optimizer.momentum) == 0.9
        print("loads whole with tf_diffmap")
        """
        )
    )
    for script, expected in (
        (without, "predicts without tf_diffmap"),
        (whole, "loads whole with tf_diffmap"),
    ):
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert expected in result.stdout


def test_checkpoint_round_trip_restores_model_and_optimizer(tmp_path):
    strategy, model, x, y = trained(tmp_path)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    weights = [w.numpy() for w in model.weights]
    slots = [v.numpy() for v in model.optimizer.variables]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert not all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights))
    checkpoint.restore(path).assert_consumed()
    for a, w in zip(weights, model.weights):
        np.testing.assert_array_equal(a, w.numpy())
    for a, v in zip(slots, model.optimizer.variables):
        np.testing.assert_array_equal(a, v.numpy())


def test_saved_weights_are_every_update(tmp_path):
    """Saving right after fit waits for the updates still in flight."""
    strategy, model, _, _ = trained(tmp_path)
    path = tmp_path / "w.weights.h5"
    model.save_weights(path)
    fresh = mlp()
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    fresh = keras.Model(inputs, keras.layers.Dense(2)(h))
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert strategy.extended.runtime.in_flight() == 0
    assert strategy.version == 2 * 8 * 4


def test_a_keras_file_saved_before_the_modules_moved_into_layers_loads():
    """`tests/data/saved_before_layers.keras` was saved when AsyncOptimizer
    lived in `tf_diffmap.optimizer` (commit 02f864d; the script is
    `model.save` of a two-replica MLP with `AsyncOptimizer(SGD(0.1,
    momentum=0.9))` after one epoch). Its registered name,
    `tf_diffmap>AsyncOptimizer`, still finds the class in
    `tf_diffmap.updates.optimizer`, and the model predicts as it did."""
    data = Path(__file__).parent / "data"
    path = data / "saved_before_layers.keras"
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    saved = config["compile_config"]["optimizer"]
    assert (saved["module"], saved["registered_name"]) == (
        "tf_diffmap.optimizer",
        "tf_diffmap>AsyncOptimizer",
    )
    model = keras.models.load_model(path)
    assert isinstance(model.optimizer, tf_diffmap.AsyncOptimizer)
    got = model.predict(np.load(data / "saved_before_layers.keras.x.npy"), verbose=0)
    np.testing.assert_allclose(got, np.load(data / "saved_before_layers.keras.pred.npy"), rtol=1e-5)
