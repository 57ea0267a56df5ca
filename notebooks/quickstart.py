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
# # Quick start
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tf-diffmap/tf_diffmap/blob/main/notebooks/quickstart.ipynb)
#
# `tf_diffmap` trains a Keras model *asynchronously* on several devices, from
# plain `model.fit`: every replica computes the gradient of its own shard of each
# batch and applies it to a shared parameter store at once, without waiting for
# the others. A slow device holds nobody back, and a version counter measures
# how *stale* each update was.
#
# In this notebook you will:
#
# 1. install `tf_diffmap`;
# 2. split the one device you have (a CPU or a GPU) into logical devices, one
#    per replica;
# 3. train a classifier of handwritten digits with `tf_diffmap.Strategy`;
# 4. evaluate it, save it to a `.keras` file and load it back;
# 5. read the staleness statistics of the run.
#
# It runs on Colab's CPU runtime and on a GPU runtime (*Runtime → Change runtime
# type*), and locally in Jupyter.

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
# ## Train with the strategy
#
# `tf_diffmap.Strategy()` takes every GPU, or where there is none every CPU
# device: here, the logical devices made above. As with any `tf.distribute`
# strategy, create the model **and its optimizer** inside `strategy.scope()`.
# Any Keras optimizer works, with the learning rate you would use for
# synchronous training: the store aggregates one fresh gradient per replica
# (computed on the current parameters) into each of its steps (see the third
# notebook).

# %%
import keras

strategy = tf_diffmap.Strategy()
print(strategy)

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((64,)),
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
# `model.fit` is unchanged. Each batch of `BATCH_SIZE` images is split into
# `REPLICAS` shards, which the replicas take from a shared queue: each computes
# the gradient of its shard and applies it to the parameter store on its own, so
# a batch makes up to `REPLICAS` updates. The loss and accuracy shown at the end
# of an epoch are read after every update of the epoch has landed.

# %%
history = model.fit(
    x_train,
    y_train,
    batch_size=BATCH_SIZE,
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    verbose=2,
)

# %% [markdown]
# ## Evaluate
#
# `evaluate` and `predict` are synchronous: the strategy waits for every update
# in flight, then runs them on one device.

# %%
loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
print(f"validation loss {loss:.3f}, accuracy {accuracy:.3f}")

# %% [markdown]
# ## Save and reload
#
# Saving also waits for the updates in flight, so the file holds what was
# trained. The `.keras` file is an ordinary Keras model: load it with or without
# a strategy.

# %%
import numpy as np

model.save("digits.keras")
restored = keras.models.load_model("digits.keras")

predictions = restored.predict(x_val, verbose=0)
np.testing.assert_allclose(predictions, model.predict(x_val, verbose=0), atol=1e-6)
accuracy = np.mean(predictions.argmax(axis=-1) == y_val)
print(f"The reloaded model predicts the same: accuracy {accuracy:.3f}")

# %% [markdown]
# ## Staleness statistics
#
# The store counts its updates: that count is its *version*. A replica reads the
# version before its forward pass and claims a new one when it applies its
# gradient; the update's **staleness** is the number of updates other replicas
# applied in between, the updates its gradient did not see. 0 means none did;
# synchronous training has staleness 0 throughout.
#
# `strategy.statistics()` is a snapshot of the counters, per replica:

# %%
stats = strategy.statistics()
print(stats)

# %% [markdown]
# - `store version`: the updates applied in all (about `REPLICAS` per batch);
# - for each replica, the updates it applied and their share of all updates (its
#   *work share*), and the mean and the largest staleness of its updates.
#
# With replicas of equal speed each gets about `1 / REPLICAS` of the updates,
# and the staleness stays small, below `REPLICAS` on average. The same figures,
# as NumPy arrays:

# %%
print("work share per replica:   ", stats.work_share.round(3))
print("mean staleness per replica:", stats.mean_staleness.round(2))
print("updates of staleness 0, 1, 2, ...:", stats.histogram.sum(axis=0)[:10])

# %% [markdown]
# ## Next
#
# - [Staleness in TensorBoard](https://colab.research.google.com/github/tf-diffmap/tf_diffmap/blob/main/notebooks/staleness_in_tensorboard.ipynb): watch
#   these figures during training in TensorBoard's Staleness tab, with one
#   replica made slow, and learn what they mean.
# - [Stragglers and staleness policies](https://colab.research.google.com/github/tf-diffmap/tf_diffmap/blob/main/notebooks/stragglers_and_policies.ipynb):
#   a slow replica under synchronous `MirroredStrategy`, and under `tf_diffmap`
#   with each staleness rule and with bounded staleness.
