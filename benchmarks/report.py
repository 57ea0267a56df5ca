"""From the sessions' results to medians, targets and tables.

`build` makes the results document (`results.json`): per workload, rows of
medians over the rounds (a *spread* is a figure's median, min, max and
values), and `targets`, one record per target: its figure, threshold and
whether it was met, or why it was not measured. `tables` lays the rows out
as tables (a title, named columns, rows keyed by column, short notes) and
`render` writes any table as Markdown. What each workload measures and how
to read its table is in `docs/benchmarks.md`.
"""

from __future__ import annotations

import datetime
import math
import re
import statistics
from collections import defaultdict
from typing import Any

from benchmarks import workloads
from benchmarks.contenders import CONTENDERS, label

__all__ = ["TARGETS", "build", "tables", "render", "markdown", "cell", "met"]

SCHEMA = 2

# key: (description, comparison, threshold, unit). `fault_outage`'s threshold
# is set from the plan: the surviving workers' share, (W - 1) / W.
TARGETS = {
    "overhead": ("Overhead, 1 replica: tf_diffmap / plain Keras throughput", ">=", 1.0, "x"),
    "even_vs_mirrored": (
        "Even replicas, 4 replicas: tf_diffmap / MirroredStrategy throughput",
        ">=",
        3.0,
        "x",
    ),
    "even_vs_central": (
        "Even replicas, 4 replicas: tf_diffmap / CentralStorageStrategy (tf-keras) throughput",
        ">=",
        1.0,
        "x",
    ),
    "straggler_vs_mirrored": (
        "Straggler (4 replicas, one 4x slower): tf_diffmap / MirroredStrategy throughput",
        ">=",
        5.0,
        "x",
    ),
    "straggler_retention": (
        "Straggler (4 replicas, one 4x slower): tf_diffmap / its own no-straggler throughput",
        ">=",
        0.85,
        "x",
    ),
    "tta_vs_mirrored": (
        "Time to 97% on digits with a straggler: tf_diffmap / MirroredStrategy",
        "<=",
        0.5,
        "x",
    ),
    "final_accuracy_gap": (
        "Final accuracy on digits with a straggler: tf_diffmap minus MirroredStrategy, in points",
        ">=",
        -0.5,
        " points",
    ),
    "control_spe16": (
        "Control path, steps_per_execution=16: tf_diffmap updates/s / plain Keras steps/s",
        ">=",
        1.0,
        "x",
    ),
    "control_spe1": (
        "Control path, steps_per_execution=1: tf_diffmap updates/s / plain Keras steps/s",
        ">=",
        2.5,
        "x",
    ),
    "cluster_vs_in_process": (
        "Cluster: tf_diffmap on the localhost cluster / the same replicas in one process",
        ">=",
        0.6,
        "x",
    ),
    "cluster_vs_parameter_server": (
        "Cluster: tf_diffmap / ParameterServerStrategy (tf-keras) on the same cluster shape",
        ">=",
        3.0,
        "x",
    ),
    "cluster_vs_parameter_server_per_update": (
        "Cluster: tf_diffmap, each update on as many examples as a ParameterServerStrategy "
        "step (global batch x workers) / ParameterServerStrategy",
        ">=",
        3.0,
        "x",
    ),
    "fault_outage": (
        "Fault timeline: examples/s while a worker is down / before it was killed",
        ">=",
        2 / 3,
        "x",
    ),
    "fault_after": (
        "Fault timeline: examples/s after the restarted worker rejoined / before it was killed",
        ">=",
        0.95,
        "x",
    ),
    "embedding_scaling": (
        "Embeddings, SGD: tf_diffmap's examples/s at the largest table / at the smallest",
        ">=",
        0.8,
        "x",
    ),
    "embedding_vs_keras": (
        "Embeddings, SGD, largest table: tf_diffmap / plain Keras examples/s",
        ">=",
        1.0,
        "x",
    ),
    "embedding_cluster": (
        "Embeddings on a localhost cluster, the table split over the ps tasks: tf_diffmap / "
        "ParameterServerStrategy (tf-keras) examples/s, the worst over optimizers",
        ">=",
        1.0,
        "x",
    ),
    "embedding_accuracy": (
        "Embeddings: best validation accuracy over the epochs, tf_diffmap minus plain Keras, "
        "the worst over optimizers and table sizes (points)",
        ">=",
        -1.0,
        " pt",
    ),
}

# The tf_diffmap default K, which the control targets are read at.
DEFAULT_STEPS_PER_LOOP = 32
# A convergence run below this accuracy collapsed (chance is 0.1 on digits).
COLLAPSED = 0.5
# The windows of a fault timeline, in order (`benchmarks.timeline.summarize`).
FAULT_WINDOWS = ("before", "outage", "restarting", "after")
FAULT_DELAYS = (
    ("seconds_kill_to_lost", "kill → replica marked lost, s"),
    ("seconds_restart_to_serving", "restart → new server serves, s"),
    ("seconds_serving_to_rejoin", "serves → replica rejoined, s"),
    ("seconds_restart_to_rejoin", "restart → rejoined, s"),
    ("seconds_rejoin_to_first_update", "rejoined → its first update, s"),
    ("seconds_rejoin_to_full_rate", "rejoined → end of its first bin at the full rate, s"),
)
NO_TF_KERAS = "tf-keras not available (see the run table)"


# -- Rows: medians over the rounds ----------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    return {
        "median": _median(values),
        "min": min(values, default=None),
        "max": max(values, default=None),
        "values": values,
    }


def _tasks(runs, kind: str):
    """(session result, task, task result, session config) of every task of
    `kind` that succeeded."""
    for run in runs:
        for entry in run["result"].get("tasks", []):
            if entry["task"]["kind"] == kind and entry["result"].get("status") == "ok":
                yield run["result"], entry["task"], entry["result"], run["config"]


def _groups(runs, kind: str, key) -> dict[tuple, list]:
    """Task results of `kind` grouped by `key(session, task, result, config)`."""
    groups: dict[tuple, list] = defaultdict(list)
    for session, task, result, config in _tasks(runs, kind):
        groups[key(session, task, result, config)].append({**result, "_task": task})
    return groups


def _staleness(results, field: str = "overall_mean_staleness") -> float | None:
    return _median((r.get("staleness") or {}).get(field) for r in results)


def _share0(result) -> float | None:
    steps = result.get("replica_steps")
    return steps[0] / sum(steps) if steps and sum(steps) else None


def _order(contender: str) -> int:
    return list(CONTENDERS).index(contender)


