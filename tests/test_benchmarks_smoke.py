"""Tests of the benchmark suite: the report's arithmetic and tables, and tiny runs.

The report is checked on made-up sessions (fast): every target's figure is
the ratio of the rows it names, `met` is that figure against the threshold,
and the Markdown prints the figures. The smoke runs (marked slow) run the
suite in subprocesses with tiny settings, whose numbers mean nothing: they
check that each table has its columns and a row per contender, that the
figures are finite and positive, and that the targets agree with the rows.
"""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import plan as plans
from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent

TIMED_TARGETS = {
    "overhead",
    "even_vs_mirrored",
    "even_vs_central",
    "straggler_vs_mirrored",
    "straggler_retention",
    "tta_vs_mirrored",
    "final_accuracy_gap",
}
# Where the plan runs tf_diffmap a step per shard beside its default.
AGGREGATION_TARGETS = {"aggregation_throughput", "aggregation_straggler"}


def _table(results, title: str) -> dict:
    (table,) = [t for t in results["tables"] if t["title"].startswith(title)]
    return table


def _line(markdown: str, start: str) -> str:
    """The one Markdown line that starts with `start`."""
    (line,) = [line for line in markdown.splitlines() if line.startswith(start)]
    return line


def _check_targets(results, markdown: str) -> dict:
    """Every target's `met` is its figure against its threshold (None, with a
    reason, when not measured), and the targets table prints each one."""
    for t in results["targets"]:
        if t["measured"] is None:
            assert t["met"] is None and t["note"], t
        else:
            assert math.isfinite(t["measured"]), t
            op = (lambda a, b: a >= b) if t["comparison"] == ">=" else (lambda a, b: a <= b)
            assert t["met"] is op(t["measured"], t["target"]), t
        line = _line(markdown, f"| {t['description']} |")
        verdict = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        measured = "–" if t["measured"] is None else f"{t['measured']:.2f}{t['unit']}"
        assert f"| {measured} |" in line and f"| {verdict} |" in line, line
    assert len(_table(results, "Targets")["rows"]) == len(results["targets"])
    return {t["key"]: t for t in results["targets"]}


def _positive(spread) -> float:
    """A spread's median, checked finite and positive."""
    assert spread["median"] is not None and math.isfinite(spread["median"]), spread
    assert spread["median"] > 0 and spread["min"] <= spread["median"] <= spread["max"], spread
    return spread["median"]


# -- The report on made-up sessions ---------------------------------------------


def _session(round_, contender, replicas, tasks, **config):
    """A run as `benchmarks.suite` records it: its config and the worker's result."""
    return {
        "round": round_,
        "config": {"contender": contender, "replicas": replicas, "tasks": [t for t, _ in tasks]},
        "result": {
            "status": "ok",
            "contender": contender,
            "replicas": replicas,
            "peak_rss_mb": 700.0,
            "tasks": [
                {"task": task, "result": {"status": "ok", "peak_rss_mb": 600.0, **result}}
                for task, result in tasks
            ],
            **config,
        },
    }


def _throughput(eps: float):
    task = {"kind": "throughput", "model": "mlp"}
    return task, {
        "examples_per_second": eps,
        "median_epoch_seconds": 2048 / eps,
        "warmup_seconds": 1,
    }


def _control(contender, spe: int, steps: float):
    updates = 1 if contender == "plain_keras" else 4
    task = {"kind": "control", "steps_per_execution": spe}
    return task, {
        "steps_per_second": steps,
        "updates_per_second": steps * updates,
        "updates_per_step": updates,
        "cpu_us_per_update": 100.0,
        "steps_per_loop": None if contender == "plain_keras" else 32,
    }


# Examples/s in rounds 1 and 2; Keras steps/s at steps_per_execution 16 and 1.
MADE_UP = {
    ("plain_keras", 1): (1000.0, 1200.0),
    ("tf_diffmap", 1): (1000.0, 1100.0),
    ("mirrored", 4): (1000.0, 1000.0),
    ("tf_diffmap", 4): (3000.0, 3400.0),
}
CONTROL = {"plain_keras": (1000.0, 400.0), "tf_diffmap": (300.0, 200.0)}
# Examples/s and best validation accuracy per contender and table size.
EMBEDDINGS = {
    ("plain_keras", 2_000): (500.0, 0.75),
    ("plain_keras", 20_000): (100.0, 0.81),
    ("tf_diffmap", 2_000): (800.0, 0.7421875),
    ("tf_diffmap", 20_000): (720.0, 0.805),
}


