# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stragglers and staleness policies
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tf-diffmap/tf_diffmap/blob/main/notebooks/stragglers_and_policies.ipynb)
#
# One slow device holds synchronous data parallelism back: at every step, every
# replica waits for the slowest before the gradients are summed. Asynchronous
# training lets the others go on, at the price of stale updates from the slow
# one. This notebook makes replica 0 a straggler and trains the same model
#
# - synchronously, with `tf.distribute.MirroredStrategy` over the same devices;
# - asynchronously with `tf_diffmap.Strategy()`, its default: the store
#   aggregates one fresh shard gradient per replica into each step of the
#   optimizer, and never waits for the slow one past a window's patience;
# - asynchronously with a step per shard, `tf_diffmap.Strategy(gradients_per_step=1)`,
#   under each staleness rule of `tf_diffmap.AsyncOptimizer`: `"none"`,
#   `"inverse"`, `"dc"` and `"drop"`;
# - with bounded staleness over asynchronous windows,
#   `tf_diffmap.Strategy(max_staleness=k, max_step_staleness=1)`;
#
# then plots the validation accuracy against wall time and the work share of
# each replica, and discusses the results.
#
# It runs on Colab's CPU runtime and on a GPU runtime, and locally in Jupyter.

# %% [markdown]
# ## Install
#
# The next cell installs `tf_diffmap` when it is not importable (on Colab, or
# in a fresh environment); where it is installed, as in a development checkout,
# it does nothing. `TF_DIFFMAP_SOURCE` says where it comes from. TensorFlow
# 2.21 comes with it: with CUDA on a GPU runtime; on Colab's CPU runtime the
# preinstalled TensorFlow is upgraded in place.
#
# If Colab then asks to restart the session (it does when pip replaced a
# package it had already loaded), restart it and run all cells again: this
# cell does nothing the second time.

# %%
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys

# Where to install tf_diffmap from (a pip requirement source).
TF_DIFFMAP_SOURCE = "git+https://github.com/tf-diffmap/tf_diffmap"


def distribution_installed(name):
    try:
        return bool(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return False


if importlib.util.find_spec("tf_diffmap") is None:
    if shutil.which("nvidia-smi"):  # a GPU: TensorFlow with CUDA
        requirements = [f"tf-diffmap[gpu] @ {TF_DIFFMAP_SOURCE}"]
    elif distribution_installed("tensorflow"):  # Colab's CPU runtime
        requirements = [f"tf-diffmap @ {TF_DIFFMAP_SOURCE}", "tensorflow>=2.21,<2.22"]
    else:
        requirements = [f"tf-diffmap[cpu] @ {TF_DIFFMAP_SOURCE}"]
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.check_call(pip + requirements + ["scikit-learn", "matplotlib"])

# %% [markdown]
# ## Parameters
#
# Everything you may want to change is here. With `TF_DIFFMAP_SMOKE=1` in the
# environment the notebook uses tiny settings: the project's tests run it so,
# to check that it works from top to bottom.

# %%
import os

SMOKE = os.environ.get("TF_DIFFMAP_SMOKE") == "1"  # tiny settings, for the tests

REPLICAS = 4  # replicas, each on a logical device of its own
GPU_MEMORY_MB = 1024  # memory of each logical GPU, on a GPU runtime
SAMPLES = 600 if SMOKE else 1797  # digit images to use (there are 1797)
EPOCHS = 1 if SMOKE else 15
BATCH_SIZE = 64

LEARNING_RATE = 1e-3
SLOW_SECONDS = 0.03  # replica 0 sleeps this long in each of its training steps
DROP_ABOVE = 2 * REPLICAS  # "drop": updates staler than this are not applied
MAX_STALENESS = 2  # bounded staleness: steps a replica may run ahead of the slowest

# %% [markdown]
# ## Split the device into replicas
#
# Data parallelism needs several devices, and a Colab runtime has one CPU or
# one GPU. TensorFlow can split a physical device into *logical* devices, and
# each runs a replica. It allows that only before it initializes its devices,
# so this cell must come before anything that creates a tensor or a model (if
# you ran other TensorFlow code first, restart the runtime).
#
# With a GPU, the GPU is split, each logical GPU getting `GPU_MEMORY_MB` of its
# memory; without one, the CPU is split. Replicas on one physical device share
# its compute: this shows how the strategy behaves, not a speed-up, which needs
# several physical devices.

# %%
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TensorFlow's info logs

import tensorflow as tf

import tf_diffmap

tf.get_logger().setLevel("WARNING")  # and its informational messages

if tf.config.list_physical_devices("GPU"):
    devices = tf_diffmap.split_devices(REPLICAS, "GPU", gpu_memory_mb=GPU_MEMORY_MB)
else:
    devices = tf_diffmap.split_devices(REPLICAS, "CPU")
print(f"TensorFlow {tf.__version__}, tf_diffmap {tf_diffmap.__version__}")
print("replica devices:", devices)

# %% [markdown]
# ## Data
#
# scikit-learn's digits: 8×8-pixel images of handwritten digits, bundled with
# scikit-learn, so nothing is downloaded. Pixels are scaled to [0, 1]; a quarter
# of the images is kept for validation.

# %%
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

x, y = load_digits(return_X_y=True)
x, y = (x[:SAMPLES] / 16.0).astype("float32"), y[:SAMPLES].astype("int32")
split = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
x_train, x_val, y_train, y_val = split
print(f"{len(x_train)} training and {len(x_val)} validation images")

# %% [markdown]
# Every run reads the same repeated `tf.data` pipeline, `STEPS_PER_EPOCH` batches
# per epoch. Keras keeps one iterator over a repeated dataset for the whole of
# `fit`; given arrays instead, it would rebuild its input iterator every epoch,
# which costs `MirroredStrategy` 0.3 to 2 seconds per epoch on several devices
# and would blur the comparison.

# %%
STEPS_PER_EPOCH = len(x_train) // BATCH_SIZE
train_data = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(len(x_train), seed=0)
    .repeat()
    .batch(BATCH_SIZE)
)