def _find(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def _errors(runs) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        session, config = run["result"], run["config"]
        where = {
            "round": run["round"] + 1,
            "contender": config["contender"],
            "replicas": config["replicas"],
        }
        if session.get("status") != "ok":
            detail = session.get("stderr_tail") or session.get("traceback")
            out.append({**where, "task": None, "error": session.get("error"), "detail": detail})
            continue
        for entry in session.get("tasks", []):
            result = entry["result"]
            if result.get("status") != "ok":
                out.append(
                    {
                        **where,
                        "task": entry["task"]["kind"],
                        "error": result.get("error"),
                        "detail": result.get("traceback"),
                    }
                )
    return out


def _throughput(runs, max_staleness) -> list[dict[str, Any]]:
    groups = _groups(
        runs,
        "throughput",
        lambda s, t, r, c: (t["model"], t.get("input", "dataset"), s["replicas"], s["contender"]),
    )
    return [
        {
            "model": model,
            "input": input_,
            "replicas": replicas,
            "contender": contender,
            "label": label(contender, max_staleness),
            "examples_per_second": _spread(r["examples_per_second"] for r in results),
            "median_epoch_seconds": _median(r["median_epoch_seconds"] for r in results),
            "warmup_seconds": _median(r["warmup_seconds"] for r in results),
            "mean_staleness": _staleness(results),
            "runs": len(results),
        }
        for (model, input_, replicas, contender), results in sorted(groups.items())
    ]


def _straggler(runs, max_staleness) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for session, _, result, _ in _tasks(runs, "straggler"):
        for slowdown, window in result["windows"].items():
            groups[(session["replicas"], session["contender"], int(slowdown))].append(window)
    rows = []
    for (replicas, contender, slowdown), windows in sorted(groups.items()):
        base = _median(w["examples_per_second"] for w in groups.get((replicas, contender, 1), []))
        eps = _spread(w["examples_per_second"] for w in windows)
        rows.append(
            {
                "replicas": replicas,
                "contender": contender,
                "label": label(contender, max_staleness),
                "slowdown": slowdown,
                "delay_seconds": _median(w["delay_seconds"] for w in windows),
                "examples_per_second": eps,
                "epoch_seconds": _spread(w["median_epoch_seconds"] for w in windows),
                "retention": _ratio(eps["median"], base),
                "replica0_share": _median(_share0(w) for w in windows),
                "mean_staleness": _staleness(windows),
                "runs": len(windows),
            }
        )
    return rows


def _reached_median(values: list[float | None]) -> float | None:
    """Median where a run that never reached the target counts as infinitely slow."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]
    return None if None in middle else sum(middle) / len(middle)


def _accuracy(runs, max_staleness) -> list[dict[str, Any]]:
    groups = _groups(
        runs,
        "accuracy",
        lambda s, t, r, c: (s["contender"], s["replicas"], t.get("rule"), bool(t["straggler"])),
    )
    rows = []
    for (contender, replicas, rule, straggler), results in groups.items():
        task = results[0]["_task"]
        targets = [str(t) for t in task["targets"]]
        stale = [r.get("staleness") or {} for r in results]
        updates = sum(sum(s.get("updates", [])) for s in stale)
        dropped = sum(sum(s.get("dropped", [])) for s in stale)
        rows.append(
            {
                "contender": contender,
                "label": label(contender, max_staleness),
                "replicas": replicas,
                "rule": rule,
                "drop_above": task.get("drop_above"),
                "straggler": straggler,
                "delay_seconds": task.get("delay"),
                "epochs": task["epochs"],
                "seconds_to": {
                    t: _reached_median([r["seconds_to"].get(t) for r in results]) for t in targets
                },
                "epochs_to": {
                    t: _reached_median([r["epochs_to"].get(t) for r in results]) for t in targets
                },
                "reached": {
                    t: sum(r["seconds_to"].get(t) is not None for r in results) for t in targets
                },
                "final_accuracy": _spread(r["final_accuracy"] for r in results),
                "best_accuracy": _median(r["best_accuracy"] for r in results),
                "train_seconds": _median(r["train_seconds"] for r in results),
                "mean_staleness": _staleness(results),
                "max_staleness": max(
                    (s.get("overall_max_staleness") for s in stale if s), default=None
                ),
                "dropped_fraction": dropped / (updates + dropped)
                if stale[0] and updates + dropped
                else None,
                "replica0_share": _median(_share0(r) for r in results),
                "histories": [r["history"] for r in results],
                "runs": len(results),
            }
        )
    rules = {None: 0, "none": 1, "inverse": 2, "dc": 3, "drop": 4}
    rows.sort(key=lambda r: (not r["straggler"], _order(r["contender"]), rules.get(r["rule"], 9)))
    return rows


def _convergence(runs) -> list[dict[str, Any]]:
    """Per regime, model, optimizer and rule: final accuracy and staleness over the seeds."""
    groups = _groups(
        runs,
        "convergence",
        lambda s, t, r, c: (c.get("regime"), t["model"], t["optimizer"], t.get("rule")),
    )
    return [
        {
            "regime": regime,
            "model": model,
            "optimizer": optimizer,
            "rule": rule,
            "final_accuracy": _spread(r["final_accuracy"] for r in results),
            "mean_staleness": _spread(
                (r.get("staleness") or {}).get("overall_mean_staleness") for r in results
            ),
            "max_staleness": max(
                (
                    r["staleness"]["overall_max_staleness"]
                    for r in results
                    if (r.get("staleness") or {}).get("overall_max_staleness") is not None
                ),
                default=None,
            ),
            "momentum_warning": any(r.get("momentum_warning") for r in results),
        }
        for (regime, model, optimizer, rule), results in groups.items()
    ]


def _points(runs) -> list[dict[str, Any]]:
    """The cost of batch-level staleness points, per device count."""
    groups = _groups(runs, "points", lambda s, t, r, c: r["replicas"])
    return [
        {
            "replicas": replicas,
            "batches_per_fit": results[0]["batches_per_fit"],
            "points_per_run": [r["points"] for r in results],
            "ms_per_batch": _spread(r["ms_per_batch"] for r in results),
            "point_cpu_ms": _spread(r["point_cpu_ms_median"] for r in results),
            "point_cpu_ms_p90": _spread(r["point_cpu_ms_p90"] for r in results),
            "snapshots_overhead": _spread(r["snapshots_overhead"] for r in results),
            "every_point_overhead": _spread(r["every_point_overhead"] for r in results),
            "budget_overhead": _spread(r["budget_overhead"] for r in results),
            "budget_points": _spread(p for r in results for p in r["budget_points"]),
        }
        for replicas, results in sorted(groups.items())
    ]


def _control(runs) -> list[dict[str, Any]]:
    """Per contender, K and steps_per_execution: Keras steps/s and updates/s."""
    groups = _groups(
        runs,
        "control",
        lambda s, t, r, c: (s["contender"], r.get("steps_per_loop"), t["steps_per_execution"]),
    )
    return [
        {
            "contender": contender,
            "label": label(contender),
            "steps_per_loop": k,
            "steps_per_execution": spe,
            "updates_per_step": results[0].get("updates_per_step"),
            "steps_per_second": _spread(r["steps_per_second"] for r in results),
            "updates_per_second": _spread(r["updates_per_second"] for r in results),
            "cpu_us_per_update": _spread(r.get("cpu_us_per_update") for r in results),
            "updates_counted": [r.get("updates_counted") for r in results],
            "updates_expected": [r.get("updates_expected") for r in results],
            "mean_staleness": _staleness(results),
            "runs": len(results),
        }
        for (contender, k, spe), results in sorted(
            groups.items(), key=lambda i: (_order(i[0][0]), -(i[0][1] or 0), -i[0][2])
        )
    ]


def _cluster(runs) -> list[dict[str, Any]]:
    """Per contender and global batch: examples/s and a replica's time per update."""
    groups = _groups(runs, "cluster", lambda s, t, r, c: (s["contender"], t["batch_size"]))
    rows = []
    for (contender, batch), results in sorted(
        groups.items(), key=lambda i: (_order(i[0][0]), i[0][1])
    ):
        name = "tf_diffmap, one process" if contender == "tf_diffmap" else label(contender)
        rows.append(
            {
                "contender": contender,
                "batch_size": batch,
                "label": f"{name}, batch {batch}",
                "devices": results[0]["devices"],
                "examples_per_second": _spread(r["examples_per_second"] for r in results),
                "median_epoch_seconds": _median(r["median_epoch_seconds"] for r in results),
                "replica_ms_per_update": _spread(
                    r["median_replica_ms_per_update"] for r in results
                ),
                "replica_time_source": results[0]["replica_time_source"],
                "cpu_ms_per_update": _spread(r.get("cpu_ms_per_update") for r in results),
                "cpu_ms_per_1000_examples": _spread(
                    r.get("cpu_ms_per_1000_examples") for r in results
                ),
                "cpu_processes": results[0].get("cpu_processes"),
                "replica_steps": [r.get("replica_steps") for r in results],
                "mean_staleness": _staleness(results),
                "warmup_seconds": _median(r["warmup_seconds"] for r in results),
                "runs": len(results),
            }
        )
    return rows


def _fault_timeline(runs) -> list[dict[str, Any]]:
    """Medians over the runs of each window's rate and each delay; every
    run's own series (per bin) in `timelines`, for the plot."""
    results = [{**r, "_task": t} for _, t, r, _ in _tasks(runs, "fault_timeline")]
    if not results:
        return []
    first, task = results[0], results[0]["_task"]
    summaries = [r["summary"] for r in results]
    lost = first["lost_replicas"]

    def window(name):
        found = [s["windows"][name] for s in summaries]
        per_replica = [
            w["replica_examples_per_second"] for w in found if w["replica_examples_per_second"]
        ]
        processes = list(dict.fromkeys(n for w in found for n in w["cpu_cores"]))
        return {
            "examples_per_second": _spread(w["examples_per_second"] for w in found),
            "min_examples_per_second": _spread(w["min_examples_per_second"] for w in found),
            "bin_cv": _median(w["bin_cv"] for w in found),
            "bins": _median(w["bins"] for w in found),
            "replica_examples_per_second": [
                _median(v[i] for v in per_replica) for i in range(len(per_replica[0]))
            ]
            if per_replica
            else [],
            "cpu_cores": {n: _median(w["cpu_cores"].get(n) for w in found) for n in processes},
        }

    return [
        {
            "contender": "tf_diffmap_cluster",
            "label": label("tf_diffmap_cluster"),
            "workers": len(first["devices"]),
            "devices": first["devices"],
            "killed_worker": first["killed_worker"],
            "lost_replicas": lost,
            "input": task.get("input", "dataset"),
            "seconds": task["seconds"],
            "kill_at": task["kill_at"],
            "restart_at": task["restart_at"],
            "windows": {name: window(name) for name in FAULT_WINDOWS},
            "before_examples_per_second": _spread(
                s["before_examples_per_second"] for s in summaries
            ),
            **{
                f"{name}_share": _spread(s[f"{name}_share"] for s in summaries)
                for name in ("outage", "restarting", "after")
            },
            "delays": {key: _spread(s[key] for s in summaries) for key, _ in FAULT_DELAYS},
            "full_rate": summaries[0]["full_rate"],
            "rejoined_runs": sum(s["seconds_restart_to_rejoin"] is not None for s in summaries),
            "trained_after_rejoin_runs": sum(
                s["seconds_rejoin_to_first_update"] is not None for s in summaries
            ),
            "times_lost": [sum(r["replica_lost_counts"][i] for i in lost) for r in results],
            "restart_cpu_seconds": _spread(r["events"].get("restart_cpu_seconds") for r in results),
            "abandoned": [r["abandoned"] for r in results],
            "replica_errors": [
                next((r["replica_errors"][i] for i in lost if r["replica_errors"][i]), None)
                for r in results
            ],
            "script_errors": [r["script_error"] for r in results if r["script_error"]],
            "timelines": [
                {
                    "events": r["events"],
                    "summary": {k: v for k, v in r["summary"].items() if k != "windows"},
                    "start": [b["start"] for b in r["bins"]],
                    "examples_per_second": [b["examples_per_second"] for b in r["bins"]],
                    "replica_examples_per_second": [
                        b["replica_examples_per_second"] for b in r["bins"]
                    ],
                    "cpu_cores": [b["cpu_cores"] for b in r["bins"]],
                }
                for r in results
            ],
            "runs": len(results),
        }
    ]


def _embeddings(runs) -> list[dict[str, Any]]:
    """Per contender, table size and optimizer: medians over the rounds."""
    groups = _groups(
        runs,
        "embeddings",
        lambda s, t, r, c: (s["contender"], s["replicas"], t["rows"], t["optimizer"]),
    )
    rows = []
    for (contender, replicas, table_rows, optimizer), results in groups.items():
        eps = [r["examples_per_second"] for r in results]
        rows.append(
            {
                "contender": contender,
                "replicas": replicas,
                "rows": table_rows,
                "optimizer": optimizer,
                "table_mb": results[0]["table_mb"],
                "runs": len(results),
                "examples_per_second": _median(eps),
                "examples_per_second_values": eps,
                **{
                    key: _median(r.get(key) for r in results)
                    for key in (
                        "cpu_seconds_per_1000_examples",
                        "val_accuracy",
                        "best_val_accuracy",
                        "bytes_sent_per_update",
                    )
                },
                "examples_per_update": results[0].get("examples_per_update"),
                "table_shards": results[0].get("table_shards"),
                "mean_staleness": _staleness(results),
            }
        )
    return sorted(rows, key=lambda r: (r["optimizer"], r["rows"], r["contender"]))


def _memory(runs, max_staleness) -> list[dict[str, Any]]:
    """Peak RSS per contender and device count: after the MLP throughput task
    (the session's first), and at the session's end."""
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for run in runs:
        session = run["result"]
        kinds = {t["kind"] for t in run["config"]["tasks"]}
        if session.get("status") != "ok" or kinds <= {"control", "cluster", "fault_timeline"}:
            continue  # their own sessions, not the timed contenders' memory
        first = (session.get("tasks") or [None])[0]
        mlp = (
            first
            and first["task"]["kind"] == "throughput"
            and first["task"]["model"] == "mlp"
            and first["task"].get("input", "dataset") == "dataset"
        )
        groups[(session["contender"], session["replicas"])].append(
            (first["result"].get("peak_rss_mb") if mlp else None, session.get("peak_rss_mb"))
        )
    return [
        {
            "contender": contender,
            "label": label(contender, max_staleness),
            "replicas": replicas,
            "peak_rss_mb_mlp": _median(v[0] for v in values),
            "peak_rss_mb_session": _median(v[1] for v in values),
            "runs": len(values),
        }
        for (contender, replicas), values in sorted(groups.items())
    ]


# -- Targets --------------------------------------------------------------------


def met(measured, comparison: str, threshold: float) -> bool | None:
    """Whether `measured` meets the target (None: not measured)."""
    if measured is None:
        return None
    return measured >= threshold if comparison == ">=" else measured <= threshold


def _target(key, measured, note="", suffix="", threshold=None, missing="") -> dict[str, Any]:
    """A target's record; `missing` says why a figure of None was not measured."""
    text, comparison, default, unit = TARGETS[key]
    threshold = default if threshold is None else threshold
    if measured is None:
        note = "; ".join(n for n in (missing or "a figure it needs was not measured", note) if n)
    return {
        "key": key,
        "description": text + suffix,
        "measured": measured,
        "comparison": comparison,
        "target": threshold,
        "unit": unit,
        "met": met(measured, comparison, threshold),
        "note": note,
    }


def _timed_targets(plan, throughput, straggler, accuracy, tf_keras) -> list[dict[str, Any]]:
    def eps(model, replicas, contender, input_="dataset"):
        row = _find(throughput, model=model, replicas=replicas, contender=contender, input=input_)
        return row["examples_per_second"]["median"] if row else None

    def ratio(model, replicas, theirs, input_="dataset"):
        return _ratio(
            eps(model, replicas, "tf_diffmap", input_), eps(model, replicas, theirs, input_)
        )

    def suffix(model, input_="dataset"):
        kind = workloads.MODELS[model]["description"].split(" ")[0]
        return f" ({kind}, NumPy arrays to fit)" if input_ == "numpy" else f" ({kind})"

    numpy = "mlp" in plan.models and bool(plan.numpy_input_replicas)
    inputs = [(m, "dataset") for m in plan.models] + ([("mlp", "numpy")] if numpy else [])
    if "throughput" not in plan.workloads:
        inputs = []
    out = [
        _target("overhead", ratio(m, 1, "plain_keras", i), suffix=suffix(m, i)) for m, i in inputs
    ]
    out += [
        _target(
            "even_vs_mirrored",
            ratio(m, 4, "mirrored", i),
            suffix=suffix(m, i),
            note="Keras 3 rebuilds MirroredStrategy's distributed iterator every epoch"
            if i == "numpy"
            else "",
        )
        for m, i in inputs
    ]
    out += [
        _target(
            "even_vs_central",
            ratio(m, 4, "central_storage"),
            suffix=suffix(m),
            missing="" if tf_keras.get("available") else NO_TF_KERAS,
        )
        for m, i in inputs
        if i == "dataset"
    ]

    def straggled(contender, slowdown):
        row = _find(straggler, replicas=4, contender=contender, slowdown=slowdown)
        return row["examples_per_second"]["median"] if row else None

    if "straggler" in plan.workloads:
        out.append(
            _target(
                "straggler_vs_mirrored",
                _ratio(straggled("tf_diffmap", 4), straggled("mirrored", 4)),
            )
        )
        out.append(
            _target(
                "straggler_retention",
                _ratio(straggled("tf_diffmap", 4), straggled("tf_diffmap", 1)),
                note="no-straggler reference: the same model and delay layer with a 0 s delay",
            )
        )
    if "accuracy" not in plan.workloads:
        return out
    ours = _find(accuracy, contender="tf_diffmap", rule="none", straggler=True)
    theirs = _find(accuracy, contender="mirrored", rule=None, straggler=True)
    top = str(max(plan.accuracy_targets))
    note = "AsyncOptimizer rule 'none'"
    if ours and theirs and theirs["seconds_to"].get(top) is None:
        note = (
            f"MirroredStrategy did not reach {float(top):.0%} within {theirs['epochs']} epochs "
            "in most runs"
        )
    elif ours and theirs and ours["seconds_to"].get(top) is None:
        note = f"tf_diffmap did not reach {float(top):.0%} in most runs"
    out.append(
        _target(
            "tta_vs_mirrored",
            _ratio(ours and ours["seconds_to"].get(top), theirs and theirs["seconds_to"].get(top)),
            note=note,
        )
    )
    gap = None
    if (
        ours
        and theirs
        and None not in (ours["final_accuracy"]["median"], theirs["final_accuracy"]["median"])
    ):
        gap = 100 * (ours["final_accuracy"]["median"] - theirs["final_accuracy"]["median"])
    out.append(
        _target(
            "final_accuracy_gap",
            gap,
            note="read as: not more than half a point below MirroredStrategy",
        )
    )
    return out


def _control_targets(control) -> list[dict[str, Any]]:
    def rate(contender, spe, field):
        k = DEFAULT_STEPS_PER_LOOP if contender == "tf_diffmap" else None
        row = _find(control, contender=contender, steps_per_execution=spe, steps_per_loop=k)
        return row[field]["median"] if row else None

    return [
        _target(
            key,
            _ratio(
                rate("tf_diffmap", spe, "updates_per_second"),
                rate("plain_keras", spe, "steps_per_second"),
            ),
            note=f"tf_diffmap at its default steps_per_loop={DEFAULT_STEPS_PER_LOOP}",
        )
        for key, spe in (("control_spe16", 16), ("control_spe1", 1))
    ]


def _cluster_targets(cluster, plan, tf_keras) -> list[dict[str, Any]]:
    def eps(contender, batch=plan.cluster_batch_size):
        row = _find(cluster, contender=contender, batch_size=batch)
        return row["examples_per_second"]["median"] if row else None

    ours, pss = eps("tf_diffmap_cluster"), eps("parameter_server")
    per_update = plan.cluster_batch_size * plan.cluster_workers
    missing = "" if tf_keras.get("available") else NO_TF_KERAS
    return [
        _target("cluster_vs_in_process", _ratio(ours, eps("tf_diffmap"))),
        _target("cluster_vs_parameter_server", _ratio(ours, pss), missing=missing),
        _target(
            "cluster_vs_parameter_server_per_update",
            _ratio(eps("tf_diffmap_cluster", per_update), pss),
            note=f"tf_diffmap at global batch {per_update}, ParameterServerStrategy at "
            f"{plan.cluster_batch_size}",
            missing=missing,
        ),
    ]


def _fault_targets(plan, rows) -> list[dict[str, Any]]:
    row = rows[0] if rows else None
    workers = plan.fault_workers
    after = f"the full rate, within {1 - plan.fault_full_rate:.0%}"
    if row and row["rejoined_runs"] != row["runs"]:
        after += f"; the worker rejoined in {row['rejoined_runs']} of {row['runs']} runs"
    return [
        _target(
            "fault_outage",
            row and row["outage_share"]["median"],
            note=f"the surviving workers' share: {workers - 1} of {workers}",
            threshold=(workers - 1) / workers,
        ),
        _target("fault_after", row and row["after_share"]["median"], note=after),
    ]


def _embedding_targets(table, plan, tf_keras) -> list[dict[str, Any]]:
    def eps(contender, table_rows, optimizer="sgd"):
        row = _find(table, contender=contender, rows=table_rows, optimizer=optimizer)
        return row["examples_per_second"] if row else None

    small, large = min(plan.embedding_rows), max(plan.embedding_rows)
    gaps = []
    for row in table:
        same = _find(table, contender="plain_keras", rows=row["rows"], optimizer=row["optimizer"])
        if row["contender"] == "tf_diffmap" and same:
            if None not in (row["best_val_accuracy"], same["best_val_accuracy"]):
                gaps.append(100 * (row["best_val_accuracy"] - same["best_val_accuracy"]))
    replicas = plan.embedding_replicas
    out = [
        _target(
            "embedding_scaling",
            _ratio(eps("tf_diffmap", large), eps("tf_diffmap", small)),
            note=f"{replicas} replicas, {large:,} rows / {small:,} rows",
        ),
        _target(
            "embedding_vs_keras",
            _ratio(eps("tf_diffmap", large), eps("plain_keras", large)),
            note=f"{replicas} replicas / one device, {large:,} rows",
        ),
        _target(
            "embedding_accuracy",
            min(gaps, default=None),
            note=f"{plan.embedding_epochs} epochs each",
        ),
    ]
    if plan.embedding_cluster_rows is not None:
        rows = plan.embedding_cluster_rows
        ratios = [
            _ratio(eps("tf_diffmap_cluster", rows, o), eps("parameter_server", rows, o))
            for o in plan.embedding_cluster_optimizers
        ]
        ratios = [r for r in ratios if r is not None]
        out.insert(
            2,
            _target(
                "embedding_cluster",
                min(ratios, default=None),
                note=f"{plan.embedding_cluster_workers} workers, {plan.embedding_cluster_ps} ps, "
                f"{rows:,} rows, {plan.embedding_batch_size} examples per update",
                missing="" if tf_keras.get("available") else NO_TF_KERAS,
            ),
        )
    return out


def build(
    *,
    plan,
    runs,
    calibration,
    machine,
    tf_keras,
    command,
    mirrored_reduce,
    inter_op_threads=None,
    seconds,
):
    """The results document (what `results.json` holds)."""

    def version(legacy: bool, key: str):
        return next(
            (
                r["result"].get(key)
                for r in runs
                if r["result"].get("status") == "ok"
                and CONTENDERS[r["config"]["contender"]].legacy == legacy
            ),
            None,
        )

    chosen = plan.workloads
    throughput = _throughput(runs, plan.max_staleness)
    straggler = _straggler(runs, plan.max_staleness)
    accuracy = _accuracy(runs, plan.max_staleness)
    control, cluster = _control(runs), _cluster(runs)
    fault_timeline, embeddings = _fault_timeline(runs), _embeddings(runs)
    targets = _timed_targets(plan, throughput, straggler, accuracy, tf_keras)
    if "control" in chosen:
        targets += _control_targets(control)
    if "cluster" in chosen:
        targets += _cluster_targets(cluster, plan, tf_keras)
    if "fault_timeline" in chosen:
        targets += _fault_targets(plan, fault_timeline)
    if "embeddings" in chosen:
        targets += _embedding_targets(embeddings, plan, tf_keras)
    results = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "seconds": seconds,
        "plan": plan.to_dict(),
        "machine": machine,
        "versions": {
            "tensorflow": version(False, "tensorflow_version"),
            "keras": version(False, "keras_version"),
            "tf_keras": version(True, "keras_version"),
        },
        "tf_keras": tf_keras,
        "mirrored_reduce": mirrored_reduce,
        "inter_op_threads": inter_op_threads,
        "calibration": {str(k): v for k, v in calibration.items()},
        "throughput": throughput,
        "straggler": straggler,
        "accuracy": accuracy,
        "memory": _memory(runs, plan.max_staleness),
        "convergence": _convergence(runs),
        "points": _points(runs),
        "control": control,
        "cluster": cluster,
        "fault_timeline": fault_timeline,
        "embeddings": embeddings,
        "targets": targets,
        "errors": _errors(runs),
        "sessions": runs,
    }
    results["tables"] = tables(results)
    return results


