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
# # Staleness in TensorBoard
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tf-diffmap/tf_diffmap/blob/main/notebooks/staleness_in_tensorboard.ipynb)
#
# Asynchronous training trades waiting for staleness: no replica waits for the
# others, but a gradient may be applied after other replicas have moved the
# parameters it was computed from. This notebook trains with one deliberately
# slow replica, records the staleness with `tf_diffmap.StalenessTensorBoard`,
# opens it in TensorBoard's **Staleness** tab, explains what the numbers mean,
# and reads them back in Python, for readers without TensorBoard.
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
EPOCHS = 2 if SMOKE else 15
BATCH_SIZE = 64

SLOW_SECONDS = 0.02  # replica 0 sleeps this long in each of its training steps
LOG_DIR = "logs/digits"  # this run's TensorBoard log directory

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
# ## A model with a slow replica
#
# `tf_diffmap.testing.ReplicaDelay` is an identity layer that sleeps in each
# training step of the replicas it names: here replica 0 becomes a straggler, as
# a slower or busier device would. At inference it does nothing.

# %%
import keras

strategy = tf_diffmap.Strategy()
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((64,)),
            tf_diffmap.testing.ReplicaDelay(SLOW_SECONDS, replicas=[0]),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )

# %% [markdown]
# ## Train with the Staleness callback
#
# Give `tf_diffmap.StalenessTensorBoard` the log directory of Keras' own
# `TensorBoard` callback: Keras writes losses and metrics into the runs `train`
# and `validation`, tf_diffmap writes the staleness into the run `staleness`.
# With `update_freq="epoch"` (the default) it writes one point per epoch;
# `"batch"`, or an integer `N`, writes one every batch or every `N` batches.
# Writing a point reads a few counters and never waits for the replicas.

# %%
import shutil

shutil.rmtree(LOG_DIR, ignore_errors=True)  # a clean log when run again
callbacks = [
    keras.callbacks.TensorBoard(LOG_DIR),
    tf_diffmap.StalenessTensorBoard(LOG_DIR, update_freq="epoch"),
]
history = model.fit(
    x_train,
    y_train,
    batch_size=BATCH_SIZE,
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    callbacks=callbacks,
    verbose=2,
)

# %% [markdown]
# ## Open TensorBoard
#
# In Colab and Jupyter, the next two cells open TensorBoard inside the notebook;
# elsewhere, run `tensorboard --logdir logs/digits` in a shell and open the address
# it prints. tf_diffmap installs its **Staleness** tab as a TensorBoard plugin: if
# the tab is not in the top bar, pick it from the menu at the bar's right. The
# same series are also in the *Scalars* and *Histograms* tabs, and in *Custom
# Scalars* with every replica's line in one chart. TensorBoard reloads the logs
# every 30 seconds, so it can stay open while you train again.

# %% tags=["colab-only"]
# %load_ext tensorboard

# %% tags=["colab-only"]
# %tensorboard --logdir {LOG_DIR}

