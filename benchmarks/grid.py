"""The held-out grid: tf_diffmap's default against synchronous training, condition by condition.

A fixed seed draws conditions from what users vary: input preprocessing,
model, optimizer, learning rate (the synchronous tuning times 0.5, 1 or 2),
replicas (2 to 32, with device time emulated so that they overlap as that
many devices would) and a replica 4x slower or not. The conditions are split
in two halves: defaults and constants are chosen on the first ("tune") and
the second ("held_out") is reported as it comes. Each condition runs, with
3 seeds, the synchronous reference (`MirroredStrategy`, same hyperparameters
and epochs), tf_diffmap's default and `"none"` (every shard's gradient a
step of its own, no rule); the tuning half also runs the candidates.

    python -m benchmarks.grid --jobs 2                  # both halves, all their variants
    python -m benchmarks.grid --part tune --jobs 2      # the tuning half only
    python -m benchmarks.grid --report-only --out DIR   # the tables and plot again
    python -m benchmarks.grid --tune-sync               # the synchronous learning rates
    python -m benchmarks.grid --part new_held_out --conditions 1023 \
        --variants sync fresh_fill_m100 --seeds 3 4 5 --out DIR  # one condition, more seeds

Runs are appended to `DIR/runs.jsonl` as they finish (a run already there is
not run again); `DIR/grid.md`, `DIR/grid.json` and `DIR/grid.png` hold the
report. Every run prints the strategy's measured staleness beside its
accuracy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CONDITION_COUNT",
    "DIMENSIONS",
    "SYNC_LEARNING_RATES",
    "TUNING_VARIANTS",
    "draw_conditions",
    "split_conditions",
    "main",
]

SEED = 20261205
CONDITION_COUNT = 64
SEEDS = (0, 1, 2)
EPOCHS = 15
BATCH_SIZE = 128
# Device time: every replica's step sleeps this long (a replica waiting on
# its own accelerator uses no CPU); a straggler's sleeps four times as long.
DEVICE_SECONDS = 0.003
STRAGGLER_FACTOR = 4
# Logical CPU devices of every run; replicas beyond them share devices.
DEVICES = 4

DIMENSIONS: dict[str, tuple] = {
    "preprocessing": ("standardized", "unit", "raw"),
    "model": ("mlp", "cnn", "text", "resnet"),
    "optimizer": (
        "sgd",
        "momentum_0.9",
        "momentum_0.95",
        "momentum_0.99",
        "nesterov",
        "adam",
        "adamw",
        "rmsprop",
        "adagrad",
        "momentum_cosine",
    ),
    "lr_factor": (0.5, 1.0, 2.0),
    "replicas": (2, 4, 8, 16, 32),
    "straggler": (False, True),
}

# The learning rate each (model, optimizer) was tuned to in synchronous
# training: the best final validation accuracy of one seed over 5 rates
# (`_SYNC_RATE_GRID`; ties to the smaller rate), plain Keras on one device
# with the grid's batch and epochs, inputs scaled to [0, 1]
# (`python -m benchmarks.grid --tune-sync`, 2026-12-06); after each rate,
# that accuracy. 18 of the 40 are at an end of the rates tried: the grid's
# factors (x0.5, x2) reach past them.
SYNC_LEARNING_RATES: dict[str, dict[str, float]] = {
    "mlp": {
        "sgd": 1,  # 0.972
        "momentum_0.9": 0.3,  # 0.978
        "momentum_0.95": 0.3,  # 0.975
        "momentum_0.99": 0.1,  # 0.964
        "nesterov": 0.1,  # 0.972
        "adam": 0.01,  # 0.969
        "adamw": 0.03,  # 0.972
        "rmsprop": 0.03,  # 0.972
        "adagrad": 0.3,  # 0.969
        "momentum_cosine": 0.3,  # 0.969
    },
    "cnn": {
        "sgd": 1,  # 0.542
        "momentum_0.9": 0.3,  # 0.939
        "momentum_0.95": 0.1,  # 0.939
        "momentum_0.99": 0.1,  # 0.911
        "nesterov": 0.1,  # 0.881
        "adam": 0.01,  # 0.925
        "adamw": 0.01,  # 0.933
        "rmsprop": 0.03,  # 0.897
        "adagrad": 0.3,  # 0.683
        "momentum_cosine": 0.3,  # 0.956
    },
    "text": {
        "sgd": 0.1,  # 0.122
        "momentum_0.9": 0.3,  # 0.592
        "momentum_0.95": 0.3,  # 0.733
        "momentum_0.99": 0.3,  # 0.728
        "nesterov": 0.3,  # 0.453
        "adam": 0.01,  # 0.925
        "adamw": 0.03,  # 0.928
        "rmsprop": 0.03,  # 0.925
        "adagrad": 0.3,  # 0.128
        "momentum_cosine": 0.3,  # 0.322
    },
    "resnet": {
        "sgd": 1,  # 1.000
        "momentum_0.9": 0.1,  # 0.994
        "momentum_0.95": 0.01,  # 0.983
        "momentum_0.99": 0.003,  # 0.933
        "nesterov": 0.1,  # 0.997
        "adam": 0.03,  # 0.997
        "adamw": 0.01,  # 0.994
        "rmsprop": 0.01,  # 0.992
        "adagrad": 1,  # 0.994
        "momentum_cosine": 0.1,  # 0.992
    },
}

# Rates tried by `--tune-sync`, per optimizer family.
_SYNC_RATE_GRID = {
    "sgd": (0.03, 0.1, 0.3, 1.0, 3.0),
    "momentum": (0.003, 0.01, 0.03, 0.1, 0.3),
    "adaptive": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    "adagrad": (0.01, 0.03, 0.1, 0.3, 1.0),
}

# Variants: how tf_diffmap (or the reference) trains a condition. "default"
# is tf_diffmap.Strategy() as it ships.
REFERENCE_VARIANTS = ("sync", "none", "default")
# Candidates for the default, run on the tuning half instead of "default":
# aggregation with each bound on the staleness in optimizer steps
# (`max_step_staleness`; unbounded: None), fresh windows (a bound of 0:
# "fresh_<late_window>", with "_m<margin>" for another patience margin and
# "_requeue" for late shards put back on the queue), and
# the previous default (every shard's gradient a step, AsyncOptimizer's
# "auto" rule). Runs named "agg_bound_0" in runs.jsonl are of the bound of 0
# before fresh windows (rejected gradients kept their window's count).
TUNING_VARIANTS = (
    "agg_unbounded",
    "agg_bound_1",
    "agg_bound_2",
    "per_shard_auto",
    "fresh_close",
    "fresh_fill",
)


def default_variant() -> str:
    """The tuning candidate that `tf_diffmap.Strategy()` is now."""
    from tf_diffmap.engine.windows import LATE_WINDOW
    from tf_diffmap.strategy import MAX_STEP_STALENESS

    bound = MAX_STEP_STALENESS
    if bound == 0:
        return f"fresh_{LATE_WINDOW}"
    return "agg_unbounded" if bound is None else f"agg_bound_{bound}"


def draw_conditions(count: int = CONDITION_COUNT, seed: int = SEED) -> list[dict[str, Any]]:
    """`count` distinct conditions drawn uniformly from `DIMENSIONS`.

    The text model reads the digits as tokens, so its preprocessing is
    "tokens" whatever was drawn.
    """
    rng = random.Random(seed)
    conditions, seen = [], set()
    while len(conditions) < count:
        condition = {name: rng.choice(values) for name, values in DIMENSIONS.items()}
        if condition["model"] == "text":
            condition["preprocessing"] = "tokens"
        key = json.dumps(condition, sort_keys=True)
        if key not in seen:
            seen.add(key)
            condition["id"] = len(conditions)
            conditions.append(condition)
    return conditions


# A second held-out set, drawn once the first had been seen (2026-12-06),
# with its own seed fixed before any of its runs: 32 conditions from the
# same dimensions, none of them one of the first draw's. Its ids start at
# 1000, so that its runs never share a key with the first draw's.
NEW_HELD_OUT_SEED = 20261206
NEW_HELD_OUT_COUNT = 32


def draw_new_held_out() -> list[dict[str, Any]]:
    """The second held-out set (see `NEW_HELD_OUT_SEED`)."""
    first = {
        json.dumps({k: v for k, v in c.items() if k != "id"}, sort_keys=True)
        for c in draw_conditions()
    }
    drawn = draw_conditions(NEW_HELD_OUT_COUNT + len(first), NEW_HELD_OUT_SEED)
    fresh = [
        c
        for c in drawn
        if json.dumps({k: v for k, v in c.items() if k != "id"}, sort_keys=True) not in first
    ][:NEW_HELD_OUT_COUNT]
    return [dict(c, id=1000 + i) for i, c in enumerate(fresh)]


def split_conditions(conditions: Sequence[dict], seed: int = SEED) -> tuple[list, list]:
    """The tuning half and the held-out half, each covering the dimensions
    alike: in a shuffled order, each condition goes to the half where its
    values have been seen less (a split made before any run, blind to
    results)."""
    order = list(conditions)
    random.Random(seed + 1).shuffle(order)
    halves: tuple[list, list] = ([], [])
    seen: tuple[dict, dict] = ({}, {})
    size = len(order) // 2
    for c in order:
        scores = [
            sum(seen[h].get((d, c[d]), 0) for d in DIMENSIONS) if len(halves[h]) < size + h else 1e9
            for h in (0, 1)
        ]
        h = 0 if scores[0] <= scores[1] else 1
        halves[h].append(c)
        for d in DIMENSIONS:
            seen[h][(d, c[d])] = seen[h].get((d, c[d]), 0) + 1
    tune, held_out = (sorted(half, key=lambda c: c["id"]) for half in halves)
    return tune, held_out


def condition_label(c: dict) -> str:
    straggler = ", 1 replica 4x slower" if c["straggler"] else ""
    return (
        f"{c['model']}, {c['optimizer']} x{c['lr_factor']:g}, {c['preprocessing']}, "
        f"{c['replicas']} replicas{straggler}"
    )


# -- data, models, optimizers (in a worker process) ---------------------------


def load_data(preprocessing: str, model: str):
    """Digits (scikit-learn's, bundled), split 80/20, prepared for `model`."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y.astype("int32"), test_size=0.2, random_state=0, stratify=y
    )
    if model == "text":
        # Each pixel a token: its position and its value (0..16).
        offsets = np.arange(64) * 17
        return (
            (x_train.astype("int32") + offsets).astype("int32"),
            (x_val.astype("int32") + offsets).astype("int32"),
            y_train,
            y_val,
        )
    if preprocessing == "standardized":
        mean, std = x_train.mean(axis=0), x_train.std(axis=0)
        std[std == 0] = 1.0
        x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    elif preprocessing == "unit":
        x_train, x_val = x_train / 16.0, x_val / 16.0
    x_train, x_val = x_train.astype("float32"), x_val.astype("float32")
    if model in ("cnn", "resnet"):
        x_train, x_val = x_train.reshape(-1, 8, 8, 1), x_val.reshape(-1, 8, 8, 1)
    return x_train, x_val, y_train, y_val