# -- Tables ---------------------------------------------------------------------


def _table(title, columns, rows, formats=None, notes=()) -> dict[str, Any]:
    """A table: rows keyed by column; `formats` per column (`str.format`
    patterns, applied to numbers and to each figure of a spread)."""
    return {
        "title": title,
        "columns": list(columns),
        "formats": formats or {},
        "rows": rows,
        "notes": [n for n in notes if n],
    }


def cell(value, pattern: str | None = None) -> str:
    """A cell's text: "–" for nothing, a spread as "median (min–max)"."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, dict):
        text = cell(value["median"], pattern)
        if value["median"] is None or len(value["values"]) < 2:
            return text
        return f"{text} ({cell(value['min'], pattern)}–{cell(value['max'], pattern)})"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        default = "{:,}" if isinstance(value, int) else "{:,.2f}"
        return (pattern or default).format(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def render(table: dict[str, Any]) -> str:
    """A table as Markdown: its title, the columns, one line per row, then its notes."""
    columns, formats = table["columns"], table["formats"]
    lines = [f"## {table['title']}", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + " --- |" * len(columns))
    for row in table["rows"]:
        lines.append("| " + " | ".join(cell(row.get(c), formats.get(c)) for c in columns) + " |")
    if not table["rows"]:
        lines.append("| (no rows) |" + " |" * (len(columns) - 1))
    lines += [""] + [f"- {note}" for note in table["notes"]] + [""] * bool(table["notes"])
    return "\n".join(lines)


def _targets_table(results) -> dict[str, Any]:
    verdicts = {True: "met", False: "missed", None: "not measured"}
    rows = [
        {
            "Target": t["description"],
            "Measured": None if t["measured"] is None else f"{t['measured']:.2f}{t['unit']}",
            "Threshold": f"{'≥' if t['comparison'] == '>=' else '≤'} {t['target']:.3g}{t['unit']}",
            "Result": verdicts[t["met"]],
            "Note": t["note"],
        }
        for t in results["targets"]
    ]
    return _table("Targets", ["Target", "Measured", "Threshold", "Result", "Note"], rows)


def _devices(machine) -> str:
    if machine.get("device") == "gpu":
        return (
            f"GPUs ({machine.get('gpus')}: one per replica, or logical GPUs of "
            f"{machine.get('gpu_memory_mb')} MiB of GPU 0 when fewer than the replicas)"
        )
    return f"logical CPU devices of one {machine.get('logical_cpus')}-CPU host"


def _run_table(results) -> dict[str, Any]:
    plan, machine, versions, tf_keras = (
        results["plan"],
        results["machine"],
        results["versions"],
        results["tf_keras"],
    )

    def load(values):
        return "/".join(f"{v:.1f}" for v in values) if values else "–"

    rows = {
        "run": f"{results['created']}, preset `{plan['name']}`, {plan['repeats']} repeat(s), "
        f"{results['seconds'] / 60:.1f} min",
        "command": f"`{results['command']}`",
        "machine": f"{machine.get('cpu')}, {machine.get('logical_cpus')} logical CPUs, "
        f"{machine.get('memory_gib')} GiB, {machine.get('platform')}",
        "load average, start; end": f"{load(machine.get('load_average_start'))}; "
        f"{load(machine.get('load_average_end'))}",
        "replicas": _devices(machine),
        "TensorFlow, Keras": f"{versions.get('tensorflow')}, {versions.get('keras')}",
        "tf-keras": f"{versions.get('tf_keras')} (`{tf_keras.get('python')}`)"
        if tf_keras.get("available")
        else f"not run: {tf_keras.get('reason')}",
        "MirroredStrategy's cross-device ops": "collective all-reduce"
        if results["mirrored_reduce"] == "collective"
        else "ReductionToOneDevice",
        "inter-op threads": results.get("inter_op_threads") or "TensorFlow's default",
    }
    if set(plan["workloads"]) & {"throughput", "straggler", "accuracy"}:
        rows.update(
            {
                "global batch, Adam's learning rate": f"{plan['batch_size']}, "
                f"{plan['learning_rate']:g}",
                "timed window": f"≥ {plan['min_epochs']} epochs and ≥ {plan['min_seconds']:g} s "
                "after a warm-up fit",
                "examples per epoch": ", ".join(
                    f"{n:,} ({m.upper()})"
                    for m, n in plan["examples_per_epoch"].items()
                    if m in plan["models"] or m == plan["straggler_model"]
                ),
            }
        )
    return _table(
        "Run", ["Setting", "Value"], [{"Setting": k, "Value": v} for k, v in rows.items()]
    )


def _calibration_table(results) -> dict[str, Any]:
    rows = []
    for replicas, entry in results["calibration"].items():
        delays = entry.get("delays") or {}
        rows.append(
            {
                "Replicas": int(replicas),
                "t, ms": 1000 * entry["step_seconds"] if "step_seconds" in entry else None,
                "delays, ms": ", ".join(
                    f"k={k}: {1000 * d:.1f}" for k, d in delays.items() if int(k) > 1
                ),
                "source": entry.get("source") or f"not calibrated: {entry.get('error')}",
            }
        )
    return _table(
        "Straggler calibration: t, one MirroredStrategy step; replica 0 sleeps (k-1)·t",
        ["Replicas", "t, ms", "delays, ms", "source"],
        rows,
        {"t, ms": "{:.1f}"},
    )


def _contenders(rows) -> list[str]:
    present = {r["contender"] for r in rows}
    return [c for c in CONTENDERS if c in present]


def _throughput_table(results) -> dict[str, Any]:
    rows = results["throughput"]
    labels = {r["contender"]: r["label"] for r in rows}
    out = []
    for model, input_ in dict.fromkeys((r["model"], r["input"]) for r in rows):
        mine = [r for r in rows if r["model"] == model and r["input"] == input_]
        for replicas in sorted({r["replicas"] for r in mine}):
            found = {r["contender"]: r for r in mine if r["replicas"] == replicas}
            row = {
                "Model": model.upper() + (", NumPy arrays" if input_ == "numpy" else ""),
                "Replicas": replicas,
            }
            row.update({labels[c]: r["examples_per_second"] for c, r in found.items()})
            if "tf_diffmap" in found and "mirrored" in found:
                row["tf_diffmap / Mirrored"] = _ratio(
                    found["tf_diffmap"]["examples_per_second"]["median"],
                    found["mirrored"]["examples_per_second"]["median"],
                )
            out.append(row)
    names = [labels[c] for c in _contenders(rows)]
    return _table(
        "Throughput (examples/s, no straggler)",
        ["Model", "Replicas", *names, "tf_diffmap / Mirrored"],
        out,
        {**{n: "{:,.0f}" for n in names}, "tf_diffmap / Mirrored": "{:.2f}x"},
    )


def _straggler_table(results) -> dict[str, Any]:
    rows = results["straggler"]
    ks = sorted({r["slowdown"] for r in rows})
    top = max(ks, default=None)
    out = []
    for replicas in sorted({r["replicas"] for r in rows}):
        for contender in _contenders(rows):
            found = {
                r["slowdown"]: r
                for r in rows
                if r["replicas"] == replicas and r["contender"] == contender
            }
            if not found:
                continue
            row = {"Replicas": replicas, "Contender": next(iter(found.values()))["label"]}
            for k, r in found.items():
                row[f"k={k} examples/s"] = r["examples_per_second"]
                row[f"k={k} s/epoch"] = r["epoch_seconds"]["median"]
            if top in found:
                row[f"kept at k={top}"] = found[top]["retention"]
                row[f"replica 0 share at k={top}"] = found[top]["replica0_share"]
            out.append(row)
    columns = ["Replicas", "Contender", *(f"k={k} examples/s" for k in ks)]
    columns += [f"k={k} s/epoch" for k in ks]
    columns += [f"kept at k={top}", f"replica 0 share at k={top}"]
    formats = {c: "{:,.0f}" for c in columns if c.endswith("examples/s")}
    formats.update({c: "{:.2f}" for c in columns if c.endswith("s/epoch")})
    formats.update({f"kept at k={top}": "{:.0%}", f"replica 0 share at k={top}": "{:.1%}"})
    return _table("Straggler (replica 0 k times slower)", columns, out, formats)


def _accuracy_table(results) -> dict[str, Any]:
    rows = results["accuracy"]
    targets = list(rows[0]["seconds_to"]) if rows else []
    slowdown = results["plan"]["accuracy_slowdown"]
    out = []
    for r in rows:
        rule = f"drop (> {r['drop_above']})" if r["rule"] == "drop" else r["rule"]
        row = {
            "Contender": f"{r['label']} ({r['replicas']})",
            "Rule": rule,
            "Straggler": f"replica 0 ×{slowdown}" if r["straggler"] else "none",
            "final accuracy": r["final_accuracy"],
            "mean staleness": r["mean_staleness"],
            "max staleness": r["max_staleness"],
            "dropped": r["dropped_fraction"],
            "replica 0 share": r["replica0_share"],
            "train s": r["train_seconds"],
        }
        for t in targets:
            seconds = r["seconds_to"][t]
            row[f"s to {float(t):.0%}"] = (
                seconds
                if seconds is not None
                else f"not reached ({r['reached'][t]}/{r['runs']} runs did)"
            )
        if targets:
            row[f"epochs to {float(targets[-1]):.0%}"] = r["epochs_to"][targets[-1]]
        out.append(row)
    reach = [f"s to {float(t):.0%}" for t in targets]
    epochs = [f"epochs to {float(targets[-1]):.0%}"] if targets else []
    return _table(
        f"Time to accuracy (digits, {results['plan']['accuracy_epochs']} epochs)",
        ["Contender", "Rule", "Straggler", *reach, *epochs, "final accuracy"]
        + ["mean staleness", "max staleness", "dropped", "replica 0 share", "train s"],
        out,
        {
            **{c: "{:.2f}" for c in reach},
            **{c: "{:.0f}" for c in epochs},
            "final accuracy": "{:.4f}",
            "mean staleness": "{:.2f}",
            "dropped": "{:.1%}",
            "replica 0 share": "{:.1%}",
            "train s": "{:.1f}",
        },
    )


def _points_table(results) -> dict[str, Any]:
    plan = results["plan"]
    rows = [
        {
            "Replicas": r["replicas"],
            "CPU per point, ms": r["point_cpu_ms"],
            "p90, ms": r["point_cpu_ms_p90"]["median"],
            "batch, ms": r["ms_per_batch"],
            "fit, snapshots only": r["snapshots_overhead"]["median"],
            "fit, every point": r["every_point_overhead"]["median"],
            "fit, default budget": r["budget_overhead"]["median"],
            "points at the default budget": r["budget_points"]["median"],
            "batches per fit": r["batches_per_fit"],
        }
        for r in results["points"]
    ]
    fits = ["fit, snapshots only", "fit, every point", "fit, default budget"]
    return _table(
        'Staleness points (`StalenessTensorBoard(update_freq="batch")`)',
        ["Replicas", "CPU per point, ms", "p90, ms", "batch, ms", *fits]
        + ["points at the default budget", "batches per fit"],
        rows,
        {
            "CPU per point, ms": "{:.3f}",
            "p90, ms": "{:.3f}",
            "batch, ms": "{:.1f}",
            **{c: "{:+.1%}" for c in fits},
            "points at the default budget": "{:,.0f}",
        },
        [
            f"digits, MLP, batch {plan['points_batch_size']}, {plan['points_epochs']} epoch(s) "
            f"per fit, {plan['points_rounds']} round(s); fit: median time against no callback"
        ],
    )


def _memory_table(results) -> dict[str, Any]:
    rows = [
        {
            "Contender": r["label"],
            "Replicas": r["replicas"],
            "after the MLP throughput task": r["peak_rss_mb_mlp"],
            "whole session": r["peak_rss_mb_session"],
        }
        for r in sorted(results["memory"], key=lambda r: (_order(r["contender"]), r["replicas"]))
    ]
    columns = ["Contender", "Replicas", "after the MLP throughput task", "whole session"]
    return _table(
        "Peak memory (RSS, MiB, per process)",
        columns,
        rows,
        dict.fromkeys(columns[2:], "{:,.0f}"),
    )


def _control_table(results) -> dict[str, Any]:
    plan = results["plan"]
    rows = results["control"]
    spes = plan["control_steps_per_execution"]
    out = []
    for contender, k in dict.fromkeys((r["contender"], r["steps_per_loop"]) for r in rows):
        found = {
            r["steps_per_execution"]: r
            for r in rows
            if r["contender"] == contender and r["steps_per_loop"] == k
        }
        first = next(iter(found.values()))
        row = {
            "Contender": first["label"],
            "steps_per_loop": f"{k} (default)" if k == DEFAULT_STEPS_PER_LOOP else k,
            "updates per step": first["updates_per_step"],
        }
        for spe, r in found.items():
            row[f"spe={spe} updates/s"] = r["updates_per_second"]
            row[f"spe={spe} CPU µs per update"] = r["cpu_us_per_update"]["median"]
        out.append(row)
    rates = [f"spe={n} updates/s" for n in spes]
    cpu = [f"spe={n} CPU µs per update" for n in spes]
    return _table(
        "Control path (updates/s; plain Keras: steps/s)",
        ["Contender", "steps_per_loop", "updates per step", *rates, *cpu],
        out,
        {**dict.fromkeys(rates, "{:,.0f}"), **dict.fromkeys(cpu, "{:,.0f}")},
        [
            f"{workloads.CONTROL_MODEL['description']} {plan['control_learning_rate']:g}, "
            f"global batch {plan['control_batch_size']}, {plan['control_steps_per_epoch']} "
            f"steps an epoch; spe: steps_per_execution"
        ],
    )


def _cluster_table(results) -> dict[str, Any]:
    plan = results["plan"]

    def short(device: str) -> str:
        parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
        where = f"{parts['job']} {parts.get('task', 0)} " if "job" in parts else ""
        return where + parts.get("device", device)

    rows = [
        {
            "Contender": r["label"],
            "devices": ", ".join(short(d) for d in r["devices"]),
            "examples/s": r["examples_per_second"],
            "replica ms per update": r["replica_ms_per_update"],
            "replica time from": r["replica_time_source"],
            "CPU ms per update": r["cpu_ms_per_update"],
            "CPU ms per 1,000 examples": r["cpu_ms_per_1000_examples"],
            "processes": r["cpu_processes"],
            "mean staleness": r["mean_staleness"],
        }
        for r in results["cluster"]
    ]
    columns = ["Contender", "devices", "examples/s", "replica ms per update"]
    columns += ["replica time from", "CPU ms per update", "CPU ms per 1,000 examples"]
    columns += ["processes", "mean staleness"]
    model = workloads.MODELS[plan["cluster_model"]]["description"]
    return _table(
        f"Cluster: {plan['cluster_workers']} workers + {plan['cluster_ps']} ps + chief on "
        "localhost",
        columns,
        rows,
        {
            "examples/s": "{:,.0f}",
            "replica ms per update": "{:.2f}",
            "CPU ms per update": "{:.2f}",
            "CPU ms per 1,000 examples": "{:.2f}",
            "mean staleness": "{:.2f}",
        },
        [
            f"{model}, Adam {plan['learning_rate']:g}, {plan['cluster_examples_per_epoch']:,} "
            "examples an epoch",
            "every server ran on the host's CPUs, not on the GPUs --device names"
            if results["machine"].get("device") == "gpu"
            else "",
        ],
    )


def _root_line(error: str) -> str:
    """A runtime error's own sentence: its root cause, else its first line past the framing."""
    kind = error.split(":", 1)[0]
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for line in lines:
        found = re.match(r"\(\d+\)\s+[A-Z_]+:\s*(.+)", line)
        if found:
            return f"{kind}: {found.group(1).strip()}"[:300]
    framing = ("Graph execution error", "Detected at node", "<stack traces", "defined at")
    for line in lines[1:]:
        if not line.startswith(framing):
            return f"{kind}: {line}"[:300]
    return lines[0][:300] if lines else ""