def _embeddings(rows: int, eps: float, accuracy: float):
    task = {"kind": "embeddings", "rows": rows, "optimizer": "sgd"}
    return task, {
        "examples_per_second": eps,
        "table_mb": rows * 32 * 4 / 2**20,
        "cpu_seconds_per_1000_examples": 0.02,
        "val_accuracy": accuracy,
        "best_val_accuracy": accuracy,
    }


def _made_up_results():
    runs = []
    for round_ in (0, 1):
        for (contender, replicas), rates in MADE_UP.items():
            runs.append(_session(round_, contender, replicas, [_throughput(rates[round_])]))
        for contender, steps in CONTROL.items():
            tasks = [_control(contender, spe, s) for spe, s in zip((16, 1), steps)]
            runs.append(_session(round_, contender, 1 if contender == "plain_keras" else 4, tasks))
    for (contender, rows), (eps, accuracy) in EMBEDDINGS.items():
        task = _embeddings(rows, eps, accuracy)
        runs.append(_session(0, contender, 1 if contender == "plain_keras" else 4, [task]))
    plan = plans.Plan(
        name="made-up",
        repeats=2,
        contenders=("plain_keras", "mirrored", "tf_diffmap"),
        replicas=(1, 4),
        models=("mlp",),
        numpy_input_replicas=(),
        workloads=("throughput", "control", "embeddings"),
        embedding_rows=(2_000, 20_000),
        embedding_optimizers=("sgd",),
        embedding_cluster_rows=None,
    )
    results = report.build(
        plan=plan,
        runs=runs,
        calibration={},
        machine={"cpu": "a CPU", "logical_cpus": 2},
        tf_keras={"available": False, "reason": "no tf-keras here"},
        command="python -m benchmarks",
        mirrored_reduce="one_device",
        seconds=60.0,
    )
    return results, report.markdown(results)


def test_targets_are_the_ratios_of_their_rows_and_met_compares_them():
    results, markdown = _made_up_results()
    targets = _check_targets(results, markdown)
    assert set(targets) == {"overhead", "even_vs_mirrored", "even_vs_central"} | {
        "control_spe16",
        "control_spe1",
        "embedding_scaling",
        "embedding_vs_keras",
        "embedding_accuracy",
    }
    # Medians: plain Keras 1,100, tf_diffmap 1,050 on one device; 3,200 against 1,000 on four.
    assert targets["overhead"]["measured"] == pytest.approx(1050 / 1100)
    assert targets["overhead"]["met"] is False
    assert targets["even_vs_mirrored"]["measured"] == pytest.approx(3.2)
    assert targets["even_vs_mirrored"]["met"] is True
    assert targets["even_vs_central"]["measured"] is None
    assert "tf-keras" in targets["even_vs_central"]["note"]
    # tf_diffmap's updates/s (4 a step) over plain Keras' steps/s.
    assert targets["control_spe16"]["measured"] == pytest.approx(1200 / 1000)
    assert targets["control_spe1"]["measured"] == pytest.approx(800 / 400)
    assert targets["control_spe1"]["met"] is False  # below 2.5x
    assert targets["embedding_scaling"]["measured"] == pytest.approx(720 / 800)
    assert targets["embedding_vs_keras"]["measured"] == pytest.approx(7.2)
    # The worst of tf_diffmap's best accuracy against plain Keras', in points.
    assert targets["embedding_accuracy"]["measured"] == pytest.approx(-0.78125)
    assert targets["embedding_accuracy"]["met"] is True  # the threshold is -1 point
    assert results["tables"] == json.loads(json.dumps(results["tables"]))


def test_tables_have_a_row_per_configuration_and_print_its_figures():
    results, markdown = _made_up_results()
    table = _table(results, "Throughput")
    assert table["columns"] == [
        "Model",
        "Input",
        "Replicas",
        "Contender",
        "examples/s",
        "/ MirroredStrategy",
    ]
    assert [(r["Replicas"], r["Contender"]) for r in table["rows"]] == [
        (1, "plain Keras"),
        (1, "tf_diffmap"),
        (4, "MirroredStrategy"),
        (4, "tf_diffmap"),
    ]
    assert markdown.count("| mlp | dataset |") == len(MADE_UP)
    assert "| mlp | dataset | 1 | plain Keras | 1,100 (1,000–1,200) | – |" in markdown
    assert "| mlp | dataset | 1 | tf_diffmap | 1,050 (1,000–1,100) | – |" in markdown
    assert "| mlp | dataset | 4 | tf_diffmap | 3,200 (3,000–3,400) | 3.20x |" in markdown
    control = _table(results, "Control path")
    assert [(r["Contender"], r["steps_per_execution"]) for r in control["rows"]] == [
        ("plain Keras", 16),
        ("plain Keras", 1),
        ("tf_diffmap", 16),
        ("tf_diffmap", 1),
    ]
    assert "| tf_diffmap | 32 | 16 | 4 | 1,200 (1,200–1,200) | 100 (100–100) |" in markdown
    memory = _table(results, "Peak memory")
    assert len(memory["rows"]) == len(MADE_UP)  # the control sessions are not counted
    assert "| sgd | 20,000 | 2.4 | tf_diffmap | 720 | 0.020 | 0.805 | 0.805 | – |" in markdown
    assert "| sgd | 0.20x | 0.90x |" in markdown  # examples/s at 20,000 rows / at 2,000


