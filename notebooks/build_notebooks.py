"""Writes the tutorial notebooks of this directory from the Python source below.

The notebooks are generated so that they are reviewed as code and committed
without outputs. To change one, edit this file and run

    python notebooks/build_notebooks.py          # rewrites the .ipynb files
    python notebooks/build_notebooks.py --check  # fails if they are out of date

`tests/test_notebooks.py` checks that the committed notebooks are what this
script writes, and runs each of them in smoke mode (`TF_DIFFMAP_SMOKE=1`).

Conventions of every notebook: an "Open in Colab" badge; a first code cell
that installs tf_diffmap when it is not importable (from `TF_DIFFMAP_SOURCE`);
a parameters cell with full defaults and tiny ones when `TF_DIFFMAP_SMOKE=1`;
cells that only make sense live (the inline TensorBoard) tagged `colab-only`,
which the tests skip.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

GITHUB_REPO = "tf-diffmap/tf_diffmap"
"""Where the repository lives on GitHub: the Colab badges and the install cell point here."""

GITHUB_BRANCH = "main"
"""The branch the Colab badges open the notebooks from."""

TF_DIFFMAP_SOURCE = f"git+https://github.com/{GITHUB_REPO}"
"""What the notebooks' install cell installs tf_diffmap from (a pip requirement source)."""

SMOKE_ENV = "TF_DIFFMAP_SMOKE"
"""Environment variable that selects the notebooks' tiny smoke-test settings when "1"."""

COLAB_ONLY = "colab-only"
"""Tag of cells that need a live notebook front end (Colab or Jupyter); tests skip them."""

HERE = Path(__file__).resolve().parent

NOTEBOOK_TITLES = {
    "quickstart": "Quick start",
    "staleness_in_tensorboard": "Staleness in TensorBoard",
    "stragglers_and_policies": "Stragglers and staleness policies",
}


def colab_url(name: str) -> str:
    """The URL that opens notebook `name` (without `.ipynb`) in Colab."""
    return (
        f"https://colab.research.google.com/github/{GITHUB_REPO}/blob/{GITHUB_BRANCH}"
        f"/notebooks/{name}.ipynb"
    )


def colab_badge(name: str) -> str:
    """Markdown of the "Open in Colab" badge of notebook `name`."""
    return (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({colab_url(name)})"
    )


# -- cells ---------------------------------------------------------------------


def md(text: str, **blocks: str) -> nbformat.NotebookNode:
    """A Markdown cell; `{name}` placeholders are replaced by `blocks` after dedenting."""
    text = textwrap.dedent(text).strip()
    for name, block in blocks.items():
        text = text.replace(f"{{{name}}}", block)
    return nbformat.v4.new_markdown_cell(text)