def _fault_tables(results) -> list[dict[str, Any]]:
    plan = results["plan"]
    title = (
        f"Fault timeline: {plan['fault_workers']} workers + {plan['fault_ps']} ps + chief on "
        f"localhost, worker {plan['fault_worker']} killed and restarted"
    )
    if not results["fault_timeline"]:
        return [_table(title, ["Window"], [])]
    row = results["fault_timeline"][0]
    workers = [f"worker {i} examples/s" for i in range(row["workers"])]
    processes = [n for n in row["windows"]["before"]["cpu_cores"] if n != "host"]
    spans = {
        "before": f"{plan['fault_warmup_seconds']:g} s to the kill",
        "outage": "kill to restart",
        "restarting": "restart to rejoin",
        "after": f"{plan['fault_settle_seconds']:g} s after the rejoin to the end",
    }
    windows = []
    for name in FAULT_WINDOWS:
        w = row["windows"][name]
        windows.append(
            {
                "Window": f"{name} ({spans[name]})",
                "examples/s": w["examples_per_second"],
                "of the rate before": row.get(f"{name}_share"),
                "slowest bin": w["min_examples_per_second"]["median"],
                **dict(zip(workers, w["replica_examples_per_second"])),
                **{f"CPU cores: {n}": w["cpu_cores"].get(n) for n in processes},
            }
        )
    cores = [f"CPU cores: {n}" for n in processes]
    runs = row["runs"]
    facts = [{"What": text, "Value": row["delays"][key]} for key, text in FAULT_DELAYS]
    facts += [
        {"What": "runs where the worker rejoined", "Value": f"{row['rejoined_runs']} of {runs}"},
        {
            "What": "runs where it applied updates after its rejoin",
            "Value": f"{row['trained_after_rejoin_runs']} of {runs}",
        },
        {
            "What": "times its replica was marked lost, per run",
            "Value": ", ".join(map(str, row["times_lost"])),
        },
        {
            "What": "CPU seconds of the new server until it served",
            "Value": row["restart_cpu_seconds"],
        },
    ]
    errors = [_root_line(e) for e in row["replica_errors"] if e]
    notes = [
        f"the error that last made the killed worker's replica lost: `{e}` "
        f"({errors.count(e)} of {runs} runs)"
        for e in dict.fromkeys(errors)
    ]
    notes += [f"script error: {e}" for e in row["script_errors"]]
    source = "NumPy arrays" if row["input"] == "numpy" else "a repeated tf.data.Dataset"
    return [
        _table(
            title,
            ["Window", "examples/s", "of the rate before", "slowest bin", *workers, *cores],
            windows,
            {
                "examples/s": "{:,.0f}",
                "of the rate before": "{:.2f}x",
                "slowest bin": "{:,.0f}",
                **dict.fromkeys(workers, "{:,.0f}"),
                **dict.fromkeys(cores, "{:.2f}"),
            },
            [
                f"{workloads.MODELS[plan['cluster_model']]['description']}, global batch "
                f"{plan['cluster_batch_size']}, input: {source}; fit of {row['seconds']:g} s, "
                f"kill at {row['kill_at']:g} s, restart at {row['restart_at']:g} s; "
                f"{plan['fault_bin_seconds']:g}-s bins; {runs} run(s)"
            ],
        ),
        _table(
            "Fault timeline: the worker's return",
            ["What", "Value"],
            facts,
            {"Value": "{:.2f}"},
            notes,
        ),
    ]


