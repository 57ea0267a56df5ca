"""Elastic membership: examples/s and updates/s as workers go 2 -> 3 -> 2.

    python -m benchmarks.elastic [--phase-seconds 30] [--out DIR]

On a localhost cluster (`LocalCluster(workers=2, ps=1, elastic=True)`, each
worker one process of this machine) the chief trains a small dense model
with `fit` for three phases of `--phase-seconds` each: two workers; a third
that joins the running `fit` (`LocalCluster.join_worker`, which runs
`python -m tf_diffmap.cluster --join`); then that worker leaves as a
scale-down does (SIGTERM). A `timeline.Sampler` thread reads the strategy's
counters four times a second, and the store's version beside them.

It prints, per phase, the mean examples/s and updates/s (from the end of
the change that opened it), how long the join and the leave took, and the
version arithmetic at the end; writes `elastic.json` (the samples, events
and figures) and `elastic.png` (the rates over time above the version
counter, each change of membership marked) to `--out`.

The figures are this machine's: on a host with fewer cores than processes,
a third worker shares the same cores and adds little or nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import timeline

BATCH = 64
FEATURES = 32


class _VersionSampler(timeline.Sampler):
    """A `timeline.Sampler` that also reads the store's version."""

    def sample(self) -> None:
        super().sample()
        self.samples[-1]["version"] = int(self._strategy.version)


def phases(events: dict[str, float], end: float) -> list[dict[str, Any]]:
    """The three phases' windows from the events' times (seconds since start).

    Example:
        >>> [p["workers"] for p in phases({"joined": 10, "left": 20}, 30)]
        [2, 3, 2]
    """
    return [
        {"name": "2 workers", "workers": 2, "start": 0.0, "end": events.get("join_asked", end)},
        {"name": "3 workers", "workers": 3, "start": events.get("joined", end),
         "end": events.get("leave_asked", end)},
        {"name": "2 workers again", "workers": 2, "start": events.get("left", end), "end": end},
    ]  # fmt: skip


def phase_figures(rows: list[dict[str, Any]], window: dict[str, Any]) -> dict[str, Any]:
    """Mean and median rates over the bins that lie wholly inside a phase's
    window (the median leaves out the pause at the first epoch start after a
    change of membership, when TensorFlow instantiates its functions again).

    Example:
        >>> rows = [{"start": t, "end": t + 1, "examples_per_second": e,
        ...          "updates_per_second": e / 10} for t, e in enumerate([9, 0, 8, 10])]
        >>> f = phase_figures(rows, {"start": 0, "end": 4})
        >>> f["examples_per_second"], f["median_examples_per_second"]
        (6.75, 8.5)
    """
    inside = [r for r in rows if r["start"] >= window["start"] and r["end"] <= window["end"]]
    figures: dict[str, Any] = {**window, "bins": len(inside)}
    for key in ("examples_per_second", "updates_per_second"):
        values = [r[key] for r in inside]
        figures[key] = statistics.fmean(values) if values else None
        figures[f"median_{key}"] = statistics.median(values) if values else None
    return figures