def _straggler(eps_by_k: dict[int, float]):
    task = {"kind": "straggler", "model": "mlp"}
    windows = {
        str(k): {"examples_per_second": eps, "median_epoch_seconds": 2048 / eps}
        for k, eps in eps_by_k.items()
    }
    return task, {"windows": windows}


def test_the_default_is_compared_with_a_step_per_shard_side_by_side():
    """tf_diffmap's rows carry their examples/s over a step per shard's, a
    column of the tables and the aggregation targets."""
    runs = [
        _session(0, "tf_diffmap", 4, [_throughput(3000.0), _straggler({1: 2700.0, 4: 2000.0})]),
        _session(
            0, "tf_diffmap_per_shard", 4, [_throughput(3200.0), _straggler({1: 2800.0, 4: 2500.0})]
        ),
    ]
    plan = plans.Plan(
        name="made-up",
        repeats=1,
        contenders=("tf_diffmap", "tf_diffmap_per_shard"),
        replicas=(4,),
        models=("mlp",),
        numpy_input_replicas=(),
        straggler_replicas=(4,),
        slowdowns=(1, 4),
        workloads=("throughput", "straggler"),
    )
    results = report.build(
        plan=plan,
        runs=runs,
        calibration={},
        machine={"cpu": "a CPU", "logical_cpus": 2},
        tf_keras={"available": False, "reason": "no tf-keras here"},
        command="python -m benchmarks",
        mirrored_reduce="one_device",
        seconds=60.0,
    )
    markdown = report.markdown(results)
    targets = _check_targets(results, markdown)
    assert targets["aggregation_throughput"]["measured"] == pytest.approx(3000 / 3200)
    assert targets["aggregation_throughput"]["met"] is True  # the threshold is 0.9x
    assert targets["aggregation_straggler"]["measured"] == pytest.approx(2000 / 2500)
    assert targets["aggregation_straggler"]["met"] is False
    assert _table(results, "Throughput")["columns"][-1] == "/ a step per shard"
    assert "| mlp | dataset | 4 | tf_diffmap | 3,000 | – | 0.94x |" in markdown
    assert "| mlp | dataset | 4 | tf_diffmap, a step per shard | 3,200 | – | – |" in markdown
    line = _line(markdown, "| 4 | tf_diffmap | 4 |")
    assert "| 74% | 0.80x |" in line  # kept 2,000 of 2,700; 2,000 / 2,500


def test_per_update_rules_run_on_a_step_per_shard_and_the_default_runs_its_own():
    """The time-to-accuracy tasks: `AsyncOptimizer`'s per-update rules run
    where every shard's gradient is a step; the default runs its own step
    (no rule), and `drop`, which applies to aggregated steps too."""
    plan = dataclasses.replace(plans.PRESETS["full"], workloads=("accuracy",))
    sessions = plans.sessions(plan, {4: {1: 0.0, 2: 0.01, 4: 0.03}})
    rules = {
        (s["contender"], s["replicas"]): [(t["rule"], t["straggler"]) for t in s["tasks"]]
        for s in sessions
    }
    assert rules == {
        ("plain_keras", 1): [(None, False)],
        ("mirrored", 4): [(None, True), (None, False)],
        ("tf_diffmap", 4): [(None, True), ("drop", True), (None, False)],
        ("tf_diffmap_per_shard", 4): [(r, True) for r in ("none", "inverse", "dc", "drop")],
        ("tf_diffmap_bounded", 4): [(None, True)],
        ("central_storage", 4): [(None, True)],
    }
    quick = dataclasses.replace(plans.PRESETS["quick"], workloads=("accuracy",))
    assert {s["contender"] for s in plans.sessions(quick, {4: {1: 0.0, 4: 0.03}})} == {
        "plain_keras",
        "mirrored",
        "tf_diffmap",
        "tf_diffmap_per_shard",
    }