def _embedding_tables(results) -> list[dict[str, Any]]:
    plan = results["plan"]
    table = results["embeddings"]
    on_cluster = plan.get("embedding_cluster_contenders", ())
    small, large = min(plan["embedding_rows"]), max(plan["embedding_rows"])
    rows = [
        {
            "Optimizer": r["optimizer"],
            "Rows": r["rows"],
            "MB": r["table_mb"],
            "Contender": r["contender"],
            "examples/s": r["examples_per_second"],
            "CPU s / 1k ex.": r["cpu_seconds_per_1000_examples"],
            "val. accuracy": r["val_accuracy"],
            "best val. accuracy": r["best_val_accuracy"],
            "mean staleness": r["mean_staleness"],
        }
        for r in table
        if r["contender"] not in on_cluster
    ]

    def eps(contender, table_rows, optimizer):
        row = _find(table, contender=contender, rows=table_rows, optimizer=optimizer)
        return row["examples_per_second"] if row else None

    scaling = [
        {
            "Optimizer": o,
            **{c: _ratio(eps(c, large, o), eps(c, small, o)) for c in plan["embedding_contenders"]},
        }
        for o in plan["embedding_optimizers"]
    ]
    acc = "{:.3f}"
    out = [
        _table(
            "Embeddings: cost per update against table size",
            list(rows[0]) if rows else ["Optimizer", "Rows", "Contender", "examples/s"],
            rows,
            {
                "MB": "{:.1f}",
                "examples/s": "{:,.0f}",
                "CPU s / 1k ex.": "{:.3f}",
                "val. accuracy": acc,
                "best val. accuracy": acc,
                "mean staleness": "{:.2f}",
            },
            [
                f"{plan['embedding_replicas']} replicas for tf_diffmap, batch "
                f"{plan['embedding_batch_size']}, {plan['embedding_examples_per_epoch']:,} "
                f"examples an epoch, {plan['embedding_epochs']} epochs (the first not timed)"
            ],
        ),
        _table(
            f"Embeddings: examples/s at {large:,} rows / at {small:,}",
            ["Optimizer", *plan["embedding_contenders"]],
            scaling,
            dict.fromkeys(plan["embedding_contenders"], "{:.2f}x"),
        ),
    ]
    cluster = [r for r in table if r["contender"] in on_cluster]
    if cluster:
        out.append(
            _table(
                f"Embeddings on a localhost cluster ({plan['embedding_cluster_workers']} workers, "
                f"{plan['embedding_cluster_ps']} ps, {plan['embedding_cluster_rows']:,} rows "
                "split over the ps tasks)",
                ["Optimizer", "Contender", "examples/s", "CPU s / 1k ex.", "KB sent / update"]
                + ["table shards"],
                [
                    {
                        "Optimizer": r["optimizer"],
                        "Contender": r["contender"],
                        "examples/s": r["examples_per_second"],
                        "CPU s / 1k ex.": r["cpu_seconds_per_1000_examples"],
                        "KB sent / update": r["bytes_sent_per_update"]
                        and r["bytes_sent_per_update"] / 1024,
                        "table shards": ", ".join(
                            f"{shape[0]:,} rows on {device.split('/device')[0]}"
                            for device, shape in r.get("table_shards") or []
                        ),
                    }
                    for r in cluster
                ],
                {
                    "examples/s": "{:,.0f}",
                    "CPU s / 1k ex.": "{:.3f}",
                    "KB sent / update": "{:,.0f}",
                },
                [f"{plan['embedding_batch_size']} examples in each update for both"],
            )
        )
    return out


