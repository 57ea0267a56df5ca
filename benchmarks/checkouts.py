"""Updates/s of two checkouts of tf_diffmap, side by side in one run.

`python -m benchmarks.checkouts BEFORE AFTER [--rounds N]` runs the same
`fit` in a fresh process per round, alternating the two checkouts (each a
directory holding `tf_diffmap/`), and prints each round, the medians, their
ratio and the CPU time per update. What it measures: the replicas' loops
and Keras' step on a host, no straggler and no cluster: a 16-feature MLP on
4 logical CPU devices, SGD, batch 64, `steps_per_execution=16`, 3 timed
epochs of 32,768 examples after one untimed epoch. On a 2-core host the
replicas run nearly back to back (mean staleness well under 1): it says
what a change to the loops costs per update, not how training converges.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_ROUND = """
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
sys.path.insert(0, sys.argv[1])
import tf_diffmap
tf_diffmap.split_devices(4, "CPU")
import keras, numpy as np
rng = np.random.default_rng(0)
x = rng.normal(size=(32768, 16)).astype("float32")
y = (x.sum(1) > 0).astype("int32")
strategy = tf_diffmap.Strategy()
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=16,
    )
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
version, wall, cpu = strategy.version, time.perf_counter(), time.process_time()
model.fit(x, y, batch_size=64, epochs=3, verbose=0)
updates = strategy.version - version
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(updates / wall, 1e6 * cpu / updates)
"""


def one_round(checkout: str) -> tuple[float, float]:
    """(updates/s, µs of CPU per update) of one fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", _ROUND, checkout], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"The round on {checkout} failed:\n{result.stderr[-3000:]}")
    rate, cpu = result.stdout.split()[-2:]
    return float(rate), float(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="directory of the first checkout")
    parser.add_argument("after", help="directory of the second checkout")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, received {args.rounds}")
    results: dict[str, list[tuple[float, float]]] = {args.before: [], args.after: []}
    for index in range(args.rounds):
        # Alternating, and in the other order every second round, so that
        # the host's load drifts over both alike.
        order = [args.before, args.after] if index % 2 == 0 else [args.after, args.before]
        for checkout in order:
            rate, cpu = one_round(checkout)
            results[checkout].append((rate, cpu))
            print(f"round {index + 1}: {checkout}: {rate:,.0f} updates/s, {cpu:.0f} µs CPU/update")
    medians = {}
    for checkout, rounds in results.items():
        rates = [r for r, _ in rounds]
        medians[checkout] = statistics.median(rates)
        print(
            f"{checkout}: median {medians[checkout]:,.0f} updates/s "
            f"({min(rates):,.0f}-{max(rates):,.0f}), "
            f"{statistics.median(c for _, c in rounds):.0f} µs CPU/update"
        )
    print(f"after/before: {medians[args.after] / medians[args.before]:.2f}x (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
