"""The chief's training script in the container image: an example to replace with yours.

It trains a small classifier on generated data with
`tf_diffmap.cluster.strategy_for_cluster`: the replicas on the worker tasks,
the store on the ps tasks, as TF_CONFIG names them. With `--backup-dir`,
`keras.callbacks.BackupAndRestore` keeps the last completed epoch there, and a
run of the script that finds it resumes after it: what a restarted chief does
after a lost ps (docs/cluster.md, "When a task is lost").

The process ends with `os._exit`, with status 1 when training raised: after a
lost task, TensorFlow's runtime can keep threads that would hold the process,
and so the pod, alive once `fit` has raised. Exiting lets the pod's restart
policy act.

Example:
    TF_CONFIG='{"cluster": ..., "task": {"type": "chief", "index": 0}}' \\
        python train.py --epochs 5 --backup-dir /checkpoints/backup
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    from tf_diffmap import cluster

    strategy = cluster.strategy_for_cluster(
        connect_timeout=args.connect_timeout, max_workers=args.max_workers
    )
    print(f"replicas: {strategy.replica_devices}", flush=True)
    x = np.random.default_rng(0).normal(size=(args.examples, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = []
    if args.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup_dir))
    model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_split=0.1,
        callbacks=callbacks,
        verbose=2,
    )
    print(strategy.statistics(), flush=True)
    if args.save:
        model.save(args.save)
        print(f"saved {args.save}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--examples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every worker and ps task to serve (pods start in any order)",
    )
    most = os.environ.get("TF_DIFFMAP_MAX_WORKERS")
    parser.add_argument(
        "--max-workers",
        type=int,
        default=int(most) if most else None,
        help="let workers join while it trains, up to this many in all (elastic membership; "
        "default: $TF_DIFFMAP_MAX_WORKERS, else a fixed cluster)",
    )
    parser.add_argument("--backup-dir", default=None, help="keras.callbacks.BackupAndRestore here")
    parser.add_argument("--save", default=None, help="save the trained model to this .keras file")
    args = parser.parse_args()
    # The package logs the cluster's membership at INFO: the command that adds
    # a worker, and each worker that joins or leaves.
    logging.basicConfig()
    logging.getLogger("tf_diffmap").setLevel(logging.INFO)
    try:
        train(args)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
