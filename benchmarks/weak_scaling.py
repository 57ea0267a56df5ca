"""Weak scaling with device time emulated: N replicas against N times one replica's rate.

Each replica step sleeps `--device-ms` (10 ms) in a `tf.numpy_function`, as
a replica waits on its own accelerator without using the host's CPU, on a
shard of `--shard` (32) examples: the global batch is 32 N. What is
measured is how much of N times one replica's examples per second the
strategy keeps at N replicas, where the replicas' device time overlaps and
what is left is the host's own work and the waiting: fresh windows (the default,
`max_step_staleness=0`) wait for every replica of a window, up to the
patience, so the jitter between replicas is what they pay; asynchronous
windows (`max_step_staleness=1`) never wait. Each run prints
the jitter it saw: per window, the slowest replica's read-to-push time over
the median one's (from the gate's per-replica averages, so a lower bound).

    python -m benchmarks.weak_scaling                     # 1, 4, 16, 32 replicas
    python -m benchmarks.weak_scaling --replicas 1 4 --seconds 5

Every run is a subprocess of its own, with an inter-op pool of N + 8
threads (each sleeping replica holds one); the variants alternate within
each replica count, so that a drift of a shared host falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = ["main"]

VARIANTS = {"fresh windows (default)": 0, "asynchronous windows": 1}
DEVICES = 4


def _run(replicas: int, bound: int, device_ms: float, shard: int, seconds: float) -> dict:
    import numpy as np

    import tf_diffmap

    devices = min(replicas, DEVICES)
    tf_diffmap.split_devices(devices, "CPU")
    import keras
    import tensorflow as tf

    delay = device_ms / 1e3

    class DeviceTime(keras.layers.Layer):
        def call(self, inputs, training=None):
            if not training:
                return inputs

            def sleep():
                time.sleep(delay)
                return np.bool_(True)

            slept = tf.numpy_function(sleep, [], tf.bool, name="device_time")
            with tf.control_dependencies([slept]):
                return tf.identity(inputs)

    strategy = tf_diffmap.Strategy(
        devices=[f"CPU:{i}" for i in range(devices)],
        replicas_per_device=replicas // devices,
        max_step_staleness=bound,
    )
    batch = shard * replicas
    steps = 64
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 32)).astype("float32")
    y = rng.integers(0, 10, size=batch * steps)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                DeviceTime(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    model.fit(data, steps_per_epoch=8, epochs=1, verbose=0)  # traced and warm
    strategy.reset_statistics()
    start, examples = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
        examples += steps * batch
    elapsed = time.perf_counter() - start
    stats = strategy.statistics()
    result = {
        "replicas": replicas,
        "bound": bound,
        "examples_per_second": examples / elapsed,
        "mean_staleness": stats.overall_mean_staleness,
        "dropped": int(stats.dropped.sum()),
    }
    windows = strategy.window_statistics()
    shard_seconds = None if windows is None else windows.shard_seconds[windows.shard_seconds > 0]
    if shard_seconds is not None and replicas > 1 and len(shard_seconds):
        # Fresh windows time every replica's shards; asynchronous ones do not.
        result.update(
            closed_short=windows.closed_short,
            windows=windows.windows,
            jitter=float(shard_seconds.max() / np.median(shard_seconds)),
            patience_ms=None if windows.patience is None else windows.patience * 1e3,
            waited_s=float(windows.seconds_waiting.sum()),
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weak_scaling", description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 4, 16, 32])
    parser.add_argument("--device-ms", type=float, default=10.0)
    parser.add_argument("--shard", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        replicas, bound = (int(v) for v in args.worker.split(","))
        print(json.dumps(_run(replicas, bound, args.device_ms, args.shard, args.seconds)))
        return 0
    results: dict[tuple[str, int], list[dict]] = {}
    for replicas in args.replicas:
        for _ in range(args.repeats):
            for name, bound in VARIANTS.items():
                if replicas == 1 and bound != 0:
                    continue  # One replica never waits for another: the same run.
                env = dict(os.environ, TF_NUM_INTEROP_THREADS=str(replicas + 8))
                env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
                command = [sys.executable, "-m", "benchmarks.weak_scaling"]
                command += ["--worker", f"{replicas},{bound}"]
                command += ["--device-ms", str(args.device_ms), "--shard", str(args.shard)]
                command += ["--seconds", str(args.seconds)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((name, replicas), []).append(row)
                print(json.dumps({"variant": name, **row}), flush=True)
    one = [r["examples_per_second"] for r in results.get(("fresh windows (default)", 1), [])]
    if not one:
        return 0
    base = sorted(one)[len(one) // 2]
    print(f"\none replica: {base:.0f} examples/s (median of {len(one)})")
    print(
        "| replicas | variant | examples/s | of N x one | mean staleness | closed short | jitter |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, replicas), rows in results.items():
        rates = sorted(r["examples_per_second"] for r in rows)
        rate = rates[len(rates) // 2]
        short = ", ".join(f"{r.get('closed_short', 0)}/{r.get('windows', 0)}" for r in rows)
        jitter = ", ".join(f"{r['jitter']:.2f}" for r in rows if "jitter" in r)
        staleness = sorted(r["mean_staleness"] for r in rows)[len(rows) // 2]
        print(
            f"| {replicas} | {name} | {rate:.0f} | {rate / (base * replicas):.2f} | "
            f"{staleness:.2f} | {short} | {jitter} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