def code(text: str, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(text).strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def live(text: str) -> nbformat.NotebookNode:
    """A cell that needs a live notebook front end; tests skip it."""
    return code(text, tags=(COLAB_ONLY,))


def install_cells() -> list[nbformat.NotebookNode]:
    return [
        md(
            """
            ## Install

            The next cell installs `tf_diffmap` when it is not importable (on Colab, or
            in a fresh environment); where it is installed, as in a development checkout,
            it does nothing. `TF_DIFFMAP_SOURCE` says where it comes from. TensorFlow
            2.21 comes with it: with CUDA on a GPU runtime; on Colab's CPU runtime the
            preinstalled TensorFlow is upgraded in place.

            If Colab then asks to restart the session (it does when pip replaced a
            package it had already loaded), restart it and run all cells again: this
            cell does nothing the second time.
            """
        ),
        code(
            f'''
            import importlib.metadata
            import importlib.util
            import shutil
            import subprocess
            import sys

            # Where to install tf_diffmap from (a pip requirement source).
            TF_DIFFMAP_SOURCE = "{TF_DIFFMAP_SOURCE}"


            def distribution_installed(name):
                try:
                    return bool(importlib.metadata.version(name))
                except importlib.metadata.PackageNotFoundError:
                    return False


            if importlib.util.find_spec("tf_diffmap") is None:
                if shutil.which("nvidia-smi"):  # a GPU: TensorFlow with CUDA
                    requirements = [f"tf-diffmap[gpu] @ {{TF_DIFFMAP_SOURCE}}"]
                elif distribution_installed("tensorflow"):  # Colab's CPU runtime
                    requirements = [f"tf-diffmap @ {{TF_DIFFMAP_SOURCE}}", "tensorflow>=2.21,<2.22"]
                else:
                    requirements = [f"tf-diffmap[cpu] @ {{TF_DIFFMAP_SOURCE}}"]
                pip = [sys.executable, "-m", "pip", "install", "--quiet"]
                subprocess.check_call(pip + requirements + ["scikit-learn", "matplotlib"])
            '''
        ),
    ]


def parameters_cells(epochs: tuple[int, int], extra: str = "") -> list[nbformat.NotebookNode]:
    """The parameters cell: shared parameters, `EPOCHS` (smoke, full), then `extra`."""
    smoke_epochs, full_epochs = epochs
    shared = f"""
        import os

        SMOKE = os.environ.get("{SMOKE_ENV}") == "1"  # tiny settings, for the tests

        REPLICAS = 4  # replicas, each on a logical device of its own
        GPU_MEMORY_MB = 1024  # memory of each logical GPU, on a GPU runtime
        SAMPLES = 600 if SMOKE else 1797  # digit images to use (there are 1797)
        EPOCHS = {smoke_epochs} if SMOKE else {full_epochs}
        BATCH_SIZE = 64
        """
    return [
        md(
            f"""
            ## Parameters

            Everything you may want to change is here. With `{SMOKE_ENV}=1` in the
            environment the notebook uses tiny settings: the project's tests run it so,
            to check that it works from top to bottom.
            """
        ),
        code(textwrap.dedent(shared) + textwrap.dedent(extra)),
    ]


def devices_cells() -> list[nbformat.NotebookNode]:
    return [
        md(
            """
            ## Split the device into replicas

            Data parallelism needs several devices, and a Colab runtime has one CPU or
            one GPU. TensorFlow can split a physical device into *logical* devices, and
            each runs a replica. It allows that only before it initializes its devices,
            so this cell must come before anything that creates a tensor or a model (if
            you ran other TensorFlow code first, restart the runtime).

            With a GPU, the GPU is split, each logical GPU getting `GPU_MEMORY_MB` of its
            memory; without one, the CPU is split. Replicas on one physical device share
            its compute: this shows how the strategy behaves, not a speed-up, which needs
            several physical devices.
            """
        ),
        code(
            """
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet TensorFlow's start-up logs

            import tensorflow as tf

            import tf_diffmap

            tf.get_logger().setLevel("WARNING")  # and its informational messages

            if tf.config.list_physical_devices("GPU"):
                devices = tf_diffmap.split_devices(REPLICAS, "GPU", gpu_memory_mb=GPU_MEMORY_MB)
            else:
                devices = tf_diffmap.split_devices(REPLICAS, "CPU")
            print(f"TensorFlow {tf.__version__}, tf_diffmap {tf_diffmap.__version__}")
            print("replica devices:", devices)
            """
        ),
    ]


def data_cells() -> list[nbformat.NotebookNode]:
    return [
        md(
            """
            ## Data

            scikit-learn's digits: 8×8-pixel images of handwritten digits, bundled with
            scikit-learn, so nothing is downloaded. Pixels are scaled to [0, 1]; a quarter
            of the images is kept for validation.
            """
        ),
        code(
            """
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            x, y = load_digits(return_X_y=True)
            x, y = (x[:SAMPLES] / 16.0).astype("float32"), y[:SAMPLES].astype("int32")
            split = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
            x_train, x_val, y_train, y_val = split
            print(f"{len(x_train)} training and {len(x_val)} validation images")
            """
        ),
    ]


def title_cell(name: str, body: str) -> nbformat.NotebookNode:
    body = textwrap.dedent(body).strip()
    return md(f"# {NOTEBOOK_TITLES[name]}\n\n{colab_badge(name)}\n\n{body}")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A Markdown table (kept out of the text, whose lines must stay short)."""
    lines = [header, tuple("---" for _ in header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


HEALTH = table(
    ("", "Healthy", "Worrying"),
    [
        (
            "Work share",
            "about `1 / REPLICAS` each, or in proportion to the devices' speeds",
            "one replica far below the others (a straggler), or shares drifting over time",
        ),
        (
            "Mean staleness",
            "small (below `REPLICAS`) and steady",
            "large for one replica, or growing from epoch to epoch",
        ),
        (
            "Distribution",
            "piled up at small staleness, short tail",
            "a long tail, or counts in the last bin",
        ),
        (
            "Store version",
            "grows by the same amount each epoch",
            "grows more slowly: throughput fell",
        ),
        (
            "Dropped updates, learning-rate factor",
            "few dropped, factor near 1",
            "many dropped (wasted work), or a factor near 0 (the updates barely count)",
        ),
    ],
)


# -- notebook 1: quick start -----------------------------------------------------


def quickstart() -> list[nbformat.NotebookNode]:
    return [
        title_cell(
            "quickstart",
            """
            `tf_diffmap` trains a Keras model *asynchronously* on several devices, from
            plain `model.fit`: every replica computes the gradient of its own shard of each
            batch and applies it to a shared parameter store at once, without waiting for
            the others. A slow device holds nobody back, and a version counter measures
            how *stale* each update was.

            In this notebook you will:

            1. install `tf_diffmap`;
            2. split the one device you have (a CPU or a GPU) into logical devices, one
               per replica;
            3. train a classifier of handwritten digits with `tf_diffmap.Strategy`;
            4. evaluate it, save it to a `.keras` file and load it back;
            5. read the staleness statistics of the run.

            It runs on Colab's CPU runtime and on a GPU runtime (*Runtime → Change runtime
            type*), and locally in Jupyter.
            """,
        ),
        *install_cells(),
        *parameters_cells(epochs=(2, 15)),
        *devices_cells(),
        *data_cells(),
        md(
            """
            ## Train with `tf_diffmap.Strategy`

            `tf_diffmap.Strategy()` takes every GPU, or where there is none every CPU
            device: here, the logical devices made above. As with any `tf.distribute`
            strategy, create the model **and its optimizer** inside `strategy.scope()`.
            Any Keras optimizer works; `tf_diffmap.AsyncOptimizer` adds staleness-aware
            update rules (see the third notebook).
            """
        ),
        code(
            """
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
            """
        ),
        md(
            """
            `model.fit` is unchanged. Each batch of `BATCH_SIZE` images is split into
            `REPLICAS` shards, which the replicas take from a shared queue: each computes
            the gradient of its shard and applies it to the parameter store on its own, so
            a batch makes up to `REPLICAS` updates. The loss and accuracy shown at the end
            of an epoch are read after every update of the epoch has landed.
            """
        ),
        code(
            """
            history = model.fit(
                x_train,
                y_train,
                batch_size=BATCH_SIZE,
                epochs=EPOCHS,
                validation_data=(x_val, y_val),
                verbose=2,
            )
            """
        ),
        md(
            """
            ## Evaluate

            `evaluate` and `predict` are synchronous: the strategy waits for every update
            in flight, then runs them on one device.
            """
        ),
        code(
            """
            loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
            print(f"validation loss {loss:.3f}, accuracy {accuracy:.3f}")
            """
        ),
        md(
            """
            ## Save and reload

            Saving also waits for the updates in flight, so the file holds what was
            trained. The `.keras` file is an ordinary Keras model: load it with or without
            a strategy.
            """
        ),
        code(
            """
            import numpy as np

            model.save("digits.keras")
            restored = keras.models.load_model("digits.keras")

            predictions = restored.predict(x_val, verbose=0)
            np.testing.assert_allclose(predictions, model.predict(x_val, verbose=0), atol=1e-6)
            accuracy = np.mean(predictions.argmax(axis=-1) == y_val)
            print(f"The reloaded model predicts the same: accuracy {accuracy:.3f}")
            """
        ),
        md(
            """
            ## Staleness statistics

            The store counts its updates: that count is its *version*. A replica reads the
            version before its forward pass and claims a new one when it applies its
            gradient; the update's **staleness** is the number of updates other replicas
            applied in between, the updates its gradient did not see. 0 means none did;
            synchronous training has staleness 0 throughout.

            `strategy.statistics()` is a snapshot of the counters, per replica:
            """
        ),
        code(
            """
            stats = strategy.statistics()
            print(stats)
            """
        ),
        md(
            """
            - `store version`: the updates applied in all (about `REPLICAS` per batch);
            - for each replica, the updates it applied and their share of all updates (its
              *work share*), and the mean and the largest staleness of its updates.

            With replicas of equal speed each gets about `1 / REPLICAS` of the updates,
            and the staleness stays small, below `REPLICAS` on average. The same figures,
            as NumPy arrays:
            """
        ),
        code(
            """
            print("work share per replica:   ", stats.work_share.round(3))
            print("mean staleness per replica:", stats.mean_staleness.round(2))
            print("updates of staleness 0, 1, 2, ...:", stats.histogram.sum(axis=0)[:10])
            """
        ),
        md(
            f"""
            ## Next

            - [Staleness in TensorBoard]({colab_url("staleness_in_tensorboard")}): watch
              these figures during training in TensorBoard's Staleness tab, with one
              replica made slow, and learn what they mean.
            - [Stragglers and staleness policies]({colab_url("stragglers_and_policies")}):
              a slow replica under synchronous `MirroredStrategy`, and under `tf_diffmap`
              with each staleness rule and with bounded staleness.
            """
        ),
    ]


# -- notebook 2: staleness in TensorBoard ------------------------------------------


def staleness_in_tensorboard() -> list[nbformat.NotebookNode]:
    return [
        title_cell(
            "staleness_in_tensorboard",
            """
            Asynchronous training trades waiting for staleness: no replica waits for the
            others, but a gradient may be applied after other replicas have moved the
            parameters it was computed from. This notebook trains with one deliberately
            slow replica, records the staleness with `tf_diffmap.StalenessTensorBoard`,
            opens it in TensorBoard's **Staleness** tab, explains what the numbers mean,
            and reads them back in Python, for readers without TensorBoard.

            It runs on Colab's CPU runtime and on a GPU runtime, and locally in Jupyter.
            """,
        ),
        *install_cells(),
        *parameters_cells(
            epochs=(2, 15),
            extra="""
            SLOW_SECONDS = 0.02  # replica 0 sleeps this long in each of its training steps
            LOG_DIR = "logs/digits"  # this run's TensorBoard log directory
            """,
        ),
        *devices_cells(),
        *data_cells(),
        md(
            """
            ## A model with a slow replica

            `tf_diffmap.testing.ReplicaDelay` is an identity layer that sleeps in each
            training step of the replicas it names: here replica 0 becomes a straggler, as
            a slower or busier device would. At inference it does nothing.
            """
        ),
        code(
            """
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
            """
        ),
        md(
            """
            ## Train with `StalenessTensorBoard`

            Give `tf_diffmap.StalenessTensorBoard` the log directory of Keras' own
            `TensorBoard` callback: Keras writes losses and metrics into the runs `train`
            and `validation`, tf_diffmap writes the staleness into the run `staleness`.
            With `update_freq="epoch"` (the default) it writes one point per epoch;
            `"batch"`, or an integer `N`, writes one every batch or every `N` batches.
            Writing a point reads a few counters and never waits for the replicas.
            """
        ),
        code(
            """
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
            """
        ),
        md(
            """
            ## Open TensorBoard

            In Colab and Jupyter, the next two cells open TensorBoard inside the notebook;
            elsewhere, run `tensorboard --logdir logs/digits` in a shell and open the address
            it prints. tf_diffmap installs its **Staleness** tab as a TensorBoard plugin: if
            the tab is not in the top bar, pick it from the menu at the bar's right. The
            same series are also in the *Scalars* and *Histograms* tabs, and in *Custom
            Scalars* with every replica's line in one chart. TensorBoard reloads the logs
            every 30 seconds, so it can stay open while you train again.
            """
        ),
        live("%load_ext tensorboard"),
        live("%tensorboard --logdir {LOG_DIR}"),
        md(
            """
            ## What the numbers mean

            **Version and staleness.** The parameter store counts the updates applied to
            it: that count is its *version*. A replica reads the version before its forward
            pass and claims a new one when its gradient is ready. The **staleness** of the
            update is the number of updates other replicas applied in between: the updates
            its gradient did not see. 0 means none did; synchronous training has staleness
            0 throughout. A replica whose steps take `k` times as long as the others' sees
            roughly `k × (REPLICAS - 1)` of their updates land during each of its steps.

            The **Staleness** tab shows:

            - **cards** at the top: the replicas and their devices, the store version, the
              updates applied, the mean and largest staleness of the whole run, the
              smallest work share (flagged when below half an even share), and the dropped
              updates when a rule drops any;
            - **staleness over time, per replica**: one point per epoch here, covering the
              updates since the previous point, with a menu of series: the mean and largest
              staleness, the updates applied, the share of the updates, the examples per
              second and, when a `tf_diffmap.AsyncOptimizer` rule is active, the dropped
              updates and the factor the rule applied to the learning rate;
            - **staleness distribution over steps**: a heat map with a column per point and
              a row per staleness 0, 1, 2, ..., shaded by the share of the point's updates
              that had it (the strategy's last bin counts its staleness and all above);
            - **work share per replica**: each replica's share of all updates since training
              began, against an even share of `1 / REPLICAS`; a replica below half of it is
              marked as a straggler.

            **What to see here.** Replica 0 sleeps `SLOW_SECONDS` in each of its steps while
            the others take a few milliseconds, so it takes far fewer shards from the
            queue: its work share is well below `1 / REPLICAS`, and each of its updates is
            very stale, since the others applied many updates while it computed. The fast
            replicas' staleness stays mostly between 0 and 2, and the store version grows by
            about `REPLICAS` updates per batch whatever the slow replica does.

            **Healthy or worrying?**

            {HEALTH}

            A straggler's updates are few but stale. With SGD, wrap the optimizer in
            `tf_diffmap.AsyncOptimizer(optimizer)` and keep its default rule (with
            momentum `"linear"`, the learning rate divided by the number of replicas;
            without, `"gap"`), which the package's convergence table measured to keep SGD
            training where plain asynchronous SGD collapsed. Adam, as here, held without a
            rule there. If a straggler's updates
            still hurt, bound the staleness with `tf_diffmap.Strategy(max_staleness=k)` or
            try a rule such as `"inverse"` or `"drop"`, and compare: the next notebook
            does.
            """,
            HEALTH=HEALTH,
        ),
        md(
            """
            ## The same numbers in Python

            `strategy.statistics()` holds the whole run's counters:
            """
        ),
        code(
            """
            stats = strategy.statistics()
            print(stats)
            """
        ),
        md(
            """
            The points written for TensorBoard can be read back with TensorBoard's
            `EventAccumulator`. `StalenessTensorBoard` writes its series as TensorFlow 2
            summaries, which are tensors: read them with `Tensors(tag)`, not `Scalars(tag)`.
            The tags are `staleness/mean/replica_<i>`, `staleness/max/replica_<i>`,
            `work/share/replica_<i>`, `work/updates/replica_<i>`, `store/version`, ...
            (`.../all` for all replicas together).
            """
        ),
        code(
            """
            from tensorboard.backend.event_processing import event_accumulator

            events = event_accumulator.EventAccumulator(
                os.path.join(LOG_DIR, "staleness"),
                size_guidance={event_accumulator.TENSORS: 0},  # 0: keep every point
            )
            events.Reload()


            def series(tag):
                \"\"\"The steps and values of one scalar series.\"\"\"
                points = events.Tensors(tag)
                steps = [p.step for p in points]
                return steps, [tf.make_ndarray(p.tensor_proto).item() for p in points]


            print("store version at each epoch:", series("store/version")[1])
            """
        ),
        code(
            """
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
            """
        ),
        md(
            """
            On the left, replica 0's updates are several times staler than the others', at
            every epoch; in the middle, its share of each epoch's updates stays far below an
            even share; on the right, the fast replicas' updates pile up at staleness 0 to
            2, while replica 0's few updates spread over a long tail.

            Try `SLOW_SECONDS = 0` (every replica equally fast), a larger delay, or
            `update_freq="batch"` to see points within an epoch.
            """
        ),
    ]


# -- notebook 3: stragglers and policies -------------------------------------------


def stragglers_and_policies() -> list[nbformat.NotebookNode]:
    return [
        title_cell(
            "stragglers_and_policies",
            """
            One slow device holds synchronous data parallelism back: at every step, every
            replica waits for the slowest before the gradients are summed. Asynchronous
            training lets the others go on, at the price of stale updates from the slow
            one. This notebook makes replica 0 a straggler and trains the same model

            - synchronously, with `tf.distribute.MirroredStrategy` over the same devices;
            - asynchronously with `tf_diffmap.Strategy`, with each staleness rule of
              `tf_diffmap.AsyncOptimizer`: `"none"`, `"inverse"`, `"dc"` and `"drop"`;
            - with bounded staleness, `tf_diffmap.Strategy(max_staleness=k)`;

            then plots the validation accuracy against wall time and the work share of
            each replica, and discusses the results.

            It runs on Colab's CPU runtime and on a GPU runtime, and locally in Jupyter.
            """,
        ),
        *install_cells(),
        *parameters_cells(
            epochs=(1, 15),
            extra="""
            LEARNING_RATE = 1e-3
            SLOW_SECONDS = 0.03  # replica 0 sleeps this long in each of its training steps
            DROP_ABOVE = 2 * REPLICAS  # "drop": updates staler than this are not applied
            MAX_STALENESS = 2  # bounded staleness: steps a replica may run ahead of the slowest
            """,
        ),
        *devices_cells(),
        *data_cells(),
        md(
            """
            Every run reads the same repeated `tf.data` pipeline, `STEPS_PER_EPOCH` batches
            per epoch. Keras keeps one iterator over a repeated dataset for the whole of
            `fit`; given arrays instead, it would rebuild its input iterator every epoch,
            which costs `MirroredStrategy` 0.3 to 2 seconds per epoch on several devices
            and would blur the comparison.
            """
        ),
        code(
            """
            STEPS_PER_EPOCH = len(x_train) // BATCH_SIZE
            train_data = (
                tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train), seed=0)
                .repeat()
                .batch(BATCH_SIZE)
            )
            """
        ),
        md(
            """
            ## The model and the clock

            Every run trains the same model from the same initial weights, with replica 0
            slowed by `tf_diffmap.testing.ReplicaDelay`. The layer picks replicas by the
            replica id of whichever strategy runs the step, so it slows replica 0 under
            `MirroredStrategy` too.

            `AccuracyOverTime` records the validation accuracy before training and after
            each epoch, against the training time so far. Its clock stops while it
            measures, so that the runs are compared on training time alone; the first
            epoch includes building the step's graphs.
            """
        ),
        code(
            """
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
                \"\"\"Validation accuracy before training and after each epoch, and when.\"\"\"

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
                \"\"\"Trains a fresh model under `strategy`; returns its AccuracyOverTime.\"\"\"
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
            """
        ),
        md(
            """
            ## The runs

            - **MirroredStrategy (synchronous)**: at every step each replica computes the
              gradient of its quarter of the batch, the gradients are summed and one update
              is applied; the step lasts as long as the slowest replica.
              `ReductionToOneDevice` sums them in a way that works on logical CPU and GPU
              devices alike.
            - **`"none"`**: plain asynchronous updates (Hogwild!, Downpour): each replica
              applies its gradient as soon as it has it, however stale.
            - **`"inverse"`**: the learning rate of an update is divided by its staleness
              (when above 1), so stale updates move the parameters less (Zhang et al. 2016).
            - **`"dc"`**: delay compensation (DC-ASGD-a, Zheng et al. 2017) corrects a stale
              gradient towards the one at the current parameters, with a first-order term.
            - **`"drop"`**: updates staler than `DROP_ABOVE` are not applied at all.
            - **`max_staleness=MAX_STALENESS`**: bounded staleness (Stale Synchronous
              Parallel, Ho et al. 2013) with plain updates: a replica more than
              `MAX_STALENESS` steps ahead of the slowest waits for it.
            """
        ),
        code(
            """
            def adam():
                return keras.optimizers.Adam(LEARNING_RATE)


            def with_rule(staleness, **kwargs):
                return lambda: tf_diffmap.AsyncOptimizer(adam(), staleness=staleness, **kwargs)


            def mirrored():
                return tf.distribute.MirroredStrategy(
                    devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
                )


            RUNS = {
                "MirroredStrategy (synchronous)": (mirrored, adam),
                'tf_diffmap, "none"': (tf_diffmap.Strategy, with_rule("none")),
                'tf_diffmap, "inverse"': (tf_diffmap.Strategy, with_rule("inverse")),
                'tf_diffmap, "dc"': (tf_diffmap.Strategy, with_rule("dc")),
                f'tf_diffmap, "drop" above {DROP_ABOVE}': (
                    tf_diffmap.Strategy,
                    with_rule("drop", drop_above=DROP_ABOVE),
                ),
                f"tf_diffmap, max_staleness={MAX_STALENESS}": (
                    lambda: tf_diffmap.Strategy(max_staleness=MAX_STALENESS),
                    adam,
                ),
            }

            strategies, recorders = {}, {}
            for name, (make_strategy, make_optimizer) in RUNS.items():
                strategies[name] = make_strategy()
                recorders[name] = recorder = train(strategies[name], make_optimizer)
                print(
                    f"{name:34} {recorder.seconds[-1]:5.1f} s of training, "
                    f"validation accuracy {recorder.accuracies[-1]:.3f}"
                )
            """
        ),
        md(
            """
            ## Accuracy against wall time

            Each point is one epoch (the first, at 0 s, is the untrained model).
            """
        ),
        code(
            """
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
            """
        ),
        md(
            """
            ## Work share per replica

            Under `MirroredStrategy` every replica computes a quarter of every step, so
            each has an even share by construction, and the fast ones wait. Under
            `tf_diffmap` a replica's share is its fraction of the updates claimed, applied
            or dropped.
            """
        ),
        code(
            """
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
            """
        ),
        md("And the staleness statistics of each asynchronous run:"),
        code(
            """
            for name, strategy in strategies.items():
                if isinstance(strategy, tf_diffmap.Strategy):
                    print(f"{name}:\\n{strategy.statistics()}\\n")
            """
        ),
        md(
            """
            ## Discussion

            Numbers vary from run to run and machine to machine. On the 2-core CPU this
            notebook was written on, with the full settings, the synchronous run trained for
            18 to 19 s, the asynchronous ones for 7 to 10 s, the bounded one for 15 to 16 s,
            and every run ended near 0.97 validation accuracy. What the figures show:

            - **Synchronous training runs at the straggler's pace.** Every step of
              `MirroredStrategy` waits for replica 0's sleep, so its curve is stretched to
              the right: the bars give each replica an even quarter of the work, but the
              fast ones spend most of each step idle, waiting at the barrier.
            - **Asynchronous training does not wait.** Under `tf_diffmap` the fast replicas
              take the shards that replica 0 cannot: its share falls below a tenth, the
              others' rise above a quarter, and the run ends in about half the synchronous
              time. Each batch also makes up to `REPLICAS` updates of `BATCH_SIZE /
              REPLICAS` examples rather than one of `BATCH_SIZE`: part of why the
              asynchronous curves also climb faster per epoch.
            - **The price is staleness, and the straggler pays it.** Replica 0's updates
              are 8 to 10 versions stale on average, the others' about 1. Here they are
              few, and Adam at this learning rate tolerates them, so the rules end close
              together:
              - `"none"` applies them as they are;
              - `"inverse"` multiplies replica 0's learning rate by a tenth to a fifth (its
                *learning-rate factor* above), so its updates barely count, and leaves the
                fast replicas' nearly unchanged;
              - `"dc"` applies them corrected, for a little more work per update;
              - `"drop"` throws away those staler than `DROP_ABOVE`, a third to most of
                replica 0's here (*dropped* above): the model never sees a very stale
                update, but that part of the straggler's work is wasted.
            - **Bounded staleness brings the waiting back.** With `max_staleness` no replica
              runs more than `MAX_STALENESS` steps ahead of the slowest: the shares are
              even again and no update is staler than
              `tf_diffmap.staleness_bound(REPLICAS, MAX_STALENESS)`, but against a replica
              that is *always* slow the others end up waiting for it, nearly as under
              synchronous training. A bound pays off against *transient* stragglers (a
              busy moment, a slow batch), which it absorbs without waiting, while capping
              how stale an update can be.

            **When does the rule matter?** Staleness grows with the number of replicas and
            with the straggler's slowness, and the harm it does grows with the learning
            rate. Try `LEARNING_RATE = 1e-2`, `REPLICAS = 8` or `SLOW_SECONDS = 0.1`: plain
            asynchronous updates get noisier, and the staleness-aware rules earn their
            keep. On a GPU runtime the steps themselves are faster, so the straggler's
            sleep weighs even more.
            """
        ),
    ]


NOTEBOOKS = {
    "quickstart": quickstart,
    "staleness_in_tensorboard": staleness_in_tensorboard,
    "stragglers_and_policies": stragglers_and_policies,
}


# -- writing -----------------------------------------------------------------------


def build(name: str) -> nbformat.NotebookNode:
    """The notebook `name`, without outputs, with stable cell ids."""
    notebook = nbformat.v4.new_notebook(cells=NOTEBOOKS[name]())
    for i, cell in enumerate(notebook.cells):
        cell.id = f"{name[:40]}-{i:02d}"  # stable ids keep the files reproducible
    notebook.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "colab": {"name": f"{name}.ipynb", "provenance": []},
    }
    nbformat.validate(notebook)
    return notebook


def render(name: str) -> str:
    """The text of `notebooks/<name>.ipynb`, as `nbformat.write` would write it."""
    text = nbformat.writes(build(name))
    return text if text.endswith("\n") else text + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only check that the notebooks are up to date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python notebooks/build_notebooks.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