def convergence_verdict(regime, floor, default, sync, none) -> tuple[str, bool | None]:
    """A row's verdict on the default rule, and whether it met its target
    (None when the row does not measure its regime)."""
    if default is None or sync is None:
        return "n/a", None
    staleness = default["mean_staleness"]["median"]
    if staleness is None or staleness < floor:
        return f"invalid: mean staleness {staleness or 0:.1f} < {floor:g}", None
    acc = default["final_accuracy"]
    worst = acc["min"] if acc["min"] is not None else acc["median"]
    references = [("sync", sync)] + ([("`none`", none)] if regime == "low" and none else [])
    short = [
        name
        for name, row in references
        if acc["median"] < row["final_accuracy"]["median"] - 0.01 + 1e-9
    ]
    if worst < COLLAPSED:
        short.append(f"a run at {worst:.3f}")
    return ("missed (" + ", ".join(short) + ")", False) if short else ("met", True)


def _accuracy_cell(row, staleness: bool = False) -> str | None:
    if row is None:
        return None
    text = cell(row["final_accuracy"], "{:.3f}")
    if row["final_accuracy"]["median"] is not None and row["final_accuracy"]["median"] < COLLAPSED:
        text = f"**{text}**"
    mean = row["mean_staleness"]["median"]
    if staleness and mean is not None:
        text += f" (s {mean:.1f} / {row['max_staleness']:.0f})"
    return text


