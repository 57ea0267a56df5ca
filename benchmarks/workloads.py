"""Data sets and models of the benchmarks, for Keras 3 and tf-keras alike.

Every builder takes the Keras module to use (`keras` for Keras 3, `tf.keras`
under `TF_USE_LEGACY_KERAS=1` for tf-keras), so that every contender trains the
same model on the same data. Nothing here imports `tf_diffmap`: the tf-keras
environment does not have it.
"""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np

__all__ = [
    "MODELS",
    "synthetic_data",
    "digits_data",
    "dataset",
    "build_model",
    "mlp_accuracy",
    "replica_delay",
    "control_data",
    "build_control_model",
    "EMBEDDING_MODEL",
    "EMBEDDING_OPTIMIZERS",
    "embedding_data",
    "build_embedding_model",
    "embedding_optimizer",
]

# Input shape and classes of each model. "mlp" is also the digits model: the
# digits have 64 features, so the straggler delay calibrated on the synthetic
# MLP applies unchanged to the time-to-accuracy runs.
MODELS = {
    "mlp": {"input_shape": (64,), "classes": 10, "description": "MLP 64-256-128-10 (ReLU)"},
    "cnn": {
        "input_shape": (28, 28, 1),
        "classes": 10,
        "description": "CNN conv16-pool-conv32-pool-dense64-10 on 28x28x1",
    },
    # The cluster workload's model, digits-shaped.
    "mlp_wide": {"input_shape": (64,), "classes": 10, "description": "MLP 64-256-256-10 (ReLU)"},
    # A model of many small variables (50), as convolutional networks with
    # batch normalization have: `--cluster-model` runs the cluster workload on it.
    "mlp_deep_bn": {
        "input_shape": (64,),
        "classes": 10,
        "description": "MLP of 8 blocks Dense(64)-BatchNormalization-ReLU, then 10",
    },
}

# Blocks of the "mlp_deep_bn" model.
DEEP_BN_BLOCKS = 8

# The control workload's model: so small that a step is almost all control path.
CONTROL_MODEL = {"features": 8, "description": "Dense(1) on 8 inputs, MSE, SGD"}


def synthetic_data(model: str, examples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs with learnable labels (a fixed random linear teacher).

    Args:
        model: a key of `MODELS`.
        examples: how many examples.
        seed: the NumPy seed (the same for every contender).

    Returns:
        `(x, y)`: float32 inputs and int32 labels.
    """
    spec = MODELS[model]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, *spec["input_shape"])).astype("float32")
    teacher = rng.normal(size=(int(np.prod(spec["input_shape"])), spec["classes"]))
    y = np.argmax(x.reshape(examples, -1) @ teacher, axis=1).astype("int32")
    return x, y


def digits_data(seed: int = 0) -> tuple[np.ndarray, ...]:
    """scikit-learn's bundled digits (no download), standardized, split 80/20.

    Returns:
        `(x_train, x_val, y_train, y_val)`: 1437 and 360 examples of 64 features.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y.astype("int32"), test_size=0.2, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x_train)
    return (
        scaler.transform(x_train).astype("float32"),
        scaler.transform(x_val).astype("float32"),
        y_train,
        y_val,
    )


def dataset(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle_seed: int | None = None):
    """The input pipeline every contender gets: batches, repeated without end.

    `fit` is then given `steps_per_epoch`, so that Keras keeps one iterator
    for the whole `fit` instead of building a new one every epoch (under a
    multi-device strategy, Keras 3 takes seconds per epoch to rebuild its
    distributed iterator, which would swamp the short epochs here).

    Args:
        x: inputs.
        y: labels.
        batch_size: the global batch size.
        shuffle_seed: reshuffle every pass with this seed (None: no shuffling).

    Returns:
        A `tf.data.Dataset` of `(x, y)` batches; `ceil(len(x) / batch_size)`
        batches make one pass over the data.
    """
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle_seed is not None:
        data = data.shuffle(len(x), seed=shuffle_seed, reshuffle_each_iteration=True)
    return data.batch(batch_size).repeat().prefetch(2)