def build_model(keras, model: str, device_time=None):
    layers = keras.layers
    if model == "text":
        inputs = keras.Input((64,), dtype="int32")
    elif model == "mlp":
        inputs = keras.Input((64,))
    else:
        inputs = keras.Input((8, 8, 1))
    h = device_time(inputs) if device_time is not None else inputs
    if model == "mlp":
        h = layers.Dense(96, activation="relu")(h)
    elif model == "cnn":
        h = layers.Conv2D(16, 3, padding="same", activation="relu")(h)
        h = layers.MaxPooling2D(2)(h)
        h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = layers.GlobalAveragePooling2D()(h)
    elif model == "text":
        h = layers.Embedding(64 * 17, 16)(h)
        h = layers.GlobalAveragePooling1D()(h)
        h = layers.Dense(32, activation="relu")(h)
    else:  # a small residual net with batch normalization
        # Momentum 0.9: with Keras' 0.99, 180 steps leave the moving
        # statistics far from the data's, and validation near chance.
        def norm():
            return layers.BatchNormalization(momentum=0.9)

        h = layers.Conv2D(16, 3, padding="same", use_bias=False)(h)
        h = layers.Activation("relu")(norm()(h))
        for _ in range(2):
            y = layers.Conv2D(16, 3, padding="same", use_bias=False)(h)
            y = layers.Activation("relu")(norm()(y))
            y = layers.Conv2D(16, 3, padding="same", use_bias=False)(y)
            y = norm()(y)
            h = layers.Activation("relu")(layers.Add()([h, y]))
        h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h))