def _convergence_tables(results) -> list[dict[str, Any]]:
    plan = results["plan"]
    rows, rules = results["convergence"], list(plan["convergence_rules"])
    devices = plan["convergence_devices"]
    names = [f"`{r}`" + (" (default)" if r == "auto" else "") for r in rules]
    out = []
    for regime, per_device, floor in plan["convergence_regimes"]:
        lines, verdicts = [], []
        for model, optimizer in plan["convergence_rows"]:
            key = {"model": model, "optimizer": optimizer}
            sync = _find(rows, regime="sync", rule=None, **key)
            found = {rule: _find(rows, regime=regime, rule=rule, **key) for rule in rules}
            default, none = found.get("auto"), found.get("none")
            verdict, ok = convergence_verdict(regime, floor, default, sync, none)
            verdicts.append(ok)
            line = {
                "Model": model,
                "Optimizer": workloads.convergence_optimizer_label(model, optimizer),
                "sync": _accuracy_cell(sync),
                **{n: _accuracy_cell(found[r], True) for n, r in zip(names, rules)},
                "target": verdict,
            }
            for column, reference in (("default − sync", sync), ("default − `none`", none)):
                if default and reference:
                    line[column] = 100 * (
                        default["final_accuracy"]["median"] - reference["final_accuracy"]["median"]
                    )
            lines.append(line)
        valid = [v for v in verdicts if v is not None]
        out.append(
            _table(
                f"Convergence, {regime} staleness: {devices * per_device} replicas ({devices} "
                f"devices x {per_device}); floor: mean staleness {floor:g}",
                ["Model", "Optimizer", "sync", *names, "default − sync", "default − `none`"]
                + ["target"],
                lines,
                {"default − sync": "{:+.1f}", "default − `none`": "{:+.1f}"},
                [
                    "target: the default's median within 1 point of sync"
                    + (" and of `none`" if regime == "low" else "")
                    + f", no run below {COLLAPSED}: met in {sum(valid)} of {len(valid)} valid "
                    f"rows; {len(verdicts) - len(valid)} rows invalid or missing",
                    f"digits, {plan['convergence_epochs']} epochs, median of "
                    f"{len(plan['convergence_seeds'])} seed(s); (s mean / max staleness)",
                ],
            )
        )
    return out