def mlp_accuracy(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy of the "mlp" model from its weights, computed in NumPy.

    The same for every contender, and free of any strategy's evaluation
    machinery (which under MirroredStrategy takes seconds per call here).

    Args:
        weights: `model.get_weights()`: kernel and bias of each Dense layer.
        x: inputs.
        y: labels.
    """
    h = x.astype(np.float32)
    pairs = list(zip(weights[0::2], weights[1::2]))
    for i, (kernel, bias) in enumerate(pairs):
        h = h @ kernel + bias
        if i < len(pairs) - 1:
            h = np.maximum(h, 0.0)
    return float(np.mean(np.argmax(h, axis=1) == y))


def build_model(keras: ModuleType, model: str, delay_layer=None):
    """A fresh, uncompiled model.

    Args:
        keras: the Keras module (Keras 3 or tf-keras).
        model: a key of `MODELS`.
        delay_layer: a layer put right after the input (the straggler's delay).

    Returns:
        A `keras.Sequential` model ending in a softmax over 10 classes.
    """
    spec = MODELS[model]
    layers = keras.layers
    head = [keras.Input(spec["input_shape"])]
    if delay_layer is not None:
        head.append(delay_layer)
    if model == "mlp":
        body = [
            layers.Dense(256, activation="relu"),
            layers.Dense(128, activation="relu"),
        ]
    elif model == "mlp_wide":
        body = [
            layers.Dense(256, activation="relu"),
            layers.Dense(256, activation="relu"),
        ]
    elif model == "mlp_deep_bn":
        body = [
            layer
            for _ in range(DEEP_BN_BLOCKS)
            for layer in (layers.Dense(64), layers.BatchNormalization(), layers.ReLU())
        ]
    elif model == "cnn":
        body = [
            layers.Conv2D(16, 3, activation="relu"),
            layers.MaxPooling2D(2),
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
        ]
    else:
        raise ValueError(f"Unknown model {model!r}; expected one of {sorted(MODELS)}.")
    return keras.Sequential(head + body + [layers.Dense(spec["classes"], activation="softmax")])


def control_data(examples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The control workload's data: 8 features, a noisy linear target.

    Returns:
        `(x, y)`: float32 arrays of shapes `(examples, 8)` and `(examples, 1)`.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, CONTROL_MODEL["features"])).astype("float32")
    w = rng.normal(size=(CONTROL_MODEL["features"], 1))
    y = (x @ w + 0.1 * rng.normal(size=(examples, 1))).astype("float32")
    return x, y


def build_control_model(keras: ModuleType):
    """A fresh, uncompiled `Dense(1)` on 8 inputs (the control workload's model)."""
    return keras.Sequential([keras.Input((CONTROL_MODEL["features"],)), keras.layers.Dense(1)])


def replica_delay(keras: ModuleType, seconds: float, legacy: bool = False, replicas=(0,)):
    """The straggler: a layer that sleeps on the given replicas in training.

    Under Keras 3 this is `tf_diffmap.testing.ReplicaDelay`; under tf-keras an
    equivalent layer (same logic: a `tf.numpy_function` keyed on
    `replica_id_in_sync_group`), since the package's layer is a Keras 3 layer.
    The sleep can be changed after tracing through the layer's `seconds`; it
    is traced in only when `seconds` is non-zero at trace time.
    """
    if not legacy:
        from tf_diffmap.testing import ReplicaDelay

        return ReplicaDelay(seconds, replicas=replicas, name="replica_delay")
    return _legacy_replica_delay(keras)(seconds, replicas=replicas, name="replica_delay")


_LEGACY_LAYERS: dict[int, type] = {}


def _legacy_replica_delay(keras: ModuleType) -> type:
    """`ReplicaDelay` written against tf-keras' `Layer`."""
    if id(keras) in _LEGACY_LAYERS:
        return _LEGACY_LAYERS[id(keras)]
    import tensorflow as tf

    class LegacyReplicaDelay(keras.layers.Layer):
        def __init__(self, seconds, replicas=(0,), **kwargs):
            super().__init__(**kwargs)
            self.seconds = float(seconds)
            self.replicas = tuple(int(r) for r in replicas)

        def _sleep(self, replica_id):
            if int(replica_id) in self.replicas:
                time.sleep(self.seconds)
            return True

        def call(self, inputs, training=None):
            if not training or not self.seconds:
                return inputs
            context = tf.distribute.get_replica_context()
            replica_id = context.replica_id_in_sync_group if context is not None else 0
            slept = tf.numpy_function(self._sleep, [replica_id], tf.bool, name="replica_delay")
            with tf.control_dependencies([slept]):
                return tf.identity(inputs)

    _LEGACY_LAYERS[id(keras)] = LegacyReplicaDelay
    return LegacyReplicaDelay


# The embedding workload: a bag of ids, the parameter-server workload.
EMBEDDING_MODEL = {
    "ids": 16,
    "width": 32,
    "description": "Embedding(rows, 32) over 16 ids an example, GlobalAveragePooling1D, "
    "Dense(32, ReLU), Dense(1, sigmoid), binary cross-entropy",
}

# Each optimizer of the embedding workload: Keras class and arguments.
EMBEDDING_OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.5}),
    "adagrad": ("Adagrad", {"learning_rate": 0.5}),
    "adam": ("Adam", {"learning_rate": 1e-2}),
}


def embedding_data(rows: int, examples: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Ids drawn as in recommendation data, and a label they determine.

    Ids follow a Zipf law (a few rows are looked up often, most rarely), and
    every row has a hidden score: the label is whether an example's mean score
    is above the median. The validation set is a quarter the size of the
    training set, drawn the same way.

    Returns:
        `x_train, y_train, x_val, y_val`: int32 ids `[n, 16]`, float32 labels `[n, 1]`.
    """
    rng = np.random.default_rng(seed)
    score = rng.normal(size=rows).astype("float32")
    ids = EMBEDDING_MODEL["ids"]
    x = ((rng.zipf(1.3, size=(examples + examples // 4, ids)) - 1) % rows).astype("int32")
    mean = score[x].mean(axis=1)
    y = (mean > np.median(mean)).astype("float32")[:, None]
    return x[:examples], y[:examples], x[examples:], y[examples:]


def build_embedding_model(keras: ModuleType, rows: int):
    width = EMBEDDING_MODEL["width"]
    return keras.Sequential(
        [
            keras.Input((EMBEDDING_MODEL["ids"],), dtype="int32"),
            keras.layers.Embedding(rows, width),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def embedding_optimizer(keras: ModuleType, name: str, legacy: bool = False):
    """The optimizer `name`; with `legacy` (tf-keras), SGD is the legacy
    SGD, whose sparse update touches only rows (tf-keras' current SGD keeps
    a momentum slot, updated densely, even without momentum)."""
    cls, kwargs = EMBEDDING_OPTIMIZERS[name]
    if legacy and name == "sgd":
        return keras.optimizers.legacy.SGD(**kwargs)
    return getattr(keras.optimizers, cls)(**kwargs)