# %% [markdown]
# ## The model and the clock
#
# Every run trains the same model from the same initial weights, with replica 0
# slowed by `tf_diffmap.testing.ReplicaDelay`. The layer picks replicas by the
# replica id of whichever strategy runs the step, so it slows replica 0 under
# `MirroredStrategy` too.
#
# `AccuracyOverTime` records the validation accuracy before training and after
# each epoch, against the training time so far. Its clock stops while it
# measures, so that the runs are compared on training time alone; the first
# epoch includes building the step's graphs.

# %%
import time

import keras
import numpy as np


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            tf_diffmap.testing.ReplicaDelay(SLOW_SECONDS, replicas=[0]),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


class AccuracyOverTime(keras.callbacks.Callback):
    """Validation accuracy before training and after each epoch, and when."""

    def accuracy(self):
        predictions = self.model(x_val, training=False)  # the latest weights
        return float(np.mean(np.argmax(predictions, axis=-1) == y_val))

    def on_train_begin(self, logs=None):
        self.seconds, self.accuracies = [0.0], [self.accuracy()]
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.seconds[-1] + time.perf_counter() - self.start)
        self.accuracies.append(self.accuracy())
        self.start = time.perf_counter()  # the clock stopped while measuring


def train(strategy, make_optimizer):
    """Trains a fresh model under `strategy`; returns its AccuracyOverTime."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(make_optimizer(), loss="sparse_categorical_crossentropy")
    recorder = AccuracyOverTime()
    model.fit(
        train_data,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        shuffle=False,  # the dataset shuffles itself
        callbacks=[recorder],
        verbose=0,
    )
    return recorder


# %% [markdown]
# ## The runs
#
# - **MirroredStrategy (synchronous)**: at every step each replica computes the
#   gradient of its quarter of the batch, the gradients are summed and one update
#   is applied; the step lasts as long as the slowest replica.
#   `ReductionToOneDevice` sums them in a way that works on logical CPU and GPU
#   devices alike.
# - **tf_diffmap's default**: each replica pushes its gradient to the store, and
#   every `REPLICAS` fresh gradients (computed on the current parameters) make
#   one step of Adam, as in synchronous training; a replica that pushed waits
#   for its window to close, but never past the window's patience (about two
#   of the fast replicas' steps): then the fast replicas fill the places replica
#   0 cannot, and its late gradient is dropped (`max_step_staleness=0`).
# - The next four take **a step per shard** (`gradients_per_step=1`), the
#   behaviour the per-update rules of `tf_diffmap.AsyncOptimizer` correct:
# - **`"none"`**: plain asynchronous updates (Hogwild!, Downpour): each replica
#   applies its gradient as soon as it has it, however stale.
# - **`"inverse"`**: the learning rate of an update is divided by its staleness
#   (when above 1), so stale updates move the parameters less (Zhang et al. 2016).
# - **`"dc"`**: delay compensation (DC-ASGD-a, Zheng et al. 2017) corrects a stale
#   gradient towards the one at the current parameters, with a first-order term.
# - **`"drop"`**: updates staler than `DROP_ABOVE` are not applied at all.
# - **`max_staleness=MAX_STALENESS`**: bounded staleness (Stale Synchronous
#   Parallel, Ho et al. 2013) over asynchronous windows (`max_step_staleness=1`,
#   where no replica waits for a window): a replica more than
#   `MAX_STALENESS` steps ahead of the slowest waits for it.


# %%
def adam():
    return keras.optimizers.Adam(LEARNING_RATE)


def with_rule(staleness, **kwargs):
    return lambda: tf_diffmap.AsyncOptimizer(adam(), staleness=staleness, **kwargs)


def mirrored():
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def per_shard():
    return tf_diffmap.Strategy(gradients_per_step=1)


RUNS = {
    "MirroredStrategy (synchronous)": (mirrored, adam),
    "tf_diffmap (default)": (tf_diffmap.Strategy, adam),
    'tf_diffmap per shard, "none"': (per_shard, with_rule("none")),
    'tf_diffmap per shard, "inverse"': (per_shard, with_rule("inverse")),
    'tf_diffmap per shard, "dc"': (per_shard, with_rule("dc")),
    f'tf_diffmap per shard, "drop" above {DROP_ABOVE}': (
        per_shard,
        with_rule("drop", drop_above=DROP_ABOVE),
    ),
    f"tf_diffmap, max_staleness={MAX_STALENESS}": (
        lambda: tf_diffmap.Strategy(max_staleness=MAX_STALENESS, max_step_staleness=1),
        adam,
    ),
}

strategies, recorders = {}, {}
for name, (make_strategy, make_optimizer) in RUNS.items():
    strategies[name] = make_strategy()
    recorders[name] = recorder = train(strategies[name], make_optimizer)
    print(
        f"{name:38} {recorder.seconds[-1]:5.1f} s of training, "
        f"validation accuracy {recorder.accuracies[-1]:.3f}"
    )

# %% [markdown]
# ## Accuracy against wall time
#
# Each point is one epoch (the first, at 0 s, is the untrained model).

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(9, 5))
for name, recorder in recorders.items():
    synchronous = not isinstance(strategies[name], tf_diffmap.Strategy)
    style = dict(color="black", linewidth=2.5) if synchronous else {}
    ax.plot(recorder.seconds, recorder.accuracies, marker="o", label=name, **style)
ax.set(
    title=f"{REPLICAS} replicas, replica 0 sleeping {SLOW_SECONDS * 1000:g} ms a step",
    xlabel="training time (s)",
    ylabel="validation accuracy",
    ylim=(0.5, 1.0),  # the untrained model, at 0 s, is below
)
ax.legend()
plt.show()


# %% [markdown]
# ## Work share per replica
#
# Under `MirroredStrategy` every replica computes a quarter of every step, so
# each has an even share by construction, and the fast ones wait. Under
# `tf_diffmap` a replica's share is its fraction of the updates claimed, applied
# or dropped.


# %%
def work_share(strategy):
    if not isinstance(strategy, tf_diffmap.Strategy):
        return np.full(REPLICAS, 1 / REPLICAS)  # synchronous: even by construction
    return strategy.statistics().work_share  # updates computed, applied or dropped


fig, ax = plt.subplots(figsize=(11, 4))
width = 0.8 / len(strategies)
for i, (name, strategy) in enumerate(strategies.items()):
    ax.bar(np.arange(REPLICAS) + i * width, work_share(strategy), width, label=name)
ax.axhline(1 / REPLICAS, color="gray", linestyle="--", linewidth=1)
ax.set_xticks(np.arange(REPLICAS) + 0.4 - width / 2)
ax.set_xticklabels([f"replica {r}" for r in range(REPLICAS)])
ax.set(title="Share of the work per replica", ylabel="share")
ax.legend(fontsize="small", ncol=2)
plt.show()

# %% [markdown]
# And the staleness statistics of each asynchronous run:

# %%
for name, strategy in strategies.items():
    if isinstance(strategy, tf_diffmap.Strategy):
        print(f"{name}:\n{strategy.statistics()}\n")

# %% [markdown]
# ## Discussion
#
# Numbers vary from run to run and machine to machine. One run with the full
# settings on a shared 2-core CPU (2026-12-06, while other jobs kept it busy,
# so the seconds are loose): every run ended between 0.971 and 0.978
# validation accuracy; the synchronous run trained for 15.7 s and
# tf_diffmap's default of that day (asynchronous windows, before fresh windows
# became the default) for 9.8 s. What the figures show:
#
# - **Synchronous training runs at the straggler's pace.** Every step of
#   `MirroredStrategy` waits for replica 0's sleep, so its curve is stretched to
#   the right: the bars give each replica an even quarter of the work, but the
#   fast ones spend most of each step idle, waiting at the barrier.
# - **The default does not wait past a patience, and takes Adam's steps as
#   tuned.** Every window of `REPLICAS` fresh gradients makes one step of Adam
#   on a whole batch, as synchronous training does. A fast replica that pushed
#   waits for its window, but no longer than about two of its own steps: then
#   the waiting replicas compute in replica 0's place, and its share falls to
#   a few percent. Its gradients arrive after their window closed, so the
#   default drops them (*dropped* above): the straggler's work is largely
#   wasted, and the model never sees a stale gradient.
# - **A step per shard** (`gradients_per_step=1`) makes up to `REPLICAS`
#   updates of `BATCH_SIZE / REPLICAS` examples per batch rather than one of
#   `BATCH_SIZE`, so its curves may climb faster per epoch on this model
#   (Adam at a small learning rate), and its staleness is counted in versions
#   only. Replica 0's updates are 5 to 16 versions stale, the others' well
#   under 1, and the rules differ in what they do with the straggler's:
#   - `"none"` applies them as they are;
#   - `"inverse"` multiplies their learning rate by its *learning-rate factor*
#     above, so they barely count, and leaves the fast replicas' nearly unchanged;
#   - `"dc"` applies them corrected, for a little more work per update;
#   - `"drop"` throws away those staler than `DROP_ABOVE`.
#
#   On other models the step per shard is far less forgiving: with SGD and
#   momentum, or inputs scaled to [0, 1], it collapses where the default
#   holds (the documentation's "Staleness-aware updates" page has the grid).
# - **Bounded staleness brings the waiting back.** With `max_staleness` no replica
#   runs more than `MAX_STALENESS` steps ahead of the slowest: the shares are
#   even again, but against a replica that is *always* slow the others end up
#   waiting for it, nearly as under synchronous training. A bound pays off
#   against *transient* stragglers (a busy moment, a slow batch), which it
#   absorbs without waiting, while capping how stale an update can be.
#
# **When does the rule matter?** Under a step per shard, staleness grows with the
# number of replicas and with the straggler's slowness, and the harm it does
# grows with the learning rate. Try `LEARNING_RATE = 1e-2`, `REPLICAS = 8` or
# `SLOW_SECONDS = 0.1`: plain asynchronous updates get noisier, and the staleness-aware rules earn their
# keep. On a GPU runtime the steps themselves are faster, so the straggler's
# sleep weighs even more.
