"""Evaluation and prediction on one host: split over the replicas, side by side.

The workload of issue 48's one-host targets: 4 replicas, a small MLP
(64-256-128-10), 10,240 examples in batches of 256. Device time is emulated
as in the other benchmarks, by a `tf.numpy_function` that sleeps without
using the host's CPU, here in proportion to each call's examples
(`--device-ms-per-example`, 0.1 ms): a replica that runs a shard of 64
examples sleeps 6.4 ms, one that runs the whole batch 25.6 ms. Each variant
is timed with that device time and with none (the same model without the
emulating layer):

- `tf_diffmap (split)`: each batch split over the 4 replicas, all at once;
- `tf_diffmap (whole batch)`: the path before the split, still the one a
  cluster takes: the whole batch on the first replica's device (this
  process forces it by refusing the split);
- `MirroredStrategy` on the same 4 logical CPU devices;
- `plain Keras`: no strategy, one device.

    python -m benchmarks.evaluation                  # 2 rounds, 3 timed calls each
    python -m benchmarks.evaluation --rounds 3 --repeats 5

Every variant runs in a subprocess of its own, with an inter-op pool of
4 + 8 threads (each sleeping replica holds one, as in
`benchmarks.weak_scaling`); the variants alternate within each round, so
that a drift of a shared host falls on all of them. Each figure is the
median of the timed calls of all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = [
    "main",
    "median",
    "model_builder",
    "print_table",
    "run_rounds",
    "time_calls",
    "workload_data",
]

REPLICAS = 4
EXAMPLES = 10_240
BATCH = 256
FEATURES, CLASSES = 64, 10
VARIANTS = ("tf_diffmap (split)", "tf_diffmap (whole batch)", "MirroredStrategy", "plain Keras")


def model_builder(delay: dict):
    """`build(device_time) -> compiled model`: the workload's MLP, with a
    layer that sleeps `delay["seconds_per_example"]` per example of each
    call if `device_time` (read at each call, so it can change)."""
    import keras
    import numpy as np
    import tensorflow as tf

    class DeviceTime(keras.layers.Layer):
        """Sleeps in proportion to the examples of each call, training or not."""

        def call(self, inputs):
            def sleep(examples):
                time.sleep(delay["seconds_per_example"] * int(examples))
                return np.bool_(True)

            slept = tf.numpy_function(sleep, [tf.shape(inputs)[0]], tf.bool, name="device_time")
            with tf.control_dependencies([slept]):
                return tf.identity(inputs)

    def build(device_time: bool):
        emulated = [DeviceTime()] if device_time else []
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                *emulated,
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    return build


def workload_data():
    """The workload's `(labelled batches, input batches)` datasets."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=EXAMPLES)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).prefetch(2)
    inputs = tf.data.Dataset.from_tensor_slices(x).batch(BATCH).prefetch(2)
    return data, inputs


def time_calls(model_for, delay: dict, device_ms_per_example: float, repeats: int) -> dict:
    """Seconds of each timed `evaluate` and `predict` call (after one that
    traces), with device time and with none: `{"evaluate@0.1": [...], ...}`.

    Args:
        model_for: `device_ms -> model` (built where the variant builds it).
        delay: the dict the models' device-time layer reads.
        device_ms_per_example: the emulated device time.
        repeats: timed calls of each.
    """
    data, inputs = workload_data()
    result = {}
    for device_ms in (device_ms_per_example, 0.0):
        delay["seconds_per_example"] = device_ms / 1e3
        model = model_for(device_ms)
        for name, call in (
            ("evaluate", lambda model=model: model.evaluate(data, verbose=0)),
            ("predict", lambda model=model: model.predict(inputs, verbose=0)),
        ):
            call()  # traced and warm
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            result[f"{name}@{device_ms:g}"] = seconds
    return result


def _run(variant: str, device_ms_per_example: float, repeats: int) -> dict:
    import tf_diffmap

    tf_diffmap.split_devices(REPLICAS, "CPU")
    import tensorflow as tf

    delay = {"seconds_per_example": device_ms_per_example / 1e3}
    build = model_builder(delay)
    devices = [f"CPU:{i}" for i in range(REPLICAS)]
    strategy = None
    if variant != "plain Keras":
        if variant == "MirroredStrategy":
            strategy = tf.distribute.MirroredStrategy(devices)
        else:
            if variant == "tf_diffmap (whole batch)":
                import tf_diffmap.extended

                tf_diffmap.extended.splits_over_replicas = lambda step, runtime: False
            strategy = tf_diffmap.Strategy(devices=devices)

    def model_for(device_ms: float):
        if strategy is None:
            return build(device_ms > 0)
        with strategy.scope():
            return build(device_ms > 0)

    return {"variant": variant, **time_calls(model_for, delay, device_ms_per_example, repeats)}


def median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def run_rounds(module: str, variants, rounds: int, options: list[str], env: dict) -> dict:
    """Runs `python -m <module> --worker <variant> <options>` for every
    variant, alternating within each round; each run's last line is its
    JSON row (`variant` and, per key, its seconds), printed as it comes.

    Returns:
        Per variant, per key, the seconds of every round together.
    """
    times: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for _ in range(rounds):
        for variant in variants:
            command = [sys.executable, "-m", module, "--worker", variant, *options]
            out = subprocess.run(command, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{variant} failed:\n{out.stderr[-4000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            for key, seconds in row.items():
                if key != "variant":
                    times[variant].setdefault(key, []).extend(seconds)
    return times


def print_table(times: dict, reference: str, caption: str) -> None:
    """A Markdown table of the median seconds per call of each variant and
    key (`name@device_ms`), with the ratio to `reference`'s."""
    if reference not in times:
        reference = next(iter(times))
    keys = list(times[reference])
    print(f"\n{caption}; in brackets, that time over {reference}'s")
    print(f"(above 1: {reference} is faster)")
    header = ["variant"] + [
        f"{k.split('@')[0]}, device {float(k.split('@')[1]):g} ms/example" for k in keys
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for variant, row in times.items():
        cells = [variant]
        for key in keys:
            if key not in row:
                cells.append("")
                continue
            own = median(row[key])
            cells.append(f"{own:.3f} ({own / median(times[reference][key]):.2f}x)")
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation", description=__doc__)
    parser.add_argument("--device-ms-per-example", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_run(args.worker, args.device_ms_per_example, args.repeats)))
        return 0
    env = dict(os.environ, TF_NUM_INTEROP_THREADS=str(REPLICAS + 8))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    options = ["--device-ms-per-example", str(args.device_ms_per_example)]
    options += ["--repeats", str(args.repeats)]
    times = run_rounds("benchmarks.evaluation", args.variants, args.rounds, options, env)
    print_table(
        times,
        "tf_diffmap (split)",
        f"{EXAMPLES} examples, batch {BATCH}, {REPLICAS} replicas; seconds per call "
        f"(median of {args.rounds * args.repeats})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
