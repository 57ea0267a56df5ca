"""The example runner's edits and synthetic data, on an in-repo toy script.

`benchmarks.example_edits` is checked on `tests/fixtures/toy_example.txt`, a
script shaped like a Keras example (a download, a model built and compiled
in a function, a training loop), with stand-ins for Keras: the edited source
is executed and each stand-in records whether it ran in the scope. No
example's code is needed, and no strategy runs.
"""

import ast
import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import example_data, examples
from benchmarks.example_edits import SCOPE_NAME, Edit, apply_edits, locate

FIXTURE = (Path(__file__).parent / "fixtures" / "toy_example.txt").read_text()

EDITS = (
    Edit(
        "data",
        "archive = download(",
        "the download and the read replaced",
        through="table = read_table(",
        new="# synthetic\ntable = synthetic_table(4)",
    ),
    Edit("shorten", "EPOCHS = {", "fewer epochs", old='"train": 8', new='"train": 2'),
    Edit("shorten", "for _ in range(3):", "fewer repeats", old="range(3)", new="range(2)"),
    Edit("scope", "optimizer = make_optimizer(", "compiled in scope", through="model.compile("),
    Edit("scope", "small = build(4)", "built in scope"),
)


class FakeModel:
    def __init__(self, log, scoped):
        self.log, self.scoped = log, scoped

    def compile(self, optimizer):
        self.log.append(("compile", self.scoped()))

    def fit(self, x, y, epochs):
        self.log.append(("fit", self.scoped(), epochs))
        return epochs


def run(source: str) -> tuple[list, dict]:
    """Executes an edited toy script with stand-ins; what ran, and whether in the scope."""
    log, depth = [], [0]

    @contextlib.contextmanager
    def scope():
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    def scoped():
        return depth[0] > 0

    namespace = {
        SCOPE_NAME: scope,
        "synthetic_table": lambda n: np.arange(3 * n, dtype=float).reshape(n, 3),
        "download": lambda *a, **k: pytest.fail("the download ran"),
        "read_table": lambda *a, **k: pytest.fail("the read ran"),
        "make_layer": lambda units: log.append(("layer", scoped())),
        "make_model": lambda layer, name: (log.append(("model", scoped())), FakeModel(log, scoped))[
            1
        ],
        "make_optimizer": lambda lr: log.append(("optimizer", scoped())),
        "results": [],
    }
    exec(compile(source, "toy_example", "exec"), namespace)
    return log, namespace


def test_edits_replace_the_data_shorten_counts_and_scope_building_and_compile_only():
    source = apply_edits(FIXTURE, EDITS)
    ast.parse(source)
    log, namespace = run(source)
    assert namespace["table"].shape == (4, 3)
    assert namespace["results"] == [2, 2]  # two repeats of two epochs
    assert (
        log
        == [
            ("layer", True),
            ("model", True),
            ("optimizer", True),
            ("compile", True),
            ("fit", False, 2),
        ]
        * 2
    )


def test_the_edited_source_differs_only_where_the_edits_say():
    source = apply_edits(FIXTURE, EDITS)
    assert "download(" not in source and "read_table(" not in source
    assert "    # synthetic\n" not in source and "# synthetic\ntable = synthetic_table(4)" in source
    # Untouched statements are byte for byte the same.
    for line in (
        "x = table[:, :2]",
        "def build(units):",
        '    return model.fit(x, y, epochs=EPOCHS["train"])',
    ):
        assert line + "\n" in source
    # The scopes: one inside the function, around the optimizer and compile; one in the loop.
    assert "    with __contender_scope__():\n        optimizer = make_optimizer(0.01)\n" in source
    assert (
        "for _ in range(2):\n    with __contender_scope__():\n        small = build(4)\n" in source
    )


def test_locate_takes_a_statement_whole_and_the_innermost_one():
    first, last, indent = locate(FIXTURE, "archive = download(")
    lines = FIXTURE.splitlines()
    assert lines[first].startswith("archive = download(") and lines[last] == ")"
    assert indent == 0
    # "make_model(" is inside `build`: the innermost statement is the assignment.
    first, last, indent = locate(FIXTURE, "make_model(")
    assert lines[first].strip().startswith("model = make_model(") and indent == 4
    assert lines[last] == "    )"


@pytest.mark.parametrize(
    "edit, message",
    [
        (Edit("data", "no_such_call(", "-", new="pass"), "names 0 statements"),
        (Edit("data", "model", "-", new="pass"), "names"),  # in several statements
        (Edit("shorten", "EPOCHS = {", "-", old='"epochs": 9', new="1"), "must occur once"),
        (Edit("scope", "small = build(4)", "-", through="no_such_statement"), "No statement"),
    ],
)
def test_an_edit_that_does_not_fit_the_source_raises(edit, message):
    with pytest.raises(ValueError, match=message):
        apply_edits(FIXTURE, [edit])


def test_overlapping_replacements_raise():
    with pytest.raises(ValueError, match="overlap"):
        apply_edits(
            FIXTURE,
            [
                Edit("data", "archive = download(", "-", through="y = table[", new="pass"),
                Edit("data", "table = read_table(", "-", new="pass"),
            ],
        )


def test_an_edit_needs_a_known_kind_and_code():
    with pytest.raises(ValueError, match="kind"):
        Edit("other", "x", "-", new="pass")
    with pytest.raises(ValueError, match="needs `new`"):
        Edit("data", "x", "-")