def test_cells_print_spreads_and_nothing_alike():
    spread = {"median": 2.0, "min": 1.0, "max": 3.5, "values": [1.0, 2.0, 3.5]}
    assert report.cell(spread, "{:.1f}x") == "2.0x (1.0x–3.5x)"
    assert report.cell({"median": 2.0, "min": 2.0, "max": 2.0, "values": [2.0]}) == "2.00"
    assert report.cell(None) == report.cell(float("nan")) == "–"
    assert report.cell(12345) == "12,345"
    assert report.cell("a | b") == "a \\| b"
    table = report._table("T", ["a", "b"], [{"a": 1.5, "b": spread}], {"b": "{:.0f}"}, ["note"])
    assert report.render(table).splitlines() == [
        "## T",
        "",
        "| a | b |",
        "| --- | --- |",
        "| 1.50 | 2 (1–4) |",
        "",
        "- note",
    ]


# -- Smoke runs -----------------------------------------------------------------


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"results.json holds {constant}, which is not valid JSON")

    return json.loads(text, parse_constant=refuse)


def _run_suite(tmp_path, *args: str, plots: bool = False, timeout: int = 300):
    """Runs `python -m benchmarks --smoke ARGS --out tmp_path`; its process,
    results and Markdown (checked: exit 0, valid JSON, no session errors,
    targets that agree with their figures, the tables printed)."""
    command = [sys.executable, "-m", "benchmarks", "--smoke", *args, "--out", str(tmp_path)]
    if not plots:
        command.append("--no-plots")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _strict_json((tmp_path / "results.json").read_text())
    assert results["errors"] == [], results["errors"]
    markdown = (tmp_path / "results.md").read_text()
    assert proc.stdout.strip().startswith(markdown.split("## Figures")[0].strip())
    _check_targets(results, markdown)
    return proc, results, markdown


