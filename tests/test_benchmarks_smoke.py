"""Smoke test of the benchmark suite: a tiny configuration runs and writes valid JSON.

No timing is asserted: the smoke preset's numbers mean nothing. It runs two
sessions (plain Keras on one device; tf_diffmap on two with a straggler) in
subprocesses at once, which takes about 20 to 40 seconds on a 2-core host.
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


@pytest.mark.slow
def test_smoke_run_writes_results(tmp_path):
    plots = importlib.util.find_spec("matplotlib") is not None
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--jobs", "2", "--out", str(tmp_path)]
    if not plots:
        command.append("--no-plots")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = _strict_json((tmp_path / "results.json").read_text())
    assert KEYS <= set(results), sorted(KEYS - set(results))
    assert results["errors"] == [], results["errors"]
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