def make_optimizer(keras, name: str, learning_rate: float, total_steps: int):
    o = keras.optimizers
    if name == "sgd":
        return o.SGD(learning_rate)
    if name.startswith("momentum_") and name != "momentum_cosine":
        return o.SGD(learning_rate, momentum=float(name.split("_")[1]))
    if name == "nesterov":
        return o.SGD(learning_rate, momentum=0.9, nesterov=True)
    if name == "momentum_cosine":
        schedule = keras.optimizers.schedules.CosineDecay(learning_rate, total_steps)
        return o.SGD(schedule, momentum=0.9)
    return {"adam": o.Adam, "adamw": o.AdamW, "rmsprop": o.RMSprop, "adagrad": o.Adagrad}[name](
        learning_rate
    )


def _rate_family(optimizer: str) -> str:
    if optimizer == "sgd":
        return "sgd"
    if optimizer in ("adam", "adamw", "rmsprop"):
        return "adaptive"
    return "adagrad" if optimizer == "adagrad" else "momentum"


def device_time_layer(keras, tf, seconds: Sequence[float]):
    """A layer that sleeps, in a training step, the seconds of its replica."""
    delays = np.asarray(seconds, dtype=np.float64)

    class DeviceTime(keras.layers.Layer):
        def call(self, inputs, training=None):
            if not training:
                return inputs
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group if context is not None else 0

            def sleep(replica_id):
                time.sleep(float(delays[int(replica_id) % len(delays)]))
                return np.bool_(True)

            slept = tf.numpy_function(sleep, [replica], tf.bool, name="device_time")
            with tf.control_dependencies([slept]):
                return tf.identity(inputs)

    return DeviceTime(name="device_time")


