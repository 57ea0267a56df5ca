"""An epoch of a regularized recommender: plain Keras and tf_diffmap checkouts, side by side.

`python -m benchmarks.regularized_recommender CHECKOUT [CHECKOUT ...]
[--rounds N] [--async-windows]` runs, in a fresh process each and in turn
every round, plain Keras and tf_diffmap from each checkout (a directory
holding `tf_diffmap/`), and prints each run's epoch time, the medians, and
each contender's ratio to plain Keras in the same round (and their median).

The workload is keras-io's MovieLens recommender ("Collaborative Filtering
for Movie Recommendations") at the size of ml-latest-small: 610 users and
9,724 movies as embeddings of 50 with `embeddings_regularizer=l2(1e-6)`,
a bias embedding of each, their dot product summed over the batch, as the
example writes it (`tensordot(user, movie, 2)`), through a sigmoid; Adam
(1e-3), binary cross-entropy, batch 64, 90,752 training ratings
(synthetic, low-rank). tf_diffmap runs its defaults (fresh windows) on 4
logical CPU devices, and with `--async-windows` asynchronous windows
(`max_step_staleness=1`) too. An epoch's time is the second epoch's
(the first traces the functions). It says what the regularizer's dense
table gradients cost per step; it says nothing of convergence.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
checkout, mode = sys.argv[1], sys.argv[2]
sys.path.insert(0, checkout)
import tf_diffmap
tf_diffmap.split_devices(4, "CPU")
import keras, numpy as np, tensorflow as tf

USERS, MOVIES, RATINGS, WIDTH = 610, 9_724, 100_836, 50
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


class Epochs(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


if mode == "plain":
    scope = tf.distribute.get_strategy().scope()
else:
    strategy = tf_diffmap.Strategy(max_step_staleness=0 if mode == "fresh" else 1)
    scope = strategy.scope()
with scope:
    model = Recommender()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
timer = Epochs()
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[timer])
print(timer.seconds, history.history["loss"][-1])
"""

MODES = {"fresh": "fresh windows (default)", "async": "asynchronous windows"}


def one_run(checkout: str, mode: str) -> tuple[float, float]:
    """(seconds of the second epoch, its training loss) of one fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN, checkout, mode], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"The {mode} run of {checkout} failed:\n{result.stderr[-3000:]}")
    seconds, loss = result.stdout.split()[-2:]
    return float(seconds), float(loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", help="directories holding tf_diffmap/")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--async-windows", action="store_true", help="asynchronous windows too (bound 1)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, received {args.rounds}")
    modes = ["fresh", "async"] if args.async_windows else ["fresh"]
    contenders = [("plain Keras", args.checkouts[0], "plain")]
    contenders += [(f"{c}: {MODES[m]}", c, m) for c in args.checkouts for m in modes]
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in contenders[1:]}
    for index in range(args.rounds):
        # In turn, the order reversed every second round, so that the
        # host's load drifts over every contender alike.
        order = contenders if index % 2 == 0 else contenders[::-1]
        this_round = {}
        for name, checkout, mode in order:
            took, loss = one_run(checkout, mode)
            this_round[name] = took
            seconds[name].append(took)
            print(f"round {index + 1}: {name}: {took:.1f} s an epoch (loss {loss:.4f})", flush=True)
        for name in ratios:
            ratios[name].append(this_round[name] / this_round["plain Keras"])
        print(
            f"round {index + 1}: "
            + ", ".join(f"{name} {ratios[name][-1]:.2f}x" for name in ratios),
            flush=True,
        )
    for name, times in seconds.items():
        line = f"{name}: median {statistics.median(times):.1f} s an epoch"
        line += f" ({min(times):.1f}-{max(times):.1f})"
        if name in ratios:
            line += (
                f", {statistics.median(ratios[name]):.2f}x plain Keras "
                f"(rounds {min(ratios[name]):.2f}-{max(ratios[name]):.2f}x)"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
