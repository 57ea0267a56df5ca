"""An epoch of a regularized recommender: plain Keras and tf_diffmap checkouts, side by side.

`python -m benchmarks.regularized_recommender CHECKOUT [CHECKOUT ...]
[--rounds N] [--epochs E] [--async-windows] [--ratings R]` runs, every round, one fresh
process per checkout (a directory holding `tf_diffmap/`), in turn. Each
process trains plain Keras and tf_diffmap side by side: after one untimed
epoch of each (the first traces the functions) it times E epochs of each,
alternating epoch by epoch (the order reversed every second pair), so that
a shared host's load, which drifts over seconds, weighs on both alike. It
prints each epoch pair's times and ratio, and per checkout the median
epoch times and the median of the pairs' ratios to plain Keras.

The workload is keras-io's MovieLens recommender ("Collaborative Filtering
for Movie Recommendations") at the size of ml-latest-small: 610 users and
9,724 movies as embeddings of 50 with `embeddings_regularizer=l2(1e-6)`,
a bias embedding of each, their dot product summed over the batch, as the
example writes it (`tensordot(user, movie, 2)`), through a sigmoid; Adam
(1e-3), binary cross-entropy, batch 64, 90,752 training ratings
(synthetic, low-rank; `--ratings` draws fewer, as the test suite's run
does, whose times then say nothing). tf_diffmap runs its defaults (fresh windows) on 4
logical CPU devices, and with `--async-windows` asynchronous windows
(`max_step_staleness=1`) too, a third model in the same process. It says
what the regularizer's dense table gradients cost per step; it says
nothing of convergence.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
checkout, modes, epochs, RATINGS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, checkout)
import tf_diffmap
tf_diffmap.split_devices(4, "CPU")
import keras, numpy as np, tensorflow as tf

USERS, MOVIES, WIDTH = 610, 9_724, 50
rng = np.random.default_rng(0)
u, v = rng.normal(0, 0.5, (USERS, 4)), rng.normal(0, 0.5, (MOVIES, 4))
popularity = 1.0 / np.arange(1, MOVIES + 1) ** 0.8
users = rng.integers(USERS, size=RATINGS)
movies = rng.choice(MOVIES, size=RATINGS, p=popularity / popularity.sum())
pairs = np.stack([users, movies], axis=1).astype("int64")
score = 3.5 + np.sum(u[pairs[:, 0]] * v[pairs[:, 1]], axis=1) + rng.normal(0, 0.4, RATINGS)
stars = np.clip(np.round(score * 2) / 2, 0.5, 5.0)
ratings = ((stars - 0.5) / 4.5).astype("float32")
train = int(0.9 * RATINGS)
x, y = pairs[:train], ratings[:train]


class Recommender(keras.Model):
    def __init__(self):
        super().__init__()
        table = dict(embeddings_initializer="he_normal",
                     embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user = keras.layers.Embedding(USERS, WIDTH, **table)
        self.user_bias = keras.layers.Embedding(USERS, 1)
        self.movie = keras.layers.Embedding(MOVIES, WIDTH, **table)
        self.movie_bias = keras.layers.Embedding(MOVIES, 1)

    def call(self, inputs):
        user, movie = self.user(inputs[:, 0]), self.movie(inputs[:, 1])
        dot = tf.tensordot(user, movie, 2)
        return tf.nn.sigmoid(dot + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1]))


def build(strategy):
    with strategy.scope():
        model = Recommender()
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    return model


def epoch(model):
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    return time.perf_counter() - start, history.history["loss"][-1]


contenders = {"plain": build(tf.distribute.get_strategy())}
for mode in modes.split(","):
    bound = 0 if mode == "fresh" else 1
    contenders[mode] = build(tf_diffmap.Strategy(max_step_staleness=bound))
for model in contenders.values():
    epoch(model)
names = list(contenders)
for index in range(epochs):
    order = names if index % 2 == 0 else names[::-1]
    times = {}
    for name in order:
        times[name] = epoch(contenders[name])
    print(" ".join(f"{name}={times[name][0]:.3f},{times[name][1]:.4f}" for name in names))
"""

MODES = {"fresh": "fresh windows (default)", "async": "asynchronous windows"}


# The ratings of ml-latest-small, which the workload has the size of.
RATINGS = 100_836


def one_run(checkout: str, modes: list[str], epochs: int, ratings: int = RATINGS) -> list[dict]:
    """Per timed epoch pair, `{contender: (seconds, loss)}`, of one fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN, checkout, ",".join(modes), str(epochs), str(ratings)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"The run of {checkout} failed:\n{result.stderr[-3000:]}")
    pairs = []
    for line in result.stdout.splitlines()[-epochs:]:
        pair = {}
        for item in line.split():
            name, figures = item.split("=")
            seconds, loss = figures.split(",")
            pair[name] = (float(seconds), float(loss))
        pairs.append(pair)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", help="directories holding tf_diffmap/")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument(
        "--epochs", type=int, default=3, help="timed epochs of each, per process (default 3)"
    )
    parser.add_argument(
        "--async-windows", action="store_true", help="asynchronous windows too (bound 1)"
    )
    parser.add_argument(
        "--ratings",
        type=int,
        default=RATINGS,
        help=f"ratings drawn, 90%% of them trained on (default {RATINGS:,}, ml-latest-small's)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.epochs < 1:
        parser.error("--rounds and --epochs must be at least 1")
    if args.ratings < 640:
        parser.error("--ratings must be at least 640 (ten batches of 64)")
    modes = ["fresh", "async"] if args.async_windows else ["fresh"]
    seconds: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for index in range(args.rounds):
        order = args.checkouts if index % 2 == 0 else args.checkouts[::-1]
        for checkout in order:
            for pair in one_run(checkout, modes, args.epochs, args.ratings):
                plain = pair["plain"][0]
                for name, (took, _) in pair.items():
                    seconds.setdefault((checkout, name), []).append(took)
                    if name != "plain":
                        ratios.setdefault((checkout, name), []).append(took / plain)
                shown = ", ".join(
                    f"{name} {took:.1f} s (loss {loss:.4f})" for name, (took, loss) in pair.items()
                )
                ratio = ", ".join(
                    f"{MODES[m]} {pair[m][0] / plain:.2f}x" for m in modes if m in pair
                )
                print(f"round {index + 1}: {checkout}: {shown}; {ratio}", flush=True)
    for checkout in args.checkouts:
        for name in ["plain", *modes]:
            times = seconds[(checkout, name)]
            label = "plain Keras" if name == "plain" else MODES[name]
            line = f"{checkout}: {label}: median {statistics.median(times):.1f} s an epoch"
            line += f" ({min(times):.1f}-{max(times):.1f})"
            if name != "plain":
                pairs = ratios[(checkout, name)]
                line += (
                    f", {statistics.median(pairs):.2f}x plain Keras beside it "
                    f"(median of {len(pairs)} pairs, {min(pairs):.2f}-{max(pairs):.2f}x)"
                )
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