# -- one run (in a worker process) -----------------------------------------


def sync_devices(c: dict) -> int:
    """MirroredStrategy's replicas for a condition: at most `DEVICES`.

    The synchronous step of the MLP, the CNN and the text model (the mean
    gradient of the batch) does not depend on how many replicas compute it.
    The residual net's batch normalization does: it normalizes each
    replica's shard, so with 8 to 32 replicas the reference normalizes
    larger shards (B / 4) than tf_diffmap's replicas do (B / N).
    MirroredStrategy over 32 logical devices took over 20 minutes for one
    run of 15 epochs on this 2-core host, where a run on 4 takes about one.
    """
    return min(c["replicas"], DEVICES)


def _strategy(variant: str, condition: dict):
    import tensorflow as tf

    import tf_diffmap

    replicas = condition["replicas"]
    if variant == "sync":
        # Sums the replicas' gradients on one device: the same step as the
        # collective all-reduce MirroredStrategy picks on CPUs, which cannot
        # run a 2-replica and a 4-replica strategy in one process (their
        # collective groups collide).
        return tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(sync_devices(condition))],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    devices = [f"/cpu:{i}" for i in range(min(replicas, DEVICES))]
    per_device = replicas // len(devices)
    kwargs: dict[str, Any] = {"devices": devices, "replicas_per_device": per_device}
    if variant in ("none", "per_shard_auto"):
        kwargs["gradients_per_step"] = 1
    elif variant == "agg_unbounded":
        kwargs["max_step_staleness"] = None
    elif variant.startswith("agg_bound_"):
        kwargs["max_step_staleness"] = int(variant.rsplit("_", 1)[1])
    elif variant.startswith("fresh_"):
        # Fresh windows: "fresh_<policy>", then optionally "_m<margin>" and
        # "_requeue" (late shards put back on the queue).
        parts = variant.split("_")
        kwargs["max_step_staleness"] = 0
        kwargs["late_window"] = parts[1]
        for part in parts[2:]:
            if part == "requeue":
                kwargs["late_shards"] = "requeue"
            else:
                kwargs["patience_margin"] = float(part[1:])
    return tf_diffmap.Strategy(**kwargs)


