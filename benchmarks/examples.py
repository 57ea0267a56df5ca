"""Real example code, run as written: plain Keras, MirroredStrategy and tf_diffmap.

Reads keras-io (and keras-rs) examples from a checkout the user points at,
applies a short, listed set of edits (`benchmarks.example_edits`: the data
download replaced by synthetic data of the same shapes and types from
`benchmarks.example_data`, counts shortened where a run would take too
long on a 2-core host, model building and compile put in the contender's
scope), and runs each (example, contender, seed) in a fresh process with 4
logical CPU devices. Contenders: ``plain`` (no strategy, one device),
``mirrored`` (`tf.distribute.MirroredStrategy` over /cpu:0..3),
``tf_diffmap`` (`tf_diffmap.Strategy()`, its defaults: the shard gradients
of the 4 replicas aggregated into one step of the inner optimizer) and
``tf_diffmap_per_shard`` (`tf_diffmap.Strategy(gradients_per_step=1)`: a
step per shard gradient), each on the example's own optimizer, loss and
metrics.

    python -m benchmarks.examples --keras-io PATH [--keras-rs PATH] [--seeds 3]
    python -m benchmarks.examples --keras-io PATH --list      # the edits, per example
    python -m benchmarks.examples --report-only --out DIR     # the table again
    python -m benchmarks.examples --report-only --out DIR --publish docs/benchmarks/examples

Each run records the example's own metric, the wall time of its `fit`
calls and of the whole script, and under tf_diffmap `strategy.statistics()`
(mean staleness in versions and in optimizer steps) and every warning that
tf_diffmap raised or logged. Runs are appended to ``DIR/runs.jsonl`` as
they finish (a run already there is not run again); ``DIR/examples.md``
and ``DIR/examples.json`` hold the table. The examples' code is read at run
time from the checkouts; each run's edited source is written beside its log
in ``DIR/logs/`` (keep DIR out of commits: it holds the examples' code).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.example_edits import SCOPE_NAME, Edit, apply_edits

__all__ = ["EXAMPLES", "Example", "prepared_source", "publish", "main"]

CONTENDERS = ("plain", "mirrored", "tf_diffmap", "tf_diffmap_per_shard")
DEVICES = 4
RUN_TIMEOUT = 1500  # seconds; a run past it is recorded as a timeout
SYNTHETIC = "__synthetic__"  # the name the edited source calls the data through


@dataclasses.dataclass(frozen=True)
class Example:
    """One example and how it is run.

    Attributes:
        name: short name for the table.
        checkout: ``"keras-io"`` or ``"keras-rs"``: which checkout holds it.
        path: its path in that checkout.
        edits: every edit of its source, each with its reason.
        metric: the figure the table reports, a key of the run's ``metrics``.
        higher_is_better: whether a larger `metric` is better.
        shortened: what was cut to fit the host, for the table ("" if nothing).
        after: measurements taken in the child process once the example has
            run, from its namespace and the contender's strategy (or None).
    """

    name: str
    checkout: str
    path: str
    edits: tuple[Edit, ...]
    metric: str
    higher_is_better: bool
    shortened: str = ""
    after: Callable[[dict, Any], dict] | None = None


def _data(anchor: str, new: str, why: str, through: str | None = None) -> Edit:
    return Edit("data", anchor, why, through=through, new=new)


def _scope(anchor: str, through: str | None = None) -> Edit:
    return Edit("scope", anchor, "model built and compiled in the contender's scope", through)


def _recommender_evaluation(namespace: dict, strategy: Any) -> dict:
    """The recommender's validation loss, its trained weights evaluated three ways.

    Its model sums a `tensordot` over the whole batch, so a prediction
    depends on the batch it is in: the contender's own `evaluate`, whole
    batches of 64 on one device (as tf_diffmap's `evaluate` runs them) and
    each batch split in 4 shards of 16 (as MirroredStrategy's replicas run
    them) can differ on the same weights.
    """
    import keras
    import numpy as np

    model, x_val, y_val = namespace["model"], namespace["x_val"], namespace["y_val"]
    own = model.evaluate(x_val, y_val, batch_size=64, verbose=0)
    weights = model.get_weights()
    plain = namespace["RecommenderNet"](
        namespace["num_users"], namespace["num_movies"], namespace["EMBEDDING_SIZE"]
    )
    plain(x_val[:2])
    plain.set_weights(weights)
    bce = keras.losses.BinaryCrossentropy(reduction=None)

    def loss(shards: int) -> float:
        total = 0.0
        for start in range(0, len(x_val), 64):
            xb, yb = x_val[start : start + 64], y_val[start : start + 64]
            for xs, ys in zip(np.array_split(xb, shards), np.array_split(yb, shards)):
                if len(xs):
                    total += float(np.sum(bce(ys[:, None], plain(xs, training=False))))
        return total / len(x_val)

    return {
        "evaluate_own": float(own if np.isscalar(own) else own[0]),
        "evaluate_whole_batch": loss(1),
        "evaluate_shards_of_4": loss(DEVICES),
    }


# Where a number is cut, the synthetic call says so: `rows=` beside the
# example's own count, which the table's "shortened" column repeats.
EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example(
            name="mnist_convnet",
            checkout="keras-io",
            path="examples/vision/mnist_convnet.py",
            edits=(
                _data(
                    "keras.datasets.mnist.load_data()",
                    "(x_train, y_train), (x_test, y_test) = "
                    f"{SYNTHETIC}.mnist(train=5_000, test=2_000)",
                    "MNIST: scikit-learn digits upsampled to 28x28 uint8, shifted, noisy",
                ),
                Edit(
                    "shorten",
                    "epochs = 15",
                    "7 epochs instead of 15: 15 took 4.5 minutes a run on a shared 2-core host",
                    old="epochs = 15",
                    new="epochs = 7",
                ),
                _scope("model = keras.Sequential(", through="model.compile("),
            ),
            metric="test_accuracy",
            higher_is_better=True,
            shortened="5,000 train / 2,000 test images (of 60,000 / 10,000); 7 epochs (of 15)",
        ),
        Example(
            name="transformer_text",
            checkout="keras-io",
            path="examples/nlp/text_classification_with_transformer.py",
            edits=(
                _data(
                    "keras.datasets.imdb.load_data(",
                    "(x_train, y_train), (x_val, y_val) = "
                    f"{SYNTHETIC}.imdb(num_words=vocab_size, train=6_000, test=4_000)",
                    "IMDB: Zipf word indices, a label-dependent share of 100 sentiment words",
                ),
                _scope("inputs = layers.Input(shape=(maxlen,))", through="model.compile("),
            ),
            metric="val_accuracy",
            higher_is_better=True,
            shortened="6,000 train / 4,000 validation reviews (of 25,000 / 25,000); "
            "2 epochs as written",
        ),
        Example(
            name="recommender",
            checkout="keras-io",
            path="examples/structured_data/collaborative_filtering_movielens.py",
            edits=(
                _data(
                    "movielens_zipped_file = keras.utils.get_file(",
                    "movielens_dir = Path('synthetic-ml-latest-small')\n"
                    f"df = {SYNTHETIC}.movielens_ratings(ratings=30_000, users=610, movies=3_000)",
                    "ml-latest-small's ratings.csv: low-rank ratings in half stars, popular "
                    "movies rated more (download, unzip and read_csv replaced)",
                    through="df = pd.read_csv(ratings_file)",
                ),
                _data(
                    'movie_df = pd.read_csv(movielens_dir / "movies.csv")',
                    f"movie_df = {SYNTHETIC}.movielens_movies(movies=3_000)",
                    "ml-latest-small's movies.csv: ids, titles and genres",
                ),
                _scope("model = RecommenderNet(", through="model.compile("),
            ),
            metric="val_loss",
            higher_is_better=False,
            shortened="30,000 ratings, 3,000 movies (of 100,836, 9,724); 5 epochs as written",
            after=_recommender_evaluation,
        ),
        Example(
            name="feature_space",
            checkout="keras-io",
            path="examples/structured_data/structured_data_classification_with_feature_space.py",
            edits=(
                _data(
                    "dataframe = pd.read_csv(file_url)",
                    f"dataframe = {SYNTHETIC}.heart(rows=303)",
                    "heart.csv: its 14 columns and types, 303 rows, target from a logistic rule",
                ),
                _scope(
                    'x = keras.layers.Dense(32, activation="relu")',
                    "training_model.compile(",
                ),
            ),
            metric="val_accuracy",
            higher_is_better=True,
        ),
        Example(
            name="dcn",
            checkout="keras-rs",
            path="examples/dcn.py",
            edits=(
                _data(
                    "import tensorflow_datasets as tfds",
                    "tfds = None  # not needed: the data below is synthetic",
                    "tensorflow_datasets not imported (its only use is the download)",
                ),
                _data(
                    'ratings_ds = tfds.load("movielens/100k-ratings"',
                    f"ratings_ds = {SYNTHETIC}.tfds_movielens_100k()",
                    "TFDS movielens/100k-ratings: its feature types, low-rank ratings with a "
                    "gender x age cross",
                ),
                Edit(
                    "shorten",
                    "TOY_CONFIG = {",
                    "toy example: 5 epochs instead of 100",
                    old='"num_epochs": 100,',
                    new='"num_epochs": 5,',
                ),
                Edit(
                    "shorten",
                    "for _ in range(10):",
                    "MovieLens: each model trained once instead of 10 times",
                    old="range(10)",
                    new="range(1)",
                ),
                _scope("optimizer = keras.optimizers.AdamW(", through="model.compile("),
                _scope(
                    "cross_network = keras.Sequential(",
                    "deep_network = keras.Sequential(",
                ),
                _scope(" cross_network = get_model("),
                _scope("opt_cross_network = get_model("),
                _scope(" deep_network = get_model("),
            ),
            metric="movielens_cross_rmse",
            higher_is_better=False,
            shortened="toy: 5 epochs (of 100); MovieLens: one repetition (of 10), "
            "10 epochs as written",
        ),
    )
}

# The DCN example evaluates five models in turn; their RMSE, in call order.
DCN_EVALUATIONS = (
    "toy_cross_rmse",
    "toy_deep_rmse",
    "movielens_cross_rmse",
    "movielens_opt_cross_rmse",
    "movielens_deep_rmse",
)


def prepared_source(example: Example, checkouts: dict[str, Path]) -> str:
    """The example's source, read from its checkout, with its edits applied."""
    root = checkouts.get(example.checkout)
    if root is None:
        raise FileNotFoundError(f"No {example.checkout} checkout given for {example.name}.")
    source = (Path(root) / example.path).read_text()
    return apply_edits(source, example.edits)


# -- one run, in its own process ---------------------------------------------


class _Recorder:
    """Records every `fit` and `evaluate` of any Keras model, and tf_diffmap's warnings."""

    def __init__(self) -> None:
        self.fits: list[dict] = []
        self.evaluations: list[dict] = []
        self.warnings: list[str] = []

    def install(self) -> None:
        import keras

        fit, evaluate = keras.Model.fit, keras.Model.evaluate
        recorder = self

        def recorded_fit(model, *args, **kwargs):
            start = time.perf_counter()
            history = fit(model, *args, **kwargs)
            recorder.fits.append(
                {
                    "seconds": time.perf_counter() - start,
                    "history": {
                        k: [float(v) for v in values] for k, values in history.history.items()
                    },
                }
            )
            return history

        def recorded_evaluate(model, *args, **kwargs):
            result = evaluate(model, *args, **kwargs)
            names = model.metrics_names
            if isinstance(result, dict):
                values = {k: float(v) for k, v in result.items()}
            elif isinstance(result, list | tuple):
                values = {n: float(v) for n, v in zip(names, result)}
            else:
                values = {names[0] if names else "loss": float(result)}
            recorder.evaluations.append(values)
            return result

        keras.Model.fit, keras.Model.evaluate = recorded_fit, recorded_evaluate

        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            # The frame that called `warnings.warn`: the first one, from the
            # top, outside this function and the warnings module.
            stack = traceback.extract_stack()[:-1]
            callers = [f for f in stack if not f.filename.endswith("warnings.py")]
            if callers and "/tf_diffmap/" in callers[-1].filename:
                # Where the warning was raised, so that the report shows its origin.
                origin = "/".join(Path(callers[-1].filename).parts[-3:])
                origin += f":{callers[-1].lineno}"
                recorder.warnings.append(f"{category.__name__}: {message} [raised in {origin}]")
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

        class Handler(logging.Handler):
            def emit(self, record):
                recorder.warnings.append(f"log {record.levelname}: {record.getMessage()}")

        logging.getLogger("tf_diffmap").addHandler(Handler(logging.WARNING))


def _metrics(example: Example, recorder: _Recorder) -> dict:
    """The example's own figures, from what its `fit` and `evaluate` calls returned."""
    metrics: dict[str, float] = {}
    if recorder.fits:
        history = recorder.fits[-1]["history"]
        metrics.update({k: v[-1] for k, v in history.items() if v})
    if example.name == "mnist_convnet" and recorder.evaluations:
        last = recorder.evaluations[-1]
        metrics["test_loss"] = last.get("loss", float("nan"))
        metrics["test_accuracy"] = last.get("accuracy", last.get("compile_metrics", float("nan")))
    if example.name == "dcn":
        for name, values in zip(DCN_EVALUATIONS, recorder.evaluations):
            metrics[name] = values.get("root_mean_squared_error", float("nan"))
    return metrics


def _strategy(contender: str):
    import tensorflow as tf

    if contender == "plain":
        return None
    if contender == "mirrored":
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(DEVICES)])
    if contender == "tf_diffmap":
        import tf_diffmap

        return tf_diffmap.Strategy()
    if contender == "tf_diffmap_per_shard":
        import tf_diffmap

        return tf_diffmap.Strategy(gradients_per_step=1)
    raise ValueError(f"contender must be one of {CONTENDERS}, received {contender!r}.")