def test_every_example_replaces_its_data_and_scopes_its_model():
    for name, example in examples.EXAMPLES.items():
        kinds = {edit.kind for edit in example.edits}
        assert {"data", "scope"} <= kinds, name
        assert all(edit.why for edit in example.edits), name
    listing = examples.describe_edits()
    assert all(name in listing for name in examples.EXAMPLES)


def test_the_table_reports_median_range_staleness_and_failures():
    def run_record(contender, seed, value, status="ok"):
        record = {
            "key": f"recommender/{contender}/{seed}",
            "example": "recommender",
            "contender": contender,
            "seed": seed,
            "status": status,
        }
        if status == "ok":
            record.update(metrics={"val_loss": value}, fit_seconds=10.0 + seed)
            if contender == "tf_diffmap":
                record["statistics"] = {
                    "mean_staleness_versions": 1.5,
                    "mean_staleness_steps": 0.1,
                    "max_staleness_steps": 2,
                }
                record["tf_diffmap_warnings"] = []
        return record

    runs = [run_record("plain", s, v) for s, v in enumerate((0.62, 0.60, 0.64))]
    runs += [run_record("tf_diffmap", 0, 0.7), run_record("tf_diffmap", 1, None, "timeout")]
    text = examples.render(examples.summarize(runs))
    assert "| plain | 0.6200 (0.6000-0.6400) | 11 | - | - |" in text
    assert "| tf_diffmap | 0.7000; 1 failed | 10 | 1.50 / 0.10 | 0 |" in text


def test_synthetic_data_has_the_shapes_and_types_of_what_it_replaces():
    (x_train, y_train), (x_test, y_test) = example_data.mnist(train=30, test=10)
    assert x_train.shape == (30, 28, 28) and x_train.dtype == np.uint8
    assert x_test.shape == (10, 28, 28) and set(np.unique(y_train)) <= set(range(10))
    (reviews, labels), (val_reviews, _) = example_data.imdb(num_words=200, train=20, test=5)
    assert reviews.dtype == object and len(reviews) == 20 and len(val_reviews) == 5
    assert all(r[0] == 1 and max(r) < 200 for r in reviews) and set(labels) <= {0, 1}
    pytest.importorskip("pandas")  # the tables' examples read pandas DataFrames
    ratings = example_data.movielens_ratings(ratings=500, users=20, movies=50)
    assert list(ratings.columns) == ["userId", "movieId", "rating", "timestamp"]
    assert ratings["rating"].between(0.5, 5.0).all() and (ratings["rating"] * 2 % 1 == 0).all()
    assert set(ratings["movieId"]) <= set(example_data.movielens_movies(movies=50)["movieId"])
    heart = example_data.heart()
    assert heart.shape == (303, 14) and heart.columns[-1] == "target"
    assert set(heart["thal"]) == {"normal", "fixed", "reversible"}
    # The same data for every contender and seed.
    assert example_data.heart().equals(heart)


def _runs_on_disk(out: Path) -> None:
    """A runs.jsonl as `run_all` writes it: two seeds of two contenders, one failed run."""
    (out / "logs").mkdir(parents=True)
    runs = []
    for contender, values in (("plain", (0.62, 0.64)), ("tf_diffmap", (0.66, None))):
        for seed, value in enumerate(values):
            run = {
                "key": f"recommender/{contender}/{seed}",
                "example": "recommender",
                "contender": contender,
                "seed": seed,
                "status": "ok" if value is not None else "error",
                "fits": [{"seconds": 1.0, "history": {}}],
            }
            if value is not None:
                run.update(
                    metrics={"val_loss": value, "evaluate_own": value},
                    fit_seconds=12.0,
                    tf_diffmap_warnings=["UserWarning: a warning [raised in tf_diffmap/x.py:1]"]
                    if contender == "tf_diffmap"
                    else [],
                )
                if contender == "tf_diffmap":
                    run["statistics"] = {
                        "mean_staleness_versions": 2.0,
                        "mean_staleness_steps": 0.25,
                        "max_staleness_steps": 1,
                    }
            runs.append(run)
            (out / "logs" / f"recommender-{contender}-{seed}.json").write_text("{}")
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))


def test_publish_writes_the_tables_the_command_the_dates_and_the_host(tmp_path):
    _runs_on_disk(tmp_path / "out")
    target = tmp_path / "docs"
    examples.publish(
        tmp_path / "out", target, "python -m benchmarks.examples X", "shared", "One *note*."
    )
    text = (target / "results.md").read_text()
    assert "## Notes on these runs\n\nOne *note*.\n" in text
    assert "- Command: `python -m benchmarks.examples X`" in text
    assert "logical CPUs; shared." in text and "seeds [0, 1]" in text
    header = "| Example (metric) | plain Keras | tf_diffmap (default) |"
    assert header in text  # contenders that did not run have no column
    row = "| recommender (val_loss, lower is better) | 0.6300 (0.6200-0.6400), n=2 | "
    assert row + "0.6600, n=1; 1 failed |" in text
    assert "| tf_diffmap (default) | 0.6600 | - | - |" in text  # evaluate_own, others absent
    assert "- recommender/tf_diffmap:" in text and "[raised in tf_diffmap/x.py:1]" in text
    record = json.loads((target / "results.json").read_text())
    assert record["command"] == "python -m benchmarks.examples X"
    assert record["table"]["recommender"]["plain"]["values"] == [0.62, 0.64]
    assert len(record["runs"]) == 4 and all("checkouts" not in r for r in record["runs"])


def test_every_contender_has_a_title_and_a_strategy_name():
    assert set(examples.CONTENDER_TITLES) == set(examples.CONTENDERS)
    assert "tf_diffmap_per_shard" in examples.CONTENDERS