def run_one(run: dict[str, Any]) -> dict[str, Any]:
    """Trains one condition once: one variant, one seed."""
    import warnings

    import keras
    import tensorflow as tf

    import tf_diffmap

    c, variant, seed = run["condition"], run["variant"], run["seed"]
    x_train, x_val, y_train, y_val = load_data(c["preprocessing"], c["model"])
    steps = math.ceil(len(x_train) / BATCH_SIZE)
    rate = run["learning_rate"]
    keras.utils.set_random_seed(seed)
    strategy = _strategy(variant, c)
    delays = [DEVICE_SECONDS] * c["replicas"]
    if c["straggler"]:
        delays[0] = DEVICE_SECONDS * STRAGGLER_FACTOR
    with strategy.scope():
        timing = device_time_layer(keras, tf, delays) if variant != "sync" else None
        model = build_model(keras, c["model"], timing)
        optimizer = make_optimizer(keras, c["optimizer"], rate, steps * EPOCHS)
        if variant == "per_shard_auto":
            optimizer = tf_diffmap.AsyncOptimizer(optimizer)
        model.compile(optimizer, "sparse_categorical_crossentropy")
    data = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=seed, reshuffle_each_iteration=True)
        .batch(BATCH_SIZE)
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(data, epochs=EPOCHS, verbose=0)
    seconds = time.perf_counter() - start
    predictions = model.predict(x_val, batch_size=512, verbose=0)
    accuracy = float(np.mean(np.argmax(predictions, axis=1) == y_val))
    if not np.all(np.isfinite(predictions)):
        accuracy = float(np.mean(y_val == 0))  # a diverged model predicts nothing
    out: dict[str, Any] = {
        "accuracy": accuracy,
        "final_loss": float(history.history["loss"][-1]),
        "seconds": seconds,
        "collapse_warned": any("Training is collapsing" in str(w.message) for w in caught),
    }
    if variant != "sync":
        stats = strategy.statistics()
        pushed = int(stats.updates.sum() + stats.dropped.sum())
        out.update(
            mean_staleness=stats.overall_mean_staleness,
            max_staleness=stats.overall_max_staleness,
            mean_step_staleness=stats.overall_mean_step_staleness,
            max_step_staleness=stats.overall_max_step_staleness,
            steps=stats.steps,
            dropped_fraction=float(stats.dropped.sum()) / pushed if pushed else 0.0,
        )
    return out


def worker(runs: list[dict]) -> None:
    """Runs `runs` in this process, printing one JSON line per run."""
    for run in runs:
        try:
            result = {"status": "ok", **run_one(run)}
        except Exception as error:  # noqa: BLE001 - reported, the others go on
            result = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
        print("@@run@@ " + json.dumps({"key": run["key"], **result}), flush=True)


def _worker_main(config_path: str) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    # Every replica's sleep holds an inter-op thread: room for 32 sleepers.
    tf.config.threading.set_inter_op_parallelism_threads(64)
    import tf_diffmap

    tf_diffmap.split_devices(DEVICES, "CPU")
    worker(json.loads(Path(config_path).read_text()))
    return 0


# -- the plan and the driver -------------------------------------------------


def learning_rate(condition: dict) -> float:
    rates = SYNC_LEARNING_RATES.get(condition["model"], {})
    if condition["optimizer"] not in rates:
        raise ValueError(
            f"No synchronous learning rate for {condition['model']}/{condition['optimizer']}: "
            "run `python -m benchmarks.grid --tune-sync` and fill SYNC_LEARNING_RATES."
        )
    return rates[condition["optimizer"]] * condition["lr_factor"]