def run(phase_seconds: float, out: Path) -> dict[str, Any]:
    import keras
    import numpy as np

    from tf_diffmap import cluster

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 256, FEATURES)).astype("float32")
    y = (x[:, : FEATURES // 2].sum(axis=1) > 0).astype("int32")
    events: dict[str, float] = {}
    with cluster.LocalCluster(workers=2, ps=1, elastic=True) as local:
        strategy = cluster.strategy_for_cluster(
            local.resolver(), max_workers=3, membership_port=local.membership_port
        )
        membership = cluster.membership_of(strategy)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((FEATURES,)),
                    keras.layers.Dense(256, activation="relu"),
                    keras.layers.Dense(256, activation="relu"),
                    keras.layers.Dense(2),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )

        def processes() -> dict[str, int]:
            return {f"{job} {index}": pid for (job, index), pid in local.pids.items()}

        sampler = _VersionSampler(strategy, processes, interval=0.25)
        done = threading.Event()
        failures: list[str] = []

        def script() -> None:
            try:
                if done.wait(phase_seconds):
                    return
                events["join_asked"] = time.monotonic() - sampler.start_time
                index, _ = local.join_worker()
                while membership.states()[index] != "member" and not done.wait(0.05):
                    pass
                events["joined"] = time.monotonic() - sampler.start_time
                if done.wait(phase_seconds):
                    return
                events["leave_asked"] = time.monotonic() - sampler.start_time
                local.leave(index)
                events["left"] = time.monotonic() - sampler.start_time
                done.wait(phase_seconds)
            except Exception as error:  # noqa: BLE001 - reported, and the run ends
                failures.append(f"{type(error).__name__}: {error}")
            finally:
                done.set()

        class Until(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if done.is_set():
                    self.model.stop_training = True

        # One short fit first: tracing and the first epoch's start-up are
        # not part of the timeline.
        model.fit(x[: BATCH * 8], y[: BATCH * 8], batch_size=BATCH, epochs=1, verbose=0)
        sampler.start(time.monotonic())
        thread = threading.Thread(target=script, name="benchmark-elastic", daemon=True)
        thread.start()
        model.fit(x, y, batch_size=BATCH, epochs=10_000, verbose=0, callbacks=[Until()])
        done.set()
        thread.join()
        samples = sampler.stop()
        stats = strategy.statistics()
        arithmetic = {
            "version": int(strategy.version),
            "steps": [int(s) for s in strategy.replica_steps()],
            "abandoned": int(stats.abandoned),
        }
        arithmetic["exact"] = (
            arithmetic["version"] == sum(arithmetic["steps"]) + arithmetic["abandoned"]
        )
    end = samples[-1]["t"]
    rows = timeline.bins(samples, width=1.0)
    figures = [phase_figures(rows, window) for window in phases(events, end)]
    result = {
        "phase_seconds": phase_seconds,
        "events": events,
        "join_seconds": _gap(events, "join_asked", "joined"),
        "leave_seconds": _gap(events, "leave_asked", "left"),
        "phases": figures,
        "arithmetic": arithmetic,
        "failures": failures + sampler.errors,
        "cpu_count": os.cpu_count(),
        "bins": [
            {k: r[k] for k in ("start", "end", "examples_per_second", "updates_per_second")}
            for r in rows
        ],
        "samples": [{k: s[k] for k in ("t", "updates", "states", "version")} for s in samples],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "elastic.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "elastic.png")
    return result


def _gap(events: dict[str, float], a: str, b: str) -> float | None:
    return events[b] - events[a] if a in events and b in events else None


def plot(result: dict[str, Any], path: Path) -> None:
    """The rates per second above the version counter, each change marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, versions) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[3, 2])
    mids = [(r["start"] + r["end"]) / 2 for r in result["bins"]]
    rates.plot(mids, [r["examples_per_second"] for r in result["bins"]], color="C0")
    rates.set_ylabel("examples/s", color="C0")
    updates = rates.twinx()
    updates.plot(mids, [r["updates_per_second"] for r in result["bins"]], color="C1", alpha=0.8)
    updates.set_ylabel("updates/s", color="C1")
    for phase in result["phases"]:
        if phase["examples_per_second"] is not None:
            rates.hlines(
                phase["examples_per_second"], phase["start"], phase["end"], colors="C0",
                linestyles="dotted",
            )  # fmt: skip
    ts = [s["t"] for s in result["samples"]]
    versions.plot(ts, [s["version"] for s in result["samples"]], color="C2")
    versions.set_ylabel("store version")
    versions.set_xlabel("seconds")
    labels = {
        "join_asked": "join asked",
        "joined": "joined",
        "leave_asked": "SIGTERM",
        "left": "left",
    }
    for key, label in labels.items():
        if key in result["events"]:
            for axis in (rates, versions):
                axis.axvline(result["events"][key], color="grey", linewidth=0.8, linestyle="--")
            rates.annotate(
                label, (result["events"][key], 1.0), xycoords=("data", "axes fraction"),
                rotation=90, va="top", ha="right", fontsize=8, color="grey",
            )  # fmt: skip
    rates.set_title("Workers 2 -> 3 -> 2 on a localhost cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("elastic-results"))
    args = parser.parse_args(argv)
    result = run(args.phase_seconds, args.out)
    for phase in result["phases"]:
        eps, ups = phase["examples_per_second"], phase["updates_per_second"]
        shown = (
            "no whole second"
            if eps is None
            else f"{eps:6.0f} examples/s {ups:5.1f} updates/s (median "
            f"{phase['median_examples_per_second']:.0f}, {phase['median_updates_per_second']:.1f})"
        )
        print(f"{phase['name']:<16} {shown}  ({phase['bins']} s)")
    for key in ("join_seconds", "leave_seconds"):
        if result[key] is not None:
            print(f"{key.replace('_', ' ')}: {result[key]:.1f}")
    a = result["arithmetic"]
    print(
        f"version {a['version']} = steps {sum(a['steps'])} + abandoned {a['abandoned']}: "
        f"{'exact' if a['exact'] else 'NOT EXACT'}"
    )
    for failure in result["failures"]:
        print("failure:", failure, file=sys.stderr)
    print(f"wrote {args.out / 'elastic.json'} and {args.out / 'elastic.png'}")
    return 0 if a["exact"] and not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
