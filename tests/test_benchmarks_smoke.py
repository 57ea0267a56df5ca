"""Smoke tests of the benchmark suite: tiny configurations run and write valid JSON.

No timing is asserted: the smoke preset's numbers mean nothing. It runs two
sessions (plain Keras on one device; tf_diffmap on two with a straggler) in
subprocesses at once, which takes about 20 to 40 seconds on a 2-core host;
the control, cluster and fault-timeline workloads have tests of their own
(the fault timeline's takes about a minute: a cluster of 3 workers, 20 s of
training).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

KEYS = {
    "schema",
    "created",
    "command",
    "plan",
    "machine",
    "versions",
    "tf_keras",
    "calibration",
    "throughput",
    "straggler",
    "accuracy",
    "memory",
    "targets",
    "errors",
    "sessions",
}
TARGET_KEYS = {
    "overhead",
    "even_vs_mirrored",
    "even_vs_central",
    "straggler_vs_mirrored",
    "straggler_retention",
    "tta_vs_mirrored",
    "final_accuracy_gap",
}


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"results.json holds {constant}, which is not valid JSON")

    return json.loads(text, parse_constant=refuse)


def _run_suite(tmp_path, *args: str, plots: bool = False, timeout: int = 300):
    """Runs `python -m benchmarks --smoke ARGS --out tmp_path`; its process
    and results (checked: exit 0, valid JSON, no session errors)."""
    command = [sys.executable, "-m", "benchmarks", "--smoke", *args, "--out", str(tmp_path)]
    if not plots:
        command.append("--no-plots")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _strict_json((tmp_path / "results.json").read_text())
    assert results["errors"] == [], results["errors"]
    return proc, results


@pytest.mark.slow
def test_smoke_run_writes_results(tmp_path):
    plots = importlib.util.find_spec("matplotlib") is not None
    proc, results = _run_suite(tmp_path, "--jobs", "2", plots=plots, timeout=240)
    assert KEYS <= set(results), sorted(KEYS - set(results))
    assert results["plan"]["name"] == "smoke"
    # The main interpreter has no tf-keras, and says so instead of failing.
    assert results["tf_keras"]["available"] in (True, False)

    (throughput,) = results["throughput"]
    assert (throughput["contender"], throughput["model"], throughput["replicas"]) == (
        "plain_keras",
        "mlp",
        1,
    )
    assert throughput["examples_per_second"]["median"] > 0

    straggler = {(r["contender"], r["replicas"], r["slowdown"]): r for r in results["straggler"]}
    assert set(straggler) == {("tf_diffmap", 2, 1), ("tf_diffmap", 2, 2)}
    for row in straggler.values():
        assert row["examples_per_second"]["median"] > 0
        assert 0 <= row["replica0_share"] <= 1
    assert straggler[("tf_diffmap", 2, 2)]["delay_seconds"] > 0

    (accuracy,) = results["accuracy"]
    assert accuracy["contender"] == "plain_keras" and not accuracy["straggler"]
    assert 0 <= accuracy["final_accuracy"]["median"] <= 1
    assert set(accuracy["seconds_to"]) == {"0.95", "0.97"}
    assert accuracy["histories"] and accuracy["histories"][0][0]["epoch"] == 1

    assert {(r["contender"], r["replicas"]) for r in results["memory"]} == {
        ("plain_keras", 1),
        ("tf_diffmap", 2),
    }
    assert all(r["peak_rss_mb_session"] > 0 for r in results["memory"])

    # The cost of batch-level staleness points, under tf_diffmap on 2 devices.
    (points,) = results["points"]
    assert points["replicas"] == 2 and points["points_per_run"][0] > 0
    assert points["point_cpu_ms"]["median"] > 0
    assert 0 < points["budget_points"]["median"] <= points["batches_per_fit"]
    assert "staleness points, 2 replicas" in proc.stderr

    assert {t["key"] for t in results["targets"]} == TARGET_KEYS
    assert all(t["met"] in (True, False, None) for t in results["targets"])

    markdown = (tmp_path / "results.md").read_text()
    assert "## Targets" in markdown and "## Throughput" in markdown
    assert "## Staleness points" in markdown
    if plots:
        assert results["figures"]
        for name in results["figures"]:
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_smoke_convergence_reports_staleness_and_the_regime_floor(tmp_path):
    """The convergence table: sync once, tf_diffmap in both regimes, each
    row with its measured staleness and a verdict against its floor."""
    proc, results = _run_suite(
        tmp_path, "--only", "convergence", "--contenders", "mirrored,tf_diffmap"
    )
    rows = {(r["regime"], r["rule"]): r for r in results["convergence"]}
    assert set(rows) == {
        ("sync", None),
        ("low", "auto"),
        ("low", "none"),
        ("high", "auto"),
        ("high", "none"),
    }
    assert rows[("sync", None)]["mean_staleness"]["median"] is None
    low, high = rows[("low", "auto")], rows[("high", "auto")]
    # 16 replicas with device time overlap more than 4: staleness is real.
    assert 1 <= low["mean_staleness"]["median"] < high["mean_staleness"]["median"]
    assert high["max_staleness"] >= high["mean_staleness"]["median"]
    assert all(0 <= r["final_accuracy"]["median"] <= 1 for r in rows.values())
    markdown = (tmp_path / "results.md").read_text()
    assert "### Low staleness: 4 replicas" in markdown
    assert "### High staleness: 16 replicas" in markdown
    assert "(s " in markdown  # every tf_diffmap cell prints its staleness


@pytest.mark.slow
def test_smoke_control_and_cluster(tmp_path):
    """The control and cluster workloads run and report their targets.

    The cluster workload starts localhost servers (LocalCluster for
    tf_diffmap); ParameterServerStrategy needs tf-keras, which this
    interpreter may not have, and is then left out with the reason.
    """
    proc, results = _run_suite(tmp_path, "--only", "control,cluster", "--device", "cpu")
    assert results["machine"]["device"] == "cpu"

    control = {
        (r["contender"], r["steps_per_loop"], r["steps_per_execution"]) for r in results["control"]
    }
    assert control == {
        ("plain_keras", None, 16),
        ("plain_keras", None, 1),
        ("tf_diffmap", 32, 16),
        ("tf_diffmap", 32, 1),
        ("tf_diffmap_own_devices", 32, 16),
        ("tf_diffmap_own_devices", 32, 1),
    }
    for row in results["control"]:
        assert row["updates_per_second"]["median"] > 0
        assert row["cpu_us_per_update"]["median"] > 0
        if row["contender"] != "plain_keras":
            # tf_diffmap's replicas: one update per shard.
            assert row["updates_per_step"] == 4
            assert row["updates_counted"] == row["updates_expected"]
    batch, workers = results["plan"]["cluster_batch_size"], results["plan"]["cluster_workers"]
    cluster = {(r["contender"], r["batch_size"]): r for r in results["cluster"]}
    # tf_diffmap on the cluster also at PSS' examples per update.
    expected = {("tf_diffmap_cluster", batch), ("tf_diffmap_cluster", batch * workers)}
    expected.add(("tf_diffmap", batch))
    if results["tf_keras"]["available"]:
        expected.add(("parameter_server", batch))
    assert set(cluster) == expected
    for key in expected:
        if key[0] == "tf_diffmap_cluster":
            assert all(d.startswith("/job:worker/") for d in cluster[key]["devices"])
            assert len(cluster[key]["devices"]) == workers
    servers = workers + results["plan"]["cluster_ps"]
    for (contender, _), row in cluster.items():
        assert row["examples_per_second"]["median"] > 0
        assert row["replica_ms_per_update"]["median"] > 0
        # The CPU of this process, and of every server on a cluster.
        assert row["cpu_processes"] == (1 if contender == "tf_diffmap" else 1 + servers)
        assert row["cpu_ms_per_update"]["median"] > 0
        assert row["cpu_ms_per_1000_examples"]["median"] > 0
    targets = {t["key"]: t for t in results["targets"]}
    for key in ("control_spe16", "control_spe1", "cluster_vs_in_process"):
        assert targets[key]["measured"] > 0 and targets[key]["met"] in (True, False)
    assert "cluster_vs_parameter_server" in targets
    assert "cluster_vs_parameter_server_per_update" in targets
    markdown = (tmp_path / "results.md").read_text()
    assert "## Control path" in markdown and "## Cluster" in markdown
    assert f"({1 + servers} processes)" in markdown
    assert "updates/s" in proc.stderr and "examples/s" in proc.stderr
    assert f"ms of CPU per update ({1 + servers} processes)" in proc.stderr


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

    Its numbers mean nothing here (20 s; the restarted server may not even
    serve in that time on a busy host), so only their shape is checked.
    """
    plots = importlib.util.find_spec("matplotlib") is not None
    proc, results = _run_suite(tmp_path, "--only", "fault_timeline", "--device", "cpu", plots=plots)

    (row,) = results["fault_timeline"]
    assert row["workers"] == 3 and row["killed_worker"] == 2 and row["lost_replicas"] == [2]
    assert row["script_errors"] == []
    before, outage = row["windows"]["before"], row["windows"]["outage"]
    assert before["examples_per_second"]["median"] > 0
    assert outage["examples_per_second"]["median"] > 0  # the survivors went on
    # The killed worker did nothing (but what sampling smears into the first bin).
    killed = outage["replica_examples_per_second"][2]
    assert killed < 0.2 * before["replica_examples_per_second"][2]
    assert row["delays"]["seconds_kill_to_lost"]["median"] is not None
    assert row["times_lost"][0] >= 1
    (timeline,) = row["timelines"]
    assert len(timeline["examples_per_second"]) >= 15  # one per second of the 20 s run
    assert {"chief", "ps 0", "worker 0"} <= set(timeline["cpu_cores"][0])

    targets = {t["key"]: t for t in results["targets"]}
    assert targets["fault_outage"]["target"] == pytest.approx(2 / 3)
    assert targets["fault_outage"]["met"] in (True, False)
    assert "## Fault timeline" in (tmp_path / "results.md").read_text()
    assert "fault timeline: examples/s before" in proc.stderr
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