def plan_runs(part: str, variants: Sequence[str] | None = None, seeds=SEEDS) -> list[dict]:
    """Every run of the part ("tune", "held_out", "new_held_out" or "all")."""
    tune, held_out = split_conditions(draw_conditions())
    halves = {"tune": tune, "held_out": held_out, "new_held_out": draw_new_held_out()}
    parts = ("tune", "held_out") if part == "all" else (part,)
    runs, seen = [], set()
    for half in parts:
        if variants:
            wanted = tuple(variants)
        elif half == "tune":
            wanted = ("sync", "none", *TUNING_VARIANTS)
        else:
            wanted = REFERENCE_VARIANTS
        for c, variant, seed in itertools.product(halves[half], wanted, seeds):
            # The reference does not depend on the replicas or the straggler:
            # one run serves every condition that differs only in those.
            shared = {k: c[k] for k in ("preprocessing", "model", "optimizer", "lr_factor")}
            if variant == "sync":
                shared["replicas"] = sync_devices(c)
                key = json.dumps({"variant": "sync", "seed": seed, **shared}, sort_keys=True)
            else:
                key = json.dumps({"variant": variant, "seed": seed, "id": c["id"]}, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            runs.append(
                {
                    "key": key,
                    "condition": c,
                    "variant": variant,
                    "seed": seed,
                    "learning_rate": learning_rate(c),
                }
            )
    return runs


def _cost(run: dict) -> float:
    c = run["condition"]
    per_shard = sync_devices(c) / 4 if run["variant"] == "sync" else c["replicas"] / 4
    return {"mlp": 1, "text": 1.2, "cnn": 2, "resnet": 3}[c["model"]] * (1 + per_shard)


def drive(runs: list[dict], out: Path, jobs: int, chunk: int = 10) -> None:
    """Runs what `out/runs.jsonl` does not hold yet, `jobs` processes at a time."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = set()
    if log.exists():
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("status") == "ok":
                done.add(entry["key"])
    todo = sorted((r for r in runs if r["key"] not in done), key=_cost, reverse=True)
    planned = {r["key"] for r in runs}
    print(f"{len(runs)} runs planned, {len(done & planned)} done, {len(todo)} to run")
    count = math.ceil(len(todo) / chunk)
    chunks = [todo[i::count] for i in range(count)]
    pending = list(chunks)
    active: list[tuple[subprocess.Popen, Path]] = []
    started = time.time()
    finished = 0
    by_key = {r["key"]: r for r in runs}
    while pending or active:
        while pending and len(active) < jobs:
            runs_here = pending.pop(0)
            config = out / f"chunk-{os.getpid()}-{len(pending)}.json"
            config.write_text(json.dumps(runs_here))
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.grid", "--worker", str(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            )
            active.append((proc, config))
        proc, config = active[0]
        for line in proc.stdout:
            if not line.startswith("@@run@@ "):
                continue
            entry = json.loads(line[len("@@run@@ ") :])
            run = by_key[entry["key"]]
            entry.update(condition=run["condition"], variant=run["variant"], seed=run["seed"])
            with log.open("a") as file:
                file.write(json.dumps(entry) + "\n")
            finished += 1
            staleness = (
                f" staleness {entry.get('mean_staleness', 0):.1f} versions / "
                f"{entry.get('mean_step_staleness', 0):.2f} steps"
                if "mean_staleness" in entry
                else ""
            )
            print(
                f"[{time.time() - started:6.0f}s {finished}/{len(todo)}] "
                f"{run['variant']:>15} seed {run['seed']} {condition_label(run['condition'])}: "
                f"{entry.get('accuracy', float('nan')):.3f}{staleness}"
                + ("" if entry["status"] == "ok" else f" ERROR {entry.get('error')}"),
                flush=True,
            )
        proc.wait()
        config.unlink(missing_ok=True)
        active.pop(0)


# -- the report ----------------------------------------------------------------


def _sync_key(c: dict) -> tuple:
    """What a synchronous run depends on (not the straggler; see
    `sync_devices` for the replicas)."""
    return (c["preprocessing"], c["model"], c["optimizer"], c["lr_factor"], sync_devices(c))


def load_runs(out: Path) -> list[dict]:
    entries = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    return [e for e in entries if e.get("status") == "ok"]


def table(out: Path) -> dict[str, Any]:
    """Per condition and variant: the median accuracy over seeds, the runs,
    and the median staleness."""
    entries = load_runs(out)
    sync: dict[tuple, list] = {}
    other: dict[tuple, list] = {}
    for e in entries:
        c = e["condition"]
        if e["variant"] == "sync":
            sync.setdefault(_sync_key(c), []).append(e)
        else:
            other.setdefault((c["id"], e["variant"]), []).append(e)
    tune, held_out = split_conditions(draw_conditions())
    rows = []
    for half, conditions in (("tune", tune), ("held_out", held_out)):
        for c in conditions:
            row = {"half": half, "condition": c, "label": condition_label(c), "variants": {}}
            found = {"sync": sync.get(_sync_key(c), [])}
            for (cid, variant), runs in other.items():
                if cid == c["id"]:
                    found[variant] = runs
            if half == "tune" and default_variant() in found:
                # On the tuning half the default is the candidate it became.
                found["default"] = found[default_variant()]
            for variant, runs in found.items():
                if not runs:
                    continue
                accuracies = [r["accuracy"] for r in runs]
                summary = {"median": statistics.median(accuracies), "runs": accuracies}
                if "mean_staleness" in runs[0]:
                    summary["staleness"] = statistics.median(r["mean_staleness"] for r in runs)
                    summary["step_staleness"] = statistics.median(
                        r["mean_step_staleness"] for r in runs
                    )
                    summary["dropped"] = statistics.median(r["dropped_fraction"] for r in runs)
                row["variants"][variant] = summary
            rows.append(row)
    return {"rows": rows}


def judge(rows: list[dict], variant: str) -> dict[str, Any]:
    """The targets of a variant against sync and "none", over `rows`."""
    gaps, worst, below_none, collapsed = [], [], [], 0
    for row in rows:
        v = row["variants"]
        if variant not in v or "sync" not in v:
            continue
        gap = v[variant]["median"] - v["sync"]["median"]
        gaps.append(gap)
        if v["sync"]["median"] >= 0.8:
            worst.append(gap)
            collapsed += sum(a < 0.5 for a in v[variant]["runs"])
        if "none" in v:
            below_none.append(v[variant]["median"] - v["none"]["median"])
    if not gaps:
        return {"conditions": 0}
    return {
        "conditions": len(gaps),
        "median_gap": statistics.median(gaps),
        "worst_gap_where_sync_reaches_0.8": min(worst) if worst else None,
        "worst_gap_to_none": min(below_none) if below_none else None,
        "runs_below_0.5_where_sync_reaches_0.8": collapsed,
        "targets_met": {
            "median gap within 1 point": statistics.median(gaps) >= -0.01,
            "worst within 3 points where sync >= 0.8": (min(worst) >= -0.03) if worst else True,
            "never more than 1 point below none": (
                (min(below_none) >= -0.01) if below_none else True
            ),
            "no run below 0.5 where sync >= 0.8": collapsed == 0,
        },
    }


def compare(out: Path, part: str, variants: Sequence[str], seeds: Sequence[int]) -> str:
    """Variants judged against synchronous training on one set of
    conditions ("tune", "held_out" or "new_held_out"), over these seeds
    only: each side's median over the seeds it ran, as `table` takes it."""
    tune, held_out = split_conditions(draw_conditions())
    conditions = {"tune": tune, "held_out": held_out, "new_held_out": draw_new_held_out()}[part]
    wanted = set(seeds)
    sync: dict[tuple, list] = {}
    other: dict[tuple, list] = {}
    for e in load_runs(out):
        if e["seed"] not in wanted:
            continue
        if e["variant"] == "sync":
            sync.setdefault(_sync_key(e["condition"]), []).append(e["accuracy"])
        else:
            other.setdefault((e["condition"]["id"], e["variant"]), []).append(e["accuracy"])
    rows = []
    for c in conditions:
        found = {"sync": sync.get(_sync_key(c), [])}
        found.update({v: other.get((c["id"], v), []) for v in variants})
        rows.append(
            {
                "variants": {
                    v: {"median": statistics.median(runs), "runs": runs}
                    for v, runs in found.items()
                    if runs
                }
            }
        )
    lines = [
        f"{part}, seeds {', '.join(map(str, sorted(wanted)))}:",
        "| Variant | Conditions | Runs | Median gap to sync | Worst gap (sync >= 0.8) "
        "| Runs < 0.5 (sync >= 0.8) |",
        "|---|---|---|---|---|---|",
    ]
    for v in variants:
        j = judge(rows, v)
        if not j["conditions"]:
            lines.append(f"| {v} | 0 | 0 | | | |")
            continue
        worst = j["worst_gap_where_sync_reaches_0.8"]
        runs = sum(len(r["variants"].get(v, {"runs": []})["runs"]) for r in rows)
        lines.append(
            f"| {v} | {j['conditions']} | {runs} | {100 * j['median_gap']:+.1f} pt | "
            + (f"{100 * worst:+.1f} pt" if worst is not None else "n/a")
            + f" | {j['runs_below_0.5_where_sync_reaches_0.8']} |"
        )
    return "\n".join(lines)


def report(out: Path) -> str:
    data = table(out)
    rows = data["rows"]
    halves = {h: [r for r in rows if r["half"] == h] for h in ("tune", "held_out")}
    variants = sorted({v for r in rows for v in r["variants"] if v != "sync"})
    judged = {
        half: {v: judge(half_rows, v) for v in variants} for half, half_rows in halves.items()
    }
    data["judged"] = judged
    (out / "grid.json").write_text(json.dumps(data, indent=1))
    lines = ["# The held-out grid", ""]
    for half, half_rows in halves.items():
        lines += [
            f"## {half}",
            "",
            "| Variant | Conditions | Median gap to sync | Worst gap (sync >= 0.8) "
            "| Worst gap to none | Runs < 0.5 (sync >= 0.8) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for v in variants:
            j = judged[half][v]
            if not j.get("conditions"):
                continue
            worst = j["worst_gap_where_sync_reaches_0.8"]
            to_none = j["worst_gap_to_none"]
            lines.append(
                f"| {v} | {j['conditions']} | {100 * j['median_gap']:+.1f} pt | "
                + (f"{100 * worst:+.1f} pt" if worst is not None else "n/a")
                + " | "
                + (f"{100 * to_none:+.1f} pt" if to_none is not None else "n/a")
                + f" | {j['runs_below_0.5_where_sync_reaches_0.8']} |"
            )
        lines += [
            "",
            "| Condition | sync | " + " | ".join(variants) + " |",
            "| --- | --- | " + " | ".join("---" for _ in variants) + " |",
        ]
        for r in half_rows:
            v = r["variants"]
            cells = []
            for name in variants:
                if name not in v:
                    cells.append("")
                    continue
                s = v[name]
                cells.append(
                    f"{s['median']:.3f} (s {s.get('staleness', 0):.1f} v / "
                    f"{s.get('step_staleness', 0):.2f} st"
                    + (f", drop {100 * s['dropped']:.0f}%" if s.get("dropped") else "")
                    + ")"
                )
            sync = f"{v['sync']['median']:.3f}" if "sync" in v else ""
            lines.append(f"| {r['label']} | {sync} | " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    (out / "grid.md").write_text(text)
    _plot(rows, out / "grid.png")
    return text


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, half in zip(axes, ("tune", "held_out")):
        # Conditions in order of the synchronous accuracy, highest first: left
        # of the dashed line sync reaches 0.8, where the targets apply.
        half_rows = sorted(
            (r for r in rows if r["half"] == half and "sync" in r["variants"]),
            key=lambda r: -r["variants"]["sync"]["median"],
        )
        for variant, marker in (("default", "o"), ("none", "x")):
            points = [
                (i, r["variants"][variant]["median"] - r["variants"]["sync"]["median"])
                for i, r in enumerate(half_rows)
                if variant in r["variants"]
            ]
            if points:
                xs, ys = zip(*points)
                label = "default" if variant == "default" else '"none" (a step per shard)'
                ax.scatter(xs, [100 * y for y in ys], marker=marker, label=label)
        reaching = sum(r["variants"]["sync"]["median"] >= 0.8 for r in half_rows)
        ax.axvline(reaching - 0.5, color="grey", linewidth=0.8, linestyle="--")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.axhline(-1, color="grey", linewidth=0.5, linestyle=":")
        title = "tuning half" if half == "tune" else "held-out half"
        ax.set_title(f"{title}: accuracy minus synchronous")
        ax.set_xlabel("condition, by synchronous accuracy (sync >= 0.8 left of the dashes)")
        ax.set_ylim(-100, 15)
    axes[0].set_ylabel("points")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the synchronous learning rates ------------------------------------------


def tune_sync(out: Path, models: Sequence[str] = DIMENSIONS["model"]) -> dict:
    """The best rate of `_SYNC_RATE_GRID` per (model, optimizer), plain Keras
    on one device, inputs scaled to [0, 1] ("tokens" for text), seed 0."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    path = out / "sync_learning_rates.json"
    results: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    for model in models:
        results[model] = {}
        x_train, x_val, y_train, y_val = load_data("unit", model)
        steps = math.ceil(len(x_train) / BATCH_SIZE)
        for optimizer in DIMENSIONS["optimizer"]:
            scores = {}
            for rate in _SYNC_RATE_GRID[_rate_family(optimizer)]:
                keras.utils.set_random_seed(0)
                net = build_model(keras, model)
                net.compile(
                    make_optimizer(keras, optimizer, rate, steps * EPOCHS),
                    "sparse_categorical_crossentropy",
                )
                net.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0)
                predictions = net.predict(x_val, batch_size=512, verbose=0)
                scores[rate] = float(np.mean(np.argmax(predictions, axis=1) == y_val))
            best = max(scores, key=lambda r: (scores[r], -r))  # ties: the smaller rate
            results.setdefault(model, {})[optimizer] = {"best": best, "scores": scores}
            print(model, optimizer, best, scores, flush=True)
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grid", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grid"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--part", choices=("tune", "held_out", "new_held_out", "all"), default="all"
    )
    parser.add_argument("--variants", nargs="*", help="only these variants")
    parser.add_argument(
        "--seeds", nargs="*", type=int, default=list(SEEDS), help="only these seeds"
    )
    parser.add_argument(
        "--conditions", nargs="*", type=int, help="only the conditions of these ids"
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--tune-sync", action="store_true")
    parser.add_argument("--models", nargs="*", default=list(DIMENSIONS["model"]))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)
    if args.tune_sync:
        tune_sync(args.out, args.models)
        return 0
    if not args.report_only:
        runs = plan_runs(args.part, args.variants, args.seeds)
        if args.conditions:
            runs = [r for r in runs if r["condition"]["id"] in args.conditions]
        drive(runs, args.out, args.jobs)
    if args.part != "all" and args.variants:
        # One set, the variants asked for, the seeds asked for.
        variants = [v for v in args.variants if v != "sync"]
        print(compare(args.out, args.part, variants, args.seeds))
        return 0
    print(report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