# %% [markdown]
# ## What the numbers mean
#
# **Version and staleness.** The parameter store counts the updates applied to
# it: that count is its *version*. A replica reads the version before its forward
# pass and claims a new one when its gradient is ready. The **staleness** of the
# update is the number of updates other replicas applied in between: the updates
# its gradient did not see. 0 means none did; synchronous training has staleness
# 0 throughout. A replica whose steps take `k` times as long as the others' sees
# roughly `k × (REPLICAS - 1)` of their updates land during each of its steps.
#
# The **Staleness** tab shows:
#
# - **cards** at the top: the replicas and their devices, the store version, the
#   updates applied, the mean and largest staleness of the whole run, the
#   smallest work share (flagged when below half an even share), and the dropped
#   updates when a rule drops any;
# - **staleness over time, per replica**: one point per epoch here, covering the
#   updates since the previous point, with a menu of series: the mean and largest
#   staleness, the updates applied, the share of the updates, the examples per
#   second and, when a `tf_diffmap.AsyncOptimizer` rule is active, the dropped
#   updates and the factor the rule applied to the learning rate;
# - **staleness distribution over steps**: a heat map with a column per point and
#   a row per staleness 0, 1, 2, ..., shaded by the share of the point's updates
#   that had it (the strategy's last bin counts its staleness and all above);
# - **work share per replica**: each replica's share of all updates since training
#   began, against an even share of `1 / REPLICAS`; a replica below half of it is
#   marked as a straggler.
#
# **What to see here.** Replica 0 sleeps `SLOW_SECONDS` in each of its steps while
# the others take a few milliseconds, so it takes far fewer shards from the
# queue: its work share is well below `1 / REPLICAS`, and each of its updates is
# very stale, since the others applied many updates while it computed. The fast
# replicas' staleness stays mostly between 0 and 2, and the store version grows by
# about `REPLICAS` updates per batch whatever the slow replica does.
#
# **Healthy or worrying?**
#
# |  | Healthy | Worrying |
# | --- | --- | --- |
# | Work share | about `1 / REPLICAS` each, or in proportion to the devices' speeds | one replica far below the others (a straggler), or shares drifting over time |
# | Mean staleness | small (below `REPLICAS`) and steady | large for one replica, or growing from epoch to epoch |
# | Distribution | piled up at small staleness, short tail | a long tail, or counts in the last bin |
# | Store version | grows by the same amount each epoch | grows more slowly: throughput fell |
# | Dropped updates, learning-rate factor | few dropped, factor near 1 | many dropped (wasted work), or a factor near 0 (the updates barely count) |
#
# A straggler's gradients are few but stale. By default the store aggregates
# one fresh gradient per replica (computed on the current parameters) into each
# step of the optimizer and drops those that arrive after their window closed,
# so the tab also shows the staleness in optimizer steps (the unit switch: 0 for
# every gradient applied) and the dropped gradients, most of them the
# straggler's. If you take a step per shard
# (`tf_diffmap.Strategy(gradients_per_step=1)`), bound the staleness with
# `tf_diffmap.Strategy(gradients_per_step=1, max_staleness=k)` or try the rules of
# `tf_diffmap.AsyncOptimizer`, and compare: the next notebook does.

# %% [markdown]
# ## The same numbers in Python
#
# `strategy.statistics()` holds the whole run's counters:

# %%
stats = strategy.statistics()
print(stats)

# %% [markdown]
# The points written for TensorBoard can be read back with TensorBoard's
# `EventAccumulator`. `StalenessTensorBoard` writes its series as TensorFlow 2
# summaries, which are tensors: read them with `Tensors(tag)`, not `Scalars(tag)`.
# The tags are `staleness/mean/replica_<i>`, `staleness/max/replica_<i>`,
# `work/share/replica_<i>`, `work/updates/replica_<i>`, `store/version`, ...
# (`.../all` for all replicas together).

# %%
from tensorboard.backend.event_processing import event_accumulator

events = event_accumulator.EventAccumulator(
    os.path.join(LOG_DIR, "staleness"),
    size_guidance={event_accumulator.TENSORS: 0},  # 0: keep every point
)
events.Reload()


def series(tag):
    """The steps and values of one scalar series."""
    points = events.Tensors(tag)
    steps = [p.step for p in points]
    return steps, [tf.make_ndarray(p.tensor_proto).item() for p in points]


print("store version at each epoch:", series("store/version")[1])

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 3, figsize=(15, 4), layout="constrained")
mean_ax, share_ax, hist_ax = axes
largest = stats.overall_max_staleness
for r in range(REPLICAS):
    label = f"replica {r}"
    mean_ax.plot(*series(f"staleness/mean/replica_{r}"), marker="o", label=label)
    share_ax.plot(*series(f"work/share/replica_{r}"), marker="o", label=label)
    hist_ax.plot(stats.histogram[r, : largest + 1], drawstyle="steps-mid", label=label)
share_ax.axhline(1 / REPLICAS, color="gray", linestyle="--", label="even share")
mean_ax.set(title="Mean staleness", xlabel="epoch", ylabel="staleness")
share_ax.set(title="Share of the epoch's updates", xlabel="epoch", ylabel="share")
hist_ax.set(title="Staleness of every update", xlabel="staleness", ylabel="updates")
fig.legend(*share_ax.get_legend_handles_labels(), loc="outside upper center", ncol=5)
plt.show()

# %% [markdown]
# On the left, replica 0's updates are several times staler than the others', at
# every epoch; in the middle, its share of each epoch's updates stays far below an
# even share; on the right, the fast replicas' updates pile up at staleness 0 to
# 2, while replica 0's few updates spread over a long tail.
#
# Try `SLOW_SECONDS = 0` (every replica equally fast), a larger delay, or
# `update_freq="batch"` to see points within an epoch.
