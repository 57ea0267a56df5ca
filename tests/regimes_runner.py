"""Trains a digits model with momentum SGD where staleness is real; prints JSON.

`tests/test_convergence_regimes.py` runs it in a fresh process, because
TensorFlow's inter-op pool and the logical devices are set before
TensorFlow starts:

    python tests/regimes_runner.py '{"model": "mlp", "replicas_per_device": 4, ...}'

Every replica sleeps `device_seconds` in each training step (emulated device
time: a replica waiting on its own accelerator uses no CPU), on an inter-op
pool of 64 threads, so that the replicas overlap as that many devices would
(`benchmarks.grid` does the same). `"variant": "default"` trains under
`tf_diffmap.Strategy` as a user builds it; `"sync"`, the reference, under
`MirroredStrategy` on the same devices, without device time. The data,
models and optimizers are the held-out grid's (`benchmarks.grid`).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tensorflow as tf  # noqa: E402

# Before anything starts TensorFlow: a thread for every sleeping replica.
tf.config.threading.set_inter_op_parallelism_threads(64)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_diffmap  # noqa: E402
from benchmarks.grid import build_model, device_time_layer, load_data, make_optimizer  # noqa: E402

DEVICES = 4


def run(config: dict) -> dict:
    """One training run; `config` has the keys of the module's example."""
    devices = tf_diffmap.split_devices(DEVICES, "CPU")
    x_train, x_val, y_train, y_val = load_data(config["preprocessing"], config["model"])
    batch, epochs = config["batch_size"], config["epochs"]
    keras.utils.set_random_seed(config["seed"])
    if config["variant"] == "sync":
        # Not its default collective all-reduce, whose instance keys clash when
        # a second model trains in the same process.
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    else:
        strategy = tf_diffmap.Strategy(
            devices=devices, replicas_per_device=config["replicas_per_device"]
        )
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        timing = None
        if config["variant"] != "sync":
            timing = device_time_layer(keras, tf, [config["device_seconds"]] * replicas)
        model = build_model(keras, config["model"], timing)
        steps = math.ceil(len(x_train) / batch) * epochs
        optimizer = make_optimizer(keras, config["optimizer"], config["learning_rate"], steps)
        model.compile(optimizer, "sparse_categorical_crossentropy")
    data = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=config["seed"], reshuffle_each_iteration=True)
        .batch(batch)
    )
    start = time.perf_counter()
    model.fit(data, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    predictions = model.predict(x_val, batch_size=512, verbose=0)
    out = {
        "replicas": replicas,
        "accuracy": float(np.mean(np.argmax(predictions, axis=1) == y_val)),
        "seconds": seconds,
    }
    if config["variant"] != "sync":
        stats = strategy.statistics()
        out.update(
            gradients_per_step=strategy.gradients_per_step,
            mean_staleness=stats.overall_mean_staleness,
            max_staleness=int(stats.overall_max_staleness),
            mean_step_staleness=stats.overall_mean_step_staleness,
            dropped=int(stats.dropped.sum()),
            updates=int(stats.updates.sum()),
        )
    return out


if __name__ == "__main__":
    print("@@regimes@@ " + json.dumps([run(c) for c in json.loads(sys.argv[1])]), flush=True)
