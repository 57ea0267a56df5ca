"""The default trains momentum SGD where staleness is real, at low and at high staleness.

On a 2-core host the replica loops run nearly back to back, and 16 replicas
see a mean staleness of about 1. Here every replica sleeps 3 ms in each
training step (emulated device time, as it would wait on its own GPU,
using no CPU), with an inter-op pool large enough for the sleepers, so 4
replicas see a mean staleness of about 1.6 versions and 16 replicas
about 7.5. Each regime runs in a fresh process (`tests/regimes_runner.py`,
on the held-out grid's data and models), since the pool is set before
TensorFlow starts.

The default takes each step of the optimizer from one shard gradient per
replica, all read at the step's own parameters (fresh windows: the
staleness above is what other replicas' shards of the same window landed
between a read and its push; every applied gradient is 0 steps stale), and
skips a shard that comes after its window closed. So SGD with momentum
takes the steps it was tuned for in synchronous training. When every
shard's gradient was a step of its own, the same MLP with inputs scaled to
[0, 1] collapsed to 0.38 at 16 replicas (issue 40).
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

# Two fresh processes that each train two models for 15 epochs: minutes on a
# 2-core host, so among the slow tests (CI runs them).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "regimes_runner.py"

# (model, its inputs, SGD's learning rate with momentum 0.9, global batch).
MODELS = {
    "mlp": ("unit", 0.2, 256),  # inputs scaled to [0, 1], as the README's quick start
    "cnn": ("standardized", 0.05, 64),
}

# The least median accuracy each model must reach over RUNS runs, set from
# runs on this 2-core host, seed 0, 15 epochs (`tests/regimes_runner.py`),
# validation accuracy (staleness: mean, in versions):
#
#              sync (MirroredStrategy)  default, 4 replicas     default, 16 replicas
#   MLP, [0, 1]  0.964 (3 runs alike)     0.967-0.969, 4 runs (1.6)  0.964-0.969, 4 runs (7.0)
#   CNN, std.    0.936 (3 runs alike)     0.953-0.958, 4 runs (1.6)  0.822-0.961, 17 runs (7.5)
#
# (2026-12-07, fresh windows the default; the 16-replica CNN runs while one
# to two more such processes and up to three busy loops ran, load average 4
# to 22, dropping 67 to 178 late shards of 5,520; its 0.822 is a CI run, the
# next lowest 0.867.) A single run can end far under the rest, as
# synchronous training's does on this data (docs/staleness-aware-updates.md),
# so each model trains RUNS times and the median must clear a floor under
# every run seen: a median under it takes two such runs of three. Both stay
# far from the collapse that per-shard steps gave the MLP (0.38 at 16
# replicas).
FLOORS = {"mlp": 0.90, "cnn": 0.80}
RUNS = 3


def run_default(replicas_per_device: int) -> dict[str, list[dict]]:
    """Both models under the default, `RUNS` times each, in one fresh process."""
    configs = [
        {
            "variant": "default",
            "model": model,
            "preprocessing": preprocessing,
            "optimizer": "momentum_0.9",
            "learning_rate": rate,
            "batch_size": batch,
            "epochs": 15,
            "seed": 0,
            "replicas_per_device": replicas_per_device,
            "device_seconds": 0.003,
        }
        for model, (preprocessing, rate, batch) in MODELS.items()
        for _ in range(RUNS)
    ]
    proc = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(configs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("@@regimes@@ "))
    results: dict[str, list[dict]] = {}
    for config, result in zip(configs, json.loads(line.split(" ", 1)[1]), strict=True):
        results.setdefault(config["model"], []).append(result)
    return results


@pytest.mark.parametrize(
    "replicas_per_device, min_staleness",
    [(1, 1.2), (4, 6.0)],
    ids=["4 replicas, low staleness", "16 replicas, high staleness"],
)
def test_default_trains_momentum_sgd_where_staleness_is_real(replicas_per_device, min_staleness):
    """SGD with momentum 0.9 on the digits MLP and CNN, the optimizer as
    tuned for synchronous training, not wrapped."""
    results = run_default(replicas_per_device)
    for model, runs in results.items():
        for result in runs:
            assert result["replicas"] == 4 * replicas_per_device
            # K = N: one optimizer step per batch, whatever the replicas.
            assert result["gradients_per_step"] == result["replicas"]
            # The regime is real: replicas overlapped as that many devices would.
            assert result["mean_staleness"] >= min_staleness, (model, result)
        accuracy = statistics.median(r["accuracy"] for r in runs)
        assert accuracy >= FLOORS[model], (model, runs)