def tables(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every table of a results document, in the order of `results.md`."""
    chosen = set(results["plan"]["workloads"])
    out = [_run_table(results), _targets_table(results)]
    if chosen & {"throughput", "straggler", "accuracy"}:
        out.append(_calibration_table(results))
    if "throughput" in chosen:
        out.append(_throughput_table(results))
    if "straggler" in chosen:
        out.append(_straggler_table(results))
    if "accuracy" in chosen:
        out.append(_accuracy_table(results))
    if results["points"]:
        out.append(_points_table(results))
    if results["memory"]:
        out.append(_memory_table(results))
    if "control" in chosen:
        out.append(_control_table(results))
    if "cluster" in chosen:
        out.append(_cluster_table(results))
    if "fault_timeline" in chosen:
        out += _fault_tables(results)
    if "embeddings" in chosen:
        out += _embedding_tables(results)
    if "convergence" in chosen:
        out += _convergence_tables(results)
    if results["errors"]:
        columns = ["round", "contender", "replicas", "task", "error"]
        out.append(_table("Errors", columns, results["errors"]))
    return out


def markdown(results: dict[str, Any]) -> str:
    """`results.md`: every table, then the figures."""
    parts = ["# tf_diffmap benchmarks", ""] + [render(t) for t in results["tables"]]
    if results.get("figures"):
        parts += ["## Figures", ""] + [f"![{f}]({f})\n" for f in results["figures"]]
    return "\n".join(parts)