@pytest.mark.slow
def test_smoke_run_writes_results(tmp_path):
    import importlib.util

    plots = importlib.util.find_spec("matplotlib") is not None
    _, results, markdown = _run_suite(tmp_path, "--jobs", "2", plots=plots, timeout=240)
    assert results["plan"]["name"] == "smoke"
    assert [t["title"].split(" (")[0].split(":")[0] for t in results["tables"]] == [
        "Run",
        "Targets",
        "Throughput",
        "Straggler",
        "Time to accuracy",
        "Staleness points",
        "Peak memory",
    ]
    # The plan's step, not a calibration: (k - 1) x 2 ms.
    assert "| straggler t, 2 replicas | 2.0 ms (k=2: 2.0 ms; fixed by the plan) |" in markdown
    # The smoke preset runs no contender on 4 devices: no target is measured, each says why.
    targets = {t["key"]: t for t in results["targets"]}
    assert set(targets) == TIMED_TARGETS | AGGREGATION_TARGETS
    assert all(t["met"] is None for t in targets.values())

    (throughput,) = results["throughput"]
    assert (throughput["contender"], throughput["model"], throughput["replicas"]) == (
        "plain_keras",
        "mlp",
        1,
    )
    eps = _positive(throughput["examples_per_second"])
    (row,) = _table(results, "Throughput")["rows"]
    assert (row["Contender"], row["Replicas"], row["/ MirroredStrategy"]) == (
        "plain Keras",
        1,
        None,
    )
    assert _line(markdown, "| mlp | dataset | 1 |").startswith(
        f"| mlp | dataset | 1 | plain Keras | {eps:,.0f}"
    )

    straggler = {(r["contender"], r["replicas"], r["slowdown"]): r for r in results["straggler"]}
    assert set(straggler) == {
        (c, 2, k) for c in ("tf_diffmap", "tf_diffmap_per_shard") for k in (1, 2)
    }
    for row in straggler.values():
        _positive(row["examples_per_second"])
        assert 0 < row["replica0_share"] < 1
    slowed = straggler[("tf_diffmap", 2, 2)]
    assert slowed["delay_seconds"] == pytest.approx(0.002)  # (k - 1) x the plan's step
    assert slowed["retention"] == pytest.approx(
        slowed["examples_per_second"]["median"]
        / straggler[("tf_diffmap", 2, 1)]["examples_per_second"]["median"]
    )
    # The default (K = N) over a step per shard, on the default's rows only.
    assert slowed["vs_per_shard"] == pytest.approx(
        slowed["examples_per_second"]["median"]
        / straggler[("tf_diffmap_per_shard", 2, 2)]["examples_per_second"]["median"]
    )
    assert straggler[("tf_diffmap_per_shard", 2, 2)]["vs_per_shard"] is None
    line = _line(markdown, "| 2 | tf_diffmap | 2 |")
    assert f"| {slowed['examples_per_second']['median']:,.0f} |" in line
    assert f"| {slowed['retention']:.0%} | {slowed['vs_per_shard']:.2f}x |" in line
    assert _line(markdown, "| 2 | tf_diffmap, a step per shard | 2 |")

    # Plain Keras' reference; tf_diffmap's default; the per-update rule on a
    # step per shard.
    accuracy = {(r["contender"], r["rule"]): r for r in results["accuracy"]}
    assert set(accuracy) == {
        ("plain_keras", None),
        ("tf_diffmap", None),
        ("tf_diffmap_per_shard", "inverse"),
    }
    reference = accuracy[("plain_keras", None)]
    assert not reference["straggler"]
    assert accuracy[("tf_diffmap", None)]["straggler"]
    for row in accuracy.values():
        assert 0 < row["final_accuracy"]["median"] <= 1
        assert set(row["seconds_to"]) == {"0.95", "0.97"}
        assert row["histories"][0][0]["epoch"] == 1
    line = _line(markdown, "| plain Keras | 1 | – | none |")
    assert f"| {reference['final_accuracy']['median']:.4f} |" in line
    assert _line(markdown, "| tf_diffmap | 2 | default | replica 0 ×2 |")
    assert _line(markdown, "| tf_diffmap, a step per shard | 2 | inverse | replica 0 ×2 |")

    memory = {(r["contender"], r["replicas"]): r for r in results["memory"]}
    assert set(memory) == {("plain_keras", 1), ("tf_diffmap", 2), ("tf_diffmap_per_shard", 2)}
    assert all(r["peak_rss_mb_session"] > 100 for r in memory.values())

    # The cost of batch-level staleness points, under tf_diffmap on 2 devices.
    (points,) = results["points"]
    assert points["replicas"] == 2 and points["points_per_run"][0] > 0
    cpu = _positive(points["point_cpu_ms_median"])
    assert 0 < points["budget_points"]["median"] <= points["batches_per_fit"]
    assert _line(markdown, f"| 2 | {cpu:.3f}")
    if plots:
        assert results["figures"]
        for name in results["figures"]:
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_control_and_cluster(tmp_path):
    """The control and cluster workloads run and report their targets.

    The cluster workload starts localhost servers (LocalCluster for
    tf_diffmap); ParameterServerStrategy needs tf-keras, which this
    interpreter may not have, and is then left out with the reason. Six
    sessions, two of them localhost clusters: 6 minutes on a 2-core host
    that other jobs kept busy (load average 9 to 13), hence its timeout.
    """
    _, results, markdown = _run_suite(
        tmp_path, "--only", "control,cluster", "--device", "cpu", timeout=840
    )
    assert results["machine"]["device"] == "cpu"
    control = {
        (r["contender"], r["steps_per_loop"], r["steps_per_execution"]): r
        for r in results["control"]
    }
    assert set(control) == {
        (contender, k, spe)
        for contender, k in (
            ("plain_keras", None),
            ("tf_diffmap", 32),
            ("tf_diffmap_own_devices", 32),
        )
        for spe in (16, 1)
    }
    for row in control.values():
        _positive(row["updates_per_second"])
        _positive(row["cpu_us_per_update"])
        if row["contender"] != "plain_keras":
            # tf_diffmap's replicas: one update per shard.
            assert row["updates_per_step"] == 4
            assert row["updates_counted"] == row["updates_expected"]
    targets = {t["key"]: t for t in results["targets"]}
    for key, spe in (("control_spe16", 16), ("control_spe1", 1)):
        assert targets[key]["measured"] == pytest.approx(
            control[("tf_diffmap", 32, spe)]["updates_per_second"]["median"]
            / control[("plain_keras", None, spe)]["steps_per_second"]["median"]
        )
    shown = [(r["Contender"], r["steps_per_execution"]) for r in _table(results, "Control")["rows"]]
    assert shown == [
        (label, spe)
        for label in (
            "plain Keras",
            "tf_diffmap",
            "tf_diffmap, each replica's ops on its own device",
        )
        for spe in (16, 1)
    ]

    batch, workers = results["plan"]["cluster_batch_size"], results["plan"]["cluster_workers"]
    cluster = {(r["contender"], r["batch_size"]): r for r in results["cluster"]}
    # tf_diffmap on the cluster also at PSS' examples per update.
    expected = {("tf_diffmap_cluster", batch), ("tf_diffmap_cluster", batch * workers)}
    expected.add(("tf_diffmap", batch))
    if results["tf_keras"]["available"]:
        expected.add(("parameter_server", batch))
    assert set(cluster) == expected
    servers = workers + results["plan"]["cluster_ps"]
    for (contender, _), row in cluster.items():
        if contender == "tf_diffmap_cluster":
            assert len(row["devices"]) == workers
            assert all(d.startswith("/job:worker/") for d in row["devices"])
        eps = _positive(row["examples_per_second"])
        _positive(row["median_replica_ms_per_update"])
        _positive(row["cpu_ms_per_update"])
        _positive(row["cpu_ms_per_1000_examples"])
        # The CPU of this process, and of every server on a cluster.
        assert row["cpu_processes"] == (1 if contender == "tf_diffmap" else 1 + servers)
        line = _line(markdown, f"| {row['label']} |")
        assert f"| {eps:,.0f}" in line and f"| {row['cpu_processes']} |" in line
    assert targets["cluster_vs_in_process"]["measured"] == pytest.approx(
        cluster[("tf_diffmap_cluster", batch)]["examples_per_second"]["median"]
        / cluster[("tf_diffmap", batch)]["examples_per_second"]["median"]
    )
    if not results["tf_keras"]["available"]:
        assert targets["cluster_vs_parameter_server"]["met"] is None
        assert "tf-keras" in targets["cluster_vs_parameter_server"]["note"]


