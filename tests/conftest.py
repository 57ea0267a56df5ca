"""Test configuration: four logical CPU devices, made before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_diffmap  # noqa: E402

NUM_CPU_DEVICES = 4
tf_diffmap.split_devices(NUM_CPU_DEVICES, "CPU")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def classification_data(n: int = 512, features: int = 8, seed: int = 0):
    """A small separable two-class problem."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    return x, y


def mlp(features: int = 8, classes: int = 2, hidden: int = 16) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )


LOGITS_LOSS = "sparse_categorical_crossentropy"


def compile_logits(model: keras.Model, optimizer="adam", **kwargs) -> None:
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )


def async_mlp(optimizer="adam", compile_kwargs=None, **strategy_kwargs):
    """A `tf_diffmap.Strategy` and a compiled `mlp()` built in its scope.

    `optimizer` is a name or a function that makes one (called in the scope,
    where Keras requires optimizers to be created).
    """
    strategy = tf_diffmap.Strategy(**strategy_kwargs)
    with strategy.scope():
        model = mlp()
        compile_logits(
            model, optimizer() if callable(optimizer) else optimizer, **(compile_kwargs or {})
        )
    return strategy, model


@pytest.fixture
def data():
    return classification_data()


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's bundled digits, shuffled: 1,400 to train, the rest to validate."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]