def _statistics(strategy) -> dict:
    stats = strategy.statistics()
    return {
        "version": int(stats.version),
        "optimizer_steps": None if stats.steps is None else int(stats.steps),
        "mean_staleness_versions": stats.overall_mean_staleness,
        "max_staleness_versions": stats.overall_max_staleness,
        "mean_staleness_steps": stats.overall_mean_step_staleness,
        "max_staleness_steps": stats.overall_max_step_staleness,
        "dropped": int(sum(stats.dropped)),
        "updates_per_replica": [int(u) for u in stats.updates],
    }


def run_one(spec: dict) -> dict:
    """Runs one (example, contender, seed) in this process; TensorFlow must not have started."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import tf_diffmap

    tf_diffmap.split_devices(DEVICES, "CPU")
    import keras

    from benchmarks import example_data

    example = EXAMPLES[spec["example"]]
    checkouts = {k: Path(v) for k, v in spec["checkouts"].items()}
    source = prepared_source(example, checkouts)
    keras.utils.set_random_seed(spec["seed"])
    strategy = _strategy(spec["contender"])
    recorder = _Recorder()
    recorder.install()
    scope = strategy.scope if strategy is not None else contextlib.nullcontext
    # The edited source is run from a file of its own, so that tracebacks and
    # AutoGraph (which reads a function's source to convert it) see its lines.
    path = spec["edited_source"]
    Path(path).write_text(source)
    namespace = {"__name__": "__main__", "__file__": path, SCOPE_NAME: scope}
    namespace[SYNTHETIC] = example_data
    start = time.perf_counter()
    exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the example, as edited
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "metrics": _metrics(example, recorder),
        "script_seconds": seconds,
        "fit_seconds": sum(f["seconds"] for f in recorder.fits),
        "fits": recorder.fits,
        "evaluations": recorder.evaluations,
    }
    if example.after is not None:
        result["metrics"].update(example.after(namespace, strategy))
    if spec["contender"].startswith("tf_diffmap"):
        result["statistics"] = _statistics(strategy)
    result["tf_diffmap_warnings"] = sorted(set(recorder.warnings))
    return result


def _child_main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = {"status": "ok", **run_one(spec)}
    except Exception as error:  # noqa: BLE001 - recorded; the other runs go on
        result = {
            "status": "error",
            "error": traceback.format_exc()[-3000:],
            "type": repr(error),
        }
    Path(result_path).write_text(json.dumps(result))
    return 0


# -- the driver and the table ------------------------------------------------


def _key(example: str, contender: str, seed: int) -> str:
    return f"{example}/{contender}/{seed}"


def _done(out: Path) -> dict[str, dict]:
    runs = {}
    path = out / "runs.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                run = json.loads(line)
                runs[run["key"]] = run
    return runs


def _run_process(spec: dict, out: Path) -> dict:
    """One run in a fresh process; its result, or why there is none."""
    key = _key(spec["example"], spec["contender"], spec["seed"])
    stem = key.replace("/", "-")
    spec_path, result_path = (
        out / "logs" / f"{stem}.spec.json",
        out / "logs" / f"{stem}.json",
    )
    spec = {**spec, "edited_source": str(out / "logs" / f"{stem}.edited.py")}
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    command = [sys.executable, "-m", "benchmarks.examples", "--child"]
    start = time.perf_counter()
    with open(out / "logs" / f"{stem}.log", "w") as log:
        try:
            subprocess.run(
                [*command, str(spec_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=RUN_TIMEOUT,
                check=False,
            )
            result = (
                json.loads(result_path.read_text())
                if result_path.exists()
                else {"status": "error", "error": "the process died; see its log"}
            )
        except subprocess.TimeoutExpired:
            result = {"status": "timeout", "error": f"over {RUN_TIMEOUT} s"}
    return {
        "key": key,
        **spec,
        "process_seconds": time.perf_counter() - start,
        **result,
    }


def run_all(
    examples: Sequence[str],
    contenders: Sequence[str],
    seeds: Sequence[int],
    checkouts: dict[str, Path],
    out: Path,
    jobs: int = 1,
) -> None:
    """Runs every (example, contender, seed) not yet in ``out/runs.jsonl``, `jobs` at a time,
    seed by seed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    done = _done(out)
    specs = [
        {
            "example": name,
            "contender": contender,
            "seed": seed,
            "checkouts": {k: str(v) for k, v in checkouts.items()},
        }
        for seed in seeds
        for name in examples
        for contender in contenders
        if done.get(_key(name, contender, seed), {}).get("status") != "ok"
    ]
    lock = threading.Lock()

    def one(spec: dict) -> None:
        result = _run_process(spec, out)
        with lock:
            with open(out / "runs.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(_one_line(result), flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(one, spec) for spec in specs]:
            future.result()


def _one_line(run: dict) -> str:
    if run.get("status") != "ok":
        return f"{run['key']}: {run.get('status')} {run.get('type', run.get('error', ''))[:200]}"
    example = EXAMPLES[run["example"]]
    value = run["metrics"].get(example.metric, float("nan"))
    line = f"{run['key']}: {example.metric} {value:.4f}, fit {run['fit_seconds']:.0f} s"
    if "statistics" in run:
        s = run["statistics"]
        line += (
            f", staleness {s['mean_staleness_versions']:.2f} versions / "
            f"{s['mean_staleness_steps']:.2f} steps"
        )
    if run.get("tf_diffmap_warnings"):
        line += f", {len(run['tf_diffmap_warnings'])} tf_diffmap warning(s)"
    return line


def _median_range(values: Sequence[float], digits: int) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summarize(runs: Sequence[dict]) -> dict:
    """Per example and contender: the metric's median and range, times, staleness, warnings."""
    table: dict[str, dict] = {}
    for name, example in EXAMPLES.items():
        for contender in CONTENDERS:
            mine = [r for r in runs if r["example"] == name and r["contender"] == contender]
            if not mine:
                continue
            ok = [r for r in mine if r.get("status") == "ok"]
            row: dict[str, Any] = {
                "metric": example.metric,
                "values": [r["metrics"].get(example.metric) for r in ok],
                "seeds": [r["seed"] for r in ok],
                "failed": [r["key"] for r in mine if r.get("status") != "ok"],
                "fit_seconds": [r["fit_seconds"] for r in ok],
                "other_metrics": {
                    k: [r["metrics"].get(k) for r in ok]
                    for k in sorted({k for r in ok for k in r["metrics"]})
                },
            }
            stats = [r["statistics"] for r in ok if "statistics" in r]
            if stats:
                row["mean_staleness_versions"] = [s["mean_staleness_versions"] for s in stats]
                row["mean_staleness_steps"] = [s["mean_staleness_steps"] for s in stats]
                row["max_staleness_steps"] = [s["max_staleness_steps"] for s in stats]
            row["warnings"] = sorted({w for r in ok for w in r.get("tf_diffmap_warnings", [])})
            table.setdefault(name, {})[contender] = row
    return table


def render(table: dict) -> str:
    """The table as Markdown: one row per example and contender."""
    lines = [
        "| Example (metric) | Contender | Metric: median (range) | Fit s: median | "
        "Staleness: versions / steps (median) | tf_diffmap warnings |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in table.items():
        example = EXAMPLES[name]
        arrow = "higher" if example.higher_is_better else "lower"
        for contender, row in rows.items():
            values = [v for v in row["values"] if v is not None]
            cell = _median_range(values, 4)
            if row["failed"]:
                cell += f"; {len(row['failed'])} failed"
            stale = "-"
            if "mean_staleness_versions" in row:
                stale = (
                    f"{statistics.median(row['mean_staleness_versions']):.2f} / "
                    f"{statistics.median(row['mean_staleness_steps']):.2f}"
                )
            fit = f"{statistics.median(row['fit_seconds']):.0f}" if row["fit_seconds"] else "-"
            warned = str(len(row["warnings"])) if contender.startswith("tf_diffmap") else "-"
            label = f"{name} ({example.metric}, {arrow} is better)"
            lines.append(f"| {label} | {contender} | {cell} | {fit} | {stale} | {warned} |")
    return "\n".join(lines)


def describe_edits() -> str:
    """Every example's edits, one line each: what the table's runs changed."""
    lines = []
    for name, example in EXAMPLES.items():
        lines.append(f"{name} ({example.checkout}: {example.path})")
        for edit in example.edits:
            lines.append(f"  [{edit.kind}] {edit.why}")
        if example.shortened:
            lines.append(f"  shortened: {example.shortened}")
    return "\n".join(lines)


CONTENDER_TITLES = {
    "plain": "plain Keras",
    "mirrored": "MirroredStrategy",
    "tf_diffmap": "tf_diffmap (default)",
    "tf_diffmap_per_shard": "tf_diffmap, a step per shard",
}
# Figures beside each example's own metric, in the compact table's notes.
SECONDARY = {
    "mnist_convnet": ("val_accuracy",),
    "transformer_text": ("val_loss",),
    "recommender": ("evaluate_own", "evaluate_whole_batch", "evaluate_shards_of_4"),
    "feature_space": ("val_loss",),
    "dcn": DCN_EVALUATIONS,
}


def render_compact(table: dict) -> str:
    """One row per example, one column per contender: the metric's median (range) and n."""
    present = [c for c in CONTENDERS if any(c in rows for rows in table.values())]
    lines = [
        "| Example (metric) | " + " | ".join(CONTENDER_TITLES[c] for c in present) + " |",
        "| --- | " + " | ".join("---" for _ in present) + " |",
    ]
    for name, rows in table.items():
        example = EXAMPLES[name]
        arrow = "higher" if example.higher_is_better else "lower"
        cells = []
        for contender in present:
            row = rows.get(contender)
            if row is None:
                cells.append("not run")
                continue
            values = [v for v in row["values"] if v is not None]
            cell = _median_range(values, 4) + f", n={len(values)}" if values else "-"
            if row["failed"]:
                cell += f"; {len(row['failed'])} failed"
            cells.append(cell)
        lines.append(
            f"| {name} ({example.metric}, {arrow} is better) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def render_secondary(table: dict) -> str:
    """The other figures each example reports, per contender: median (range)."""
    lines = []
    for name, rows in table.items():
        keys = SECONDARY.get(name, ())
        if not keys:
            continue
        lines.append(f"| {name} | " + " | ".join(keys) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in keys) + " |")
        for contender, row in rows.items():
            figures = row["other_metrics"]
            cells = [
                _median_range([v for v in figures.get(k, []) if v is not None], 4) for k in keys
            ]
            lines.append(f"| {CONTENDER_TITLES[contender]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _versions() -> dict:
    from importlib import metadata

    found = {}
    for package in (
        "tensorflow",
        "tensorflow-cpu",
        "keras",
        "keras-rs",
        "numpy",
        "pandas",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    root = Path(__file__).resolve().parent.parent
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        found["tf_diffmap commit"] = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return found


def publish(out: Path, target: Path, command: str, host_note: str, notes: str = "") -> None:
    """Writes ``target/results.md`` and ``target/results.json`` from ``out/runs.jsonl``:
    the tables, the command that made them, the dates of the runs, the host and the versions,
    and `notes` (Markdown: what the runs left out, say) under their own heading."""
    runs = list(_done(out).values())
    table = summarize(runs)
    logs = sorted((out / "logs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    logs = [p for p in logs if not p.name.endswith(".spec.json")]
    stamp = "%Y-%m-%d %H:%M UTC"
    dates = (
        [time.strftime(stamp, time.gmtime(p.stat().st_mtime)) for p in (logs[0], logs[-1])]
        if logs
        else ["-", "-"]
    )
    versions = _versions()
    seeds = sorted({r["seed"] for r in runs})
    host = f"{os.cpu_count()} logical CPUs; {host_note}"
    warned = {
        f"{name}/{contender}": row["warnings"]
        for name, rows in table.items()
        for contender, row in rows.items()
        if row["warnings"]
    }
    lines = [
        "# Real example code: plain Keras, MirroredStrategy and tf_diffmap",
        "",
        "Written by `python -m benchmarks.examples --publish`; how the runner works is in",
        "[Reading the benchmark tables](../../benchmarks.md#real-example-code).",
        "",
        f"- Runs: {dates[0]} to {dates[-1]}; seeds {seeds}; one run at a time.",
        f"- Host: {host}.",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        f"- Command: `{command}`",
        "",
        "Each cell is the median over seeds, with the range when there is more than one,",
        "and n, the number of runs. The data is synthetic (see the edits below), so the",
        "figures compare contenders on the same data and say nothing of the real data sets.",
        "",
    ]
    if notes:
        lines += ["## Notes on these runs", "", notes.strip(), ""]
    lines += [
        "## The example's own metric",
        "",
        render_compact(table),
        "",
        "## Time, staleness and warnings",
        "",
        "Fit s is the wall time of the example's `fit` calls (on a shared host: compare",
        "within a row). Staleness is tf_diffmap's mean, in versions and in optimizer steps.",
        "",
        render(table),
        "",
        "## The example's other figures",
        "",
        render_secondary(table),
        "## What tf_diffmap warned",
        "",
    ]
    if warned:
        for key, messages in warned.items():
            lines.append(f"- {key}:")
            lines.extend(f"  - `{m[:300]}`" for m in messages)
    else:
        lines.append("Nothing.")
    lines += [
        "",
        "## The edits of each example",
        "",
        "```",
        describe_edits(),
        "```",
        "",
    ]
    target.mkdir(parents=True, exist_ok=True)
    (target / "results.md").write_text("\n".join(lines))
    record = {
        "command": command,
        "runs_from": dates[0],
        "runs_to": dates[-1],
        "host": host,
        "versions": versions,
        "table": table,
        "runs": [
            {k: v for k, v in r.items() if k not in ("checkouts", "edited_source")}
            for r in sorted(runs, key=lambda r: r["key"])
        ],
    }
    record["notes"] = notes.strip()
    (target / "results.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.examples", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--keras-io", type=Path, help="a keras-io checkout")
    parser.add_argument("--keras-rs", type=Path, help="a keras-rs checkout (for the DCN example)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument(
        "--seed",
        type=int,
        action="append",
        help="this seed only (repeatable; overrides --seeds)",
    )
    parser.add_argument("--only", nargs="*", choices=sorted(EXAMPLES), help="these examples only")
    parser.add_argument("--contenders", nargs="*", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--out", type=Path, default=Path("examples-out"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--list", action="store_true", help="print the edits and exit")
    parser.add_argument("--report-only", action="store_true", help="the table from DIR/runs.jsonl")
    parser.add_argument(
        "--publish",
        type=Path,
        metavar="DIR",
        help="also write DIR/results.md and results.json",
    )
    parser.add_argument(
        "--host-note",
        default="",
        help="what else ran on the host, for --publish's page",
    )
    parser.add_argument(
        "--notes", type=Path, metavar="FILE", help="Markdown for --publish's page, under Notes"
    )
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child_main(*args.child)
    if args.list:
        print(describe_edits())
        return 0
    if not args.report_only:
        checkouts = {
            name: path.resolve()
            for name, path in (("keras-io", args.keras_io), ("keras-rs", args.keras_rs))
            if path is not None
        }
        if not checkouts:
            parser.error("give --keras-io PATH (and --keras-rs PATH for the DCN example).")
        names = args.only or [n for n, e in EXAMPLES.items() if e.checkout in checkouts]
        missing = [n for n in names if EXAMPLES[n].checkout not in checkouts]
        if missing:
            parser.error(f"{missing} need a {EXAMPLES[missing[0]].checkout} checkout.")
        seeds = args.seed or range(args.seeds)
        run_all(names, args.contenders, seeds, checkouts, args.out, args.jobs)
    runs = list(_done(args.out).values())
    table = summarize(runs)
    (args.out / "examples.json").write_text(json.dumps(table, indent=1))
    text = render(table)
    (args.out / "examples.md").write_text(text + "\n")
    print(text)
    if args.publish is not None:
        command = "python -m benchmarks.examples " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
        notes = args.notes.read_text() if args.notes else ""
        publish(args.out, args.publish, command, args.host_note, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
