"""Trains a small MLP on scikit-learn's digits with `tf_diffmap.Strategy`.

The host CPU is split into logical devices, one per replica. Each replica
computes the gradient of its own shard of every batch and pushes it to the
parameter store; the store applies each window of fresh gradients (computed
on the current parameters), one per replica, as one step of the optimizer,
and a replica that pushed waits for its window to close before it takes its
next shard. At the end the script prints the validation accuracy, the wall
time of `fit`, the store's statistics (per replica, how many gradients it
pushed, its work share, and how stale they were, in versions and in
optimizer steps) and the windows' (steps, waits, examples skipped).

With `--slow-replica-ms`, replica 0 sleeps during each of its training steps.
The other replicas do not wait for it past a window's patience: they compute
in its place and take more shards from the shared queue, which shows in the
work shares, and its late gradients are dropped and counted. `--gradients-per-step 1` applies every
shard's gradient as a step of its own, where `--staleness` picks a
staleness-aware update rule of `tf_diffmap.AsyncOptimizer`; `--max-staleness`
bounds how far the fast replicas may run ahead of the slow one.

Example:
    python examples/train_digits.py --replicas 4 --slow-replica-ms 20
"""

from __future__ import annotations

import argparse
import os
import time

# Before anything imports TensorFlow (keras, tf_diffmap): from level 2 on,
# TensorFlow's informational and warning logs, cpu_feature_guard's notice
# among them, are hidden. Its oneDNN notice is not, whatever the level
# (docs/troubleshooting.md).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_diffmap  # noqa: E402


def load_data(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Digits scaled to [0, 1], split 80/20 into train and validation."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    return train_test_split(x, y.astype("int32"), test_size=0.2, random_state=seed, stratify=y)


def build_model(slow_replica_ms: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            # Replica 0 sleeps in each training step (no-op at 0 ms).
            tf_diffmap.testing.ReplicaDelay(slow_replica_ms / 1000, replicas=[0]),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--slow-replica-ms", type=float, default=0.0, help="replica 0 sleeps")
    parser.add_argument(
        "--staleness",
        choices=["plain", "auto", "none", "linear", "inverse", "dc", "drop", "gap"],
        default="plain",
        help="plain: Adam as is; otherwise tf_diffmap.AsyncOptimizer with this rule",
    )
    parser.add_argument("--max-staleness", type=int, default=None, help="bounded staleness")
    parser.add_argument(
        "--gradients-per-step",
        default="auto",
        help='shard gradients per optimizer step: "auto" (one per replica) or a number',
    )
    parser.add_argument(
        "--logdir",
        default=None,
        help="write TensorBoard logs here (then: tensorboard --logdir DIR)",
    )
    args = parser.parse_args()

    # Logical devices can only be made before TensorFlow initializes its devices.
    tf_diffmap.split_devices(args.replicas, "CPU")
    keras.utils.set_random_seed(0)
    x_train, x_val, y_train, y_val = load_data()

    per_step = args.gradients_per_step
    options = {}
    if args.max_staleness is not None and per_step == "auto":
        # Bounded staleness is of asynchronous windows: the default fresh
        # windows keep replicas in step already.
        options["max_step_staleness"] = 1
    strategy = tf_diffmap.Strategy(
        max_staleness=args.max_staleness,
        gradients_per_step=per_step if per_step == "auto" else int(per_step),
        **options,
    )
    print(f"tf_diffmap {tf_diffmap.__version__}, TensorFlow {tf.__version__}: {strategy}")
    with strategy.scope():
        model = build_model(args.slow_replica_ms)
        optimizer = keras.optimizers.Adam(1e-3)
        if args.staleness != "plain":
            drop_above = 2 * args.replicas if args.staleness == "drop" else None
            optimizer = tf_diffmap.AsyncOptimizer(
                optimizer, staleness=args.staleness, drop_above=drop_above
            )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    callbacks = []
    if args.logdir:  # Keras' scalars and the Staleness tab, in one log directory
        callbacks = [
            keras.callbacks.TensorBoard(args.logdir),
            tf_diffmap.StalenessTensorBoard(args.logdir),
        ]

    start = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=2,
    )
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_val, y_val, batch_size=256, verbose=0)

    print(f"validation accuracy: {accuracy:.4f}")
    print(f"fit wall time: {seconds:.1f} s ({args.epochs} epochs)")
    print(strategy.statistics())
    windows = strategy.window_statistics()
    if windows is not None:
        print(windows)


if __name__ == "__main__":
    main()