@pytest.mark.slow
def test_device_gpu_on_a_host_without_one_says_so():
    from benchmarks.suite import resolve_device

    try:
        import tensorflow as tf
    except ImportError:
        pytest.skip("no TensorFlow")
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this host has a GPU")
    assert resolve_device("auto", sys.executable) == ("cpu", 0)
    assert resolve_device("cpu", sys.executable) == ("cpu", 0)
    with pytest.raises(SystemExit, match="sees no GPU"):
        resolve_device("gpu", sys.executable)


@pytest.mark.slow
def test_smoke_fault_timeline(tmp_path):
    """The fault timeline runs: a worker of 3 is killed, the others go on, a plot is drawn.

    Its numbers mean little here (20 s; the restarted server may not even
    serve in that time on a busy host), so only their shape is checked.
    """
    import importlib.util

    plots = importlib.util.find_spec("matplotlib") is not None
    _, results, markdown = _run_suite(
        tmp_path, "--only", "fault_timeline", "--device", "cpu", plots=plots
    )
    (row,) = results["fault_timeline"]
    assert row["workers"] == 3 and row["killed_worker"] == 2 and row["lost_replicas"] == [2]
    assert row["script_errors"] == []
    before, outage = row["windows"]["before"], row["windows"]["outage"]
    rate = _positive(before["examples_per_second"])
    _positive(outage["examples_per_second"])  # the survivors went on
    # The killed worker did nothing (but what sampling smears into the first bin).
    killed = outage["replica_examples_per_second"][2]
    assert killed < 0.2 * before["replica_examples_per_second"][2]
    assert row["delays"]["seconds_kill_to_lost"]["median"] > 0
    assert row["times_lost"][0] >= 1
    (timeline,) = row["timelines"]
    assert len(timeline["examples_per_second"]) >= 15  # one per second of the 20 s run
    assert {"chief", "ps 0", "worker 0"} <= set(timeline["cpu_cores"][0])

    targets = {t["key"]: t for t in results["targets"]}
    assert targets["fault_outage"]["target"] == pytest.approx(2 / 3)
    assert targets["fault_outage"]["measured"] == pytest.approx(row["outage_share"]["median"])
    assert _line(markdown, "| before (").startswith(f"| before (1 s to the kill) | {rate:,.0f} |")
    assert _table(results, "Fault timeline: the worker's return")["rows"][0]["Value"]
    if plots:
        assert "fault_timeline.png" in results["figures"]
        assert (tmp_path / "fault_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cluster_model_option_runs_the_cluster_workloads_on_another_model():
    import keras

    from benchmarks import plan as plans
    from benchmarks.workloads import MODELS, build_model

    full = plans.PRESETS["full"]
    deep = plans.with_cluster_model(full, "mlp_deep_bn")
    assert deep.cluster_model == "mlp_deep_bn"
    assert deep.cluster_contenders == full.cluster_contenders
    sessions = plans._cluster_sessions(deep)
    assert {s["tasks"][0]["model"] for s in sessions} == {"mlp_deep_bn"}
    with pytest.raises(ValueError, match="Unknown model"):
        plans.with_cluster_model(full, "resnet")
    model = build_model(keras, "mlp_deep_bn")
    assert len(model.weights) == 50
    assert model.output_shape == (None, MODELS["mlp_deep_bn"]["classes"])


def _benchmark(module: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """Runs `python -m benchmarks.<module> args` from the checkout."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_two_checkouts_are_compared_side_by_side():
    """`benchmarks.checkouts` alternates the two and prints their ratio
    (the same checkout twice here: its figure means nothing)."""
    result = _benchmark("checkouts", str(ROOT), str(ROOT), "--rounds", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("round 1: ") for line in lines) == 2
    assert lines[-1].startswith("after/before: ") and lines[-1].endswith("x (medians)")


def test_checkouts_refuses_no_rounds():
    result = _benchmark("checkouts", "a", "b", "--rounds", "0", timeout=60)
    assert result.returncode == 2 and "--rounds must be at least 1, received 0" in result.stderr


@pytest.mark.slow
def test_the_regularized_recommender_prints_each_pair_and_the_ratios():
    """`benchmarks.regularized_recommender` times plain Keras and
    tf_diffmap epoch by epoch in one process and prints their ratio."""
    result = _benchmark(
        "regularized_recommender",
        str(ROOT),
        *("--rounds", "1", "--epochs", "1", "--ratings", "8000"),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("round 1: ") for line in lines) == 1
    assert "fresh windows (default)" in lines[0] and lines[0].endswith("x")
    assert "x plain Keras beside it (median of 1 pairs" in lines[-1]


def test_the_regularized_recommender_refuses_no_rounds():
    result = _benchmark("regularized_recommender", "a", "--rounds", "0", timeout=60)
    assert result.returncode == 2 and "must be at least 1" in result.stderr
    result = _benchmark("regularized_recommender", "a", "--ratings", "100", timeout=60)
    assert result.returncode == 2 and "--ratings must be at least 640" in result.stderr


@pytest.mark.slow
def test_smoke_embeddings(tmp_path):
    """The embedding workload runs both contenders at both table sizes and
    reports its three targets from their rows."""
    _, results, markdown = _run_suite(tmp_path, "--only", "embeddings", "--device", "cpu")
    rows = results["embeddings"]
    assert {(r["contender"], r["rows"]) for r in rows} == {
        (c, n) for c in ("plain_keras", "tf_diffmap") for n in (2_000, 20_000)
    }
    for row in rows:
        assert math.isfinite(row["examples_per_second"]) and row["examples_per_second"] > 0
        assert 0 < row["val_accuracy"] <= row["best_val_accuracy"] <= 1
        assert (row["mean_staleness"] is None) == (row["contender"] == "plain_keras")
        line = _line(
            markdown, f"| sgd | {row['rows']:,} | {row['table_mb']:.1f} | {row['contender']} |"
        )
        assert f"| {row['examples_per_second']:,.0f} |" in line
    assert len(_table(results, "Embeddings: cost per update")["rows"]) == 4

    def eps(contender, n):
        (row,) = [r for r in rows if r["contender"] == contender and r["rows"] == n]
        return row["examples_per_second"]

    targets = {t["key"]: t for t in results["targets"]}
    assert set(targets) == {"embedding_scaling", "embedding_vs_keras", "embedding_accuracy"}
    scaling = eps("tf_diffmap", 20_000) / eps("tf_diffmap", 2_000)
    assert targets["embedding_scaling"]["measured"] == pytest.approx(scaling)
    assert targets["embedding_vs_keras"]["measured"] == pytest.approx(
        eps("tf_diffmap", 20_000) / eps("plain_keras", 20_000)
    )
    assert targets["embedding_accuracy"]["unit"] == " pt"
    (row,) = _table(results, "Embeddings: examples/s at 20,000 rows")["rows"]
    assert row["tf_diffmap"] == pytest.approx(scaling)
    plain = eps("plain_keras", 20_000) / eps("plain_keras", 2_000)
    assert f"| sgd | {plain:.2f}x | {scaling:.2f}x |" in markdown


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_examples_runner(tmp_path):
    """One real example (keras-io's structured data with FeatureSpace, 303
    rows) under plain Keras and tf_diffmap, then the published page. Needs a
    keras-io checkout (`TF_DIFFMAP_KERAS_IO=PATH`) and pandas; a few minutes
    on a busy 2-core host, hence slow."""
    import os

    keras_io = os.environ.get("TF_DIFFMAP_KERAS_IO")
    if not keras_io:
        pytest.skip("set TF_DIFFMAP_KERAS_IO to a keras-io checkout")
    pytest.importorskip("pandas")
    out, docs = tmp_path / "out", tmp_path / "docs"
    command = [
        sys.executable,
        "-m",
        "benchmarks.examples",
        "--keras-io",
        keras_io,
        "--only",
        "feature_space",
        "--contenders",
        "plain",
        "tf_diffmap",
        "--seed",
        "0",
        "--out",
        str(out),
        "--publish",
        str(docs),
        "--host-note",
        "smoke test",
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((docs / "results.json").read_text())
    rows = record["table"]["feature_space"]
    for contender in ("plain", "tf_diffmap"):
        assert rows[contender]["failed"] == [], (contender, rows[contender])
        (value,) = rows[contender]["values"]
        assert 0.0 <= value <= 1.0  # validation accuracy
    assert rows["tf_diffmap"]["mean_staleness_steps"][0] >= 0
    markdown = (docs / "results.md").read_text()
    assert "| feature_space (val_accuracy, higher is better) |" in markdown


def test_the_fault_table_puts_each_event_side_by_side_under_both_strategies():
    from benchmarks import fault_table

    worker = {
        "before": 1.0,
        "event_epoch": 3.0,
        "after": 1.5,
        "cost": 2.0,
        "updates_lost": 4,
        "speed_after": 1 / 1.5,
    }
    rows = {
        ("tf_diffmap", "kill_worker"): [worker],
        ("pss", "kill_worker"): [{**worker, "cost": 6.0, "updates_lost": 0}],
        ("tf_diffmap", "ps"): [
            {"to_resumed_epoch_end": 39.0, "to_new_chief": 32.9, "updates_lost": 120}
        ],
        ("pss", "ps"): [{"raised": "UnavailableError", "to_error": 2.5}],
    }
    text = fault_table._table(rows, ["kill_worker", "ps"], ["tf_diffmap", "pss"], 1)
    lines = text.splitlines()
    kill = [line for line in lines if line.startswith("| kill worker 1 |")]
    assert kill == [
        "| kill worker 1 | tf_diffmap | 1.00 | 3.00 | 1.50 | 2.00 | 4 | 0.67x |",
        "| kill worker 1 | ParameterServerStrategy (tf-keras) | 1.00 | 3.00 | 1.50 | 6.00 | 0 "
        "| 0.67x |",
    ]
    assert any("39.0 to the end of the resumed epoch (new chief after 32.9)" in x for x in lines)
    assert any("fit raised UnavailableError after 2.5 s" in x for x in lines)
    assert "pass --tf-keras-python" not in text
    alone = fault_table._table(
        {k: v for k, v in rows.items() if k[0] == "tf_diffmap"}, ["kill_worker"], ["tf_diffmap"], 1
    )
    assert "ParameterServerStrategy (tf-keras) was not run: pass --tf-keras-python." in alone


@pytest.mark.slow
def test_the_push_profile_counts_the_calls_of_a_batch_and_draws_its_step(tmp_path):
    """`benchmarks.push_profile` on one host and a localhost cluster, with
    tiny settings: a row per contender, calls counted between the cluster's
    tasks, kernels read from the ps's profile, and the timeline drawn."""
    figure, out = tmp_path / "push.png", tmp_path / "out"
    result = _benchmark(
        "push_profile",
        "--steps", "3",
        "--profile-steps", "1",
        "--contenders", "one_host,cluster",
        "--figure", str(figure),
        "--out", str(out),
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tf_diffmap")]
    assert any(row.startswith("| tf_diffmap, one host") for row in rows)
    assert any(row.startswith("| tf_diffmap, cluster default (fresh windows)") for row in rows)
    counted = json.loads((out / "cluster_tap.json").read_text())
    methods = {c["method"] for c in counted["calls"]}
    assert "RecvTensor" in methods and "?" not in methods
    timed = json.loads((out / "cluster.json").read_text())
    assert timed["profile"]["tasks"]["ps 0"]["ops"] > 0
    # Each process' CPU per batch: the chief (this process) and every task.
    assert set(timed["cpu_ms"]) == {"chief", "worker 0", "worker 1", "ps 0"}
    assert all(ms > 0 for ms in timed["cpu_ms"].values())
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_push_profile_refuses_too_few_steps_and_unknown_contenders():
    result = _benchmark("push_profile", "--steps", "2", timeout=60)
    assert result.returncode == 2 and "--steps must be at least 3, received 2" in result.stderr
    result = _benchmark("push_profile", "--contenders", "cluster,mirrored", timeout=60)
    assert result.returncode == 2 and "Unknown contenders ['mirrored']" in result.stderr