def _convergence_row(accuracies, staleness=None):
    spread = {"median": sorted(accuracies)[len(accuracies) // 2], "values": accuracies}
    spread.update(min=min(accuracies), max=max(accuracies))
    return {"final_accuracy": spread, "mean_staleness": {"median": staleness}}


@pytest.mark.parametrize(
    "regime, default, none, verdict, met",
    [
        ("high", ([0.96, 0.95, 0.97], 11.0), None, "met", True),
        ("high", ([0.96, 0.95, 0.97], 3.0), None, "invalid: mean staleness 3.0 < 5", None),
        ("high", ([0.93, 0.94, 0.95], 11.0), None, "missed (sync)", False),
        ("high", ([0.96, 0.40, 0.97], 11.0), None, "missed (a run at 0.400)", False),
        ("low", ([0.96, 0.95, 0.97], 2.5), [0.98, 0.98, 0.99], "missed (`none`)", False),
        ("low", ([0.96, 0.95, 0.97], 2.5), [0.96, 0.97, 0.96], "met", True),
    ],
)
def test_convergence_verdict_names_what_the_default_fell_short_of(
    regime, default, none, verdict, met
):
    from benchmarks.report import _convergence_verdict

    floor = 5.0 if regime == "high" else 1.0
    sync = _convergence_row([0.96, 0.96, 0.965])
    got = _convergence_verdict(
        regime, floor, _convergence_row(*default), sync, none and _convergence_row(none, 2.5)
    )
    assert got == (verdict, met)


@pytest.mark.slow
def test_two_checkouts_are_compared_side_by_side():
    """`benchmarks.checkouts` alternates the two and prints their ratio
    (the same checkout twice here: its figure means nothing)."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkouts", str(ROOT), str(ROOT), "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("round 1: ") for line in lines) == 2
    assert lines[-1].startswith("after/before: ") and lines[-1].endswith("x (medians)")


def test_checkouts_refuses_no_rounds():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkouts", "a", "b", "--rounds", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--rounds must be at least 1, received 0" in result.stderr


@pytest.mark.slow
def test_smoke_embeddings(tmp_path):
    """The embedding workload runs both contenders at both table sizes and
    reports its three targets from their rows."""
    proc, results = _run_suite(tmp_path, "--only", "embeddings", "--device", "cpu")
    rows = results["embeddings"]
    assert {(r["contender"], r["rows"]) for r in rows} == {
        (c, n) for c in ("plain_keras", "tf_diffmap") for n in (2_000, 20_000)
    }
    for row in rows:
        assert row["examples_per_second"] > 0
        assert 0 <= row["val_accuracy"] <= row["best_val_accuracy"] <= 1
        assert (row["mean_staleness"] is None) == (row["contender"] == "plain_keras")

    def eps(contender, n):
        (row,) = [r for r in rows if r["contender"] == contender and r["rows"] == n]
        return row["examples_per_second"]

    targets = {t["key"]: t for t in results["targets"]}
    assert targets["embedding_scaling"]["measured"] == pytest.approx(
        eps("tf_diffmap", 20_000) / eps("tf_diffmap", 2_000)
    )
    assert targets["embedding_vs_keras"]["measured"] == pytest.approx(
        eps("tf_diffmap", 20_000) / eps("plain_keras", 20_000)
    )
    assert targets["embedding_accuracy"]["unit"] == " pt"
    assert "## Embeddings" in (tmp_path / "results.md").read_text()
    assert "embeddings: sgd, 20,000 rows, tf_diffmap" in proc.stderr
