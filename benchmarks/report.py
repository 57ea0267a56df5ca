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


def _targets(text: str) -> dict[str, tuple[str, str, float, str]]:
    rows = (line.split(" | ") for line in text.strip().splitlines())
    return {key: (about, op, float(value), unit.strip('"')) for key, op, value, unit, about in rows}


# key | comparison | threshold | unit | description. `fault_outage`'s
# threshold is set from the plan: the surviving workers' share, (W - 1) / W.
TARGETS = _targets(
    """
overhead | >= | 1 | "x" | Overhead, 1 replica: tf_diffmap / plain Keras throughput
even_vs_mirrored | >= | 3 | "x" | Even replicas, 4 replicas: tf_diffmap / MirroredStrategy throughput
even_vs_central | >= | 1 | "x" | Even replicas, 4 replicas: tf_diffmap / CentralStorageStrategy (tf-keras) throughput
straggler_vs_mirrored | >= | 5 | "x" | Straggler (4 replicas, one 4x slower): tf_diffmap / MirroredStrategy throughput
straggler_retention | >= | 0.85 | "x" | Straggler (4 replicas, one 4x slower): tf_diffmap / its own no-straggler throughput
tta_vs_mirrored | <= | 0.5 | "x" | Time to 97% on digits with a straggler: tf_diffmap / MirroredStrategy
final_accuracy_gap | >= | -0.5 | " points" | Final accuracy on digits with a straggler: tf_diffmap minus MirroredStrategy, in points
aggregation_throughput | >= | 0.9 | "x" | Aggregation, 4 replicas: tf_diffmap (K = N) / tf_diffmap, a step per shard, throughput
aggregation_straggler | >= | 0.9 | "x" | Aggregation, straggler (4 replicas, one 4x slower): tf_diffmap (K = N) / tf_diffmap, a step per shard, throughput
control_spe16 | >= | 1 | "x" | Control path, steps_per_execution=16: tf_diffmap updates/s / plain Keras steps/s
control_spe1 | >= | 2.5 | "x" | Control path, steps_per_execution=1: tf_diffmap updates/s / plain Keras steps/s
cluster_vs_in_process | >= | 0.6 | "x" | Cluster: tf_diffmap on the localhost cluster / the same replicas in one process
cluster_vs_parameter_server | >= | 3 | "x" | Cluster: tf_diffmap / ParameterServerStrategy (tf-keras) on the same cluster shape
cluster_vs_parameter_server_per_update | >= | 3 | "x" | Cluster: tf_diffmap, each update on as many examples as a ParameterServerStrategy step (global batch x workers) / ParameterServerStrategy
fault_outage | >= | 0.667 | "x" | Fault timeline: examples/s while a worker is down / before it was killed
fault_after | >= | 0.95 | "x" | Fault timeline: examples/s after the restarted worker rejoined / before it was killed
embedding_scaling | >= | 0.8 | "x" | Embeddings, SGD: tf_diffmap's examples/s at the largest table / at the smallest
embedding_vs_keras | >= | 1 | "x" | Embeddings, SGD, largest table: tf_diffmap / plain Keras examples/s
embedding_cluster | >= | 1 | "x" | Embeddings on a localhost cluster, the table split over the ps tasks: tf_diffmap / ParameterServerStrategy (tf-keras) examples/s, the worst over optimizers
embedding_accuracy | >= | -1 | " pt" | Embeddings: best validation accuracy over the epochs, tf_diffmap minus plain Keras, the worst over optimizers and table sizes (points)
"""  # noqa: E501
)

# The tf_diffmap default K, which the control targets are read at.
DEFAULT_STEPS_PER_LOOP = 32
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


def _order(contender: str) -> int:
    return list(CONTENDERS).index(contender)


def _records(runs, kind: str):
    """Every successful task of `kind` as one flat record: the session's
    config and result, the task's result and the task, with the staleness
    figures and replica 0's share of the updates read out. A straggler task
    gives a record per window (per slowdown)."""
    for run in runs:
        session = run["result"]
        for entry in session.get("tasks", []):
            task, result = entry["task"], entry["result"]
            if task["kind"] != kind or result.get("status") != "ok":
                continue
            parts = result["windows"].items() if kind == "straggler" else [(None, result)]
            for slowdown, part in parts:
                stale, steps = part.get("staleness") or {}, part.get("replica_steps")
                yield {
                    "input": "dataset",
                    **run["config"],
                    **session,
                    **part,
                    **task,
                    "slowdown": None if slowdown is None else int(slowdown),
                    "mean_staleness": stale.get("overall_mean_staleness"),
                    "max_staleness": stale.get("overall_max_staleness"),
                    "updates": sum(stale.get("updates", [])),
                    "dropped": sum(stale.get("dropped", [])),
                    "replica0_share": steps[0] / sum(steps) if steps and sum(steps) else None,
                }


def _rows(records, by, spreads=(), medians=(), firsts=(), extra=None, max_staleness=None):
    """One row per value of the fields `by`: a spread of each of `spreads`,
    the median of each of `medians`, the first record's `firsts`, the
    largest `max_staleness`, and what `extra(records)` adds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[tuple(record.get(k) for k in by)].append(record)
    rows = []
    for key, group in groups.items():
        row = dict(zip(by, key))
        if "contender" in row:
            row["label"] = label(row["contender"], max_staleness)
        row.update({f: _spread(r.get(f) for r in group) for f in spreads})
        row.update({f: _median(r.get(f) for r in group) for f in medians})
        row.update({f: group[0].get(f) for f in firsts})
        row["max_staleness"] = max(
            (r["max_staleness"] for r in group if r["max_staleness"] is not None), default=None
        )
        row.update(extra(group) if extra else {})
        row["runs"] = len(group)
        rows.append(row)

    def order(row):
        return [(row[k] is None, _order(row[k]) if k == "contender" else row[k]) for k in by]

    return sorted(rows, key=order)


def _find(rows, /, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _rate(rows, field="examples_per_second", /, **match):
    """The median of `field` in the row that matches (None: no such row)."""
    row = _find(rows, **match)
    value = row and row[field]
    return value["median"] if isinstance(value, dict) else value


def _ratio(a, b):
    return a / b if a is not None and b else None


def _reached(values) -> float | None:
    """The median where a run that never reached the target counts as infinitely slow."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]
    return None if not middle or None in middle else sum(middle) / len(middle)


def _vs_per_shard(row, rows, where) -> float | None:
    """tf_diffmap's default row: its examples/s over those of a step per
    shard on the same workload (None for other contenders' rows)."""
    if row["contender"] != "tf_diffmap":
        return None
    per_shard = _rate(rows, contender="tf_diffmap_per_shard", **where)
    return _ratio(row["examples_per_second"]["median"], per_shard)


def _accuracy_extra(group) -> dict[str, Any]:
    targets = [str(t) for t in group[0]["targets"]]
    updates, dropped = sum(r["updates"] for r in group), sum(r["dropped"] for r in group)
    return {
        "seconds_to": {t: _reached([r["seconds_to"].get(t) for r in group]) for t in targets},
        "epochs_to": {t: _reached([r["epochs_to"].get(t) for r in group]) for t in targets},
        "reached": {t: sum(r["seconds_to"].get(t) is not None for r in group) for t in targets},
        "dropped_fraction": dropped / (updates + dropped)
        if group[0].get("staleness") and updates + dropped
        else None,
        "histories": [r["history"] for r in group],
    }


def _errors(runs) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        session, config = run["result"], run["config"]
        where = {"round": run["round"] + 1, "contender": config["contender"]}
        where["replicas"] = config["replicas"]
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


def _memory(runs, max_staleness) -> list[dict[str, Any]]:
    """Peak RSS per contender and device count: after the MLP throughput task
    (the session's first), and at the session's end."""
    records = []
    for run in runs:
        session = run["result"]
        kinds = {t["kind"] for t in run["config"]["tasks"]}
        if session.get("status") != "ok" or kinds <= {"control", "cluster", "fault_timeline"}:
            continue  # their own sessions, not the timed contenders' memory
        first = (session.get("tasks") or [None])[0]
        mlp = first and first["task"]["kind"] == "throughput" and first["task"]["model"] == "mlp"
        mlp = mlp and first["task"].get("input", "dataset") == "dataset"
        records.append(
            {
                "contender": session["contender"],
                "replicas": session["replicas"],
                "peak_rss_mb_mlp": first["result"].get("peak_rss_mb") if mlp else None,
                "peak_rss_mb_session": session.get("peak_rss_mb"),
                "max_staleness": None,
            }
        )
    medians = ("peak_rss_mb_mlp", "peak_rss_mb_session")
    return _rows(records, ("contender", "replicas"), medians=medians, max_staleness=max_staleness)


def _fault_timeline(runs) -> list[dict[str, Any]]:
    """Medians over the runs of each window's rate and each delay; every
    run's own series (per bin) in `timelines`, for the plot."""
    results = list(_records(runs, "fault_timeline"))
    if not results:
        return []
    first = results[0]
    summaries = [r["summary"] for r in results]
    lost = first["lost_replicas"]

    def window(name):
        found = [s["windows"][name] for s in summaries]
        rates = [
            w["replica_examples_per_second"] for w in found if w["replica_examples_per_second"]
        ]
        processes = list(dict.fromkeys(n for w in found for n in w["cpu_cores"]))
        return {
            "examples_per_second": _spread(w["examples_per_second"] for w in found),
            "min_examples_per_second": _spread(w["min_examples_per_second"] for w in found),
            "bin_cv": _median(w["bin_cv"] for w in found),
            "bins": _median(w["bins"] for w in found),
            "replica_examples_per_second": [
                _median(v[i] for v in rates) for i in range(len(rates[0]) if rates else 0)
            ],
            "cpu_cores": {n: _median(w["cpu_cores"].get(n) for w in found) for n in processes},
        }

    shares = ("before_examples_per_second", "outage_share", "restarting_share", "after_share")
    return [
        {
            "contender": "tf_diffmap_cluster",
            "label": label("tf_diffmap_cluster"),
            "workers": len(first["devices"]),
            **{
                k: first[k]
                for k in ("devices", "killed_worker", "lost_replicas", "input", "seconds")
                + ("kill_at", "restart_at")
            },
            "windows": {name: window(name) for name in FAULT_WINDOWS},
            **{k: _spread(s[k] for s in summaries) for k in shares},
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
                    **{
                        k: [b[k] for b in r["bins"]]
                        for k in (
                            "start",
                            "examples_per_second",
                            "replica_examples_per_second",
                            "cpu_cores",
                        )
                    },
                }
                for r in results
            ],
            "runs": len(results),
        }
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


def _all_targets(plan, results, tf_keras) -> list[dict[str, Any]]:
    """Every target of the workloads the plan ran."""
    chosen, out = plan.workloads, []
    tf_keras_missing = "" if tf_keras.get("available") else NO_TF_KERAS
    throughput, straggler = results["throughput"], results["straggler"]
    numpy = "mlp" in plan.models and bool(plan.numpy_input_replicas)
    inputs = [(m, "dataset") for m in plan.models] + [("mlp", "numpy")] * numpy
    for key, replicas, theirs in (
        ("overhead", 1, "plain_keras"),
        ("even_vs_mirrored", 4, "mirrored"),
        ("even_vs_central", 4, "central_storage"),
    ):
        for model, input_ in inputs if "throughput" in chosen else []:
            if key == "even_vs_central" and input_ == "numpy":
                continue
            kind = workloads.MODELS[model]["description"].split(" ")[0]
            where = {"model": model, "input": input_, "replicas": replicas}
            out.append(
                _target(
                    key,
                    _ratio(
                        _rate(throughput, contender="tf_diffmap", **where),
                        _rate(throughput, contender=theirs, **where),
                    ),
                    suffix=f" ({kind}, NumPy arrays to fit)" if input_ == "numpy" else f" ({kind})",
                    note="Keras 3 rebuilds MirroredStrategy's distributed iterator every epoch"
                    if key == "even_vs_mirrored" and input_ == "numpy"
                    else "",
                    missing=tf_keras_missing if key == "even_vs_central" else "",
                )
            )
    if "straggler" in chosen:
        slowed = _rate(straggler, contender="tf_diffmap", replicas=4, slowdown=4)
        mirrored = _rate(straggler, contender="mirrored", replicas=4, slowdown=4)
        out.append(_target("straggler_vs_mirrored", _ratio(slowed, mirrored)))
        out.append(
            _target(
                "straggler_retention",
                _ratio(slowed, _rate(straggler, contender="tf_diffmap", replicas=4, slowdown=1)),
                note="no-straggler reference: the same model and delay layer with a 0 s delay",
            )
        )
    if "tf_diffmap_per_shard" in plan.contenders:
        out += _aggregation_targets(plan, throughput, straggler, inputs)
    if "accuracy" in chosen:
        out += _accuracy_targets(plan, results["accuracy"])
    if "control" in chosen:
        for key, spe in (("control_spe16", 16), ("control_spe1", 1)):
            where = {"steps_per_execution": spe}
            ours = _rate(
                results["control"],
                "updates_per_second",
                contender="tf_diffmap",
                steps_per_loop=DEFAULT_STEPS_PER_LOOP,
                **where,
            )
            keras = _rate(results["control"], "steps_per_second", contender="plain_keras", **where)
            note = f"tf_diffmap at its default steps_per_loop={DEFAULT_STEPS_PER_LOOP}"
            out.append(_target(key, _ratio(ours, keras), note=note))
    if "cluster" in chosen:
        batch, rows = plan.cluster_batch_size, results["cluster"]
        per_update = batch * plan.cluster_workers
        ours = _rate(rows, contender="tf_diffmap_cluster", batch_size=batch)
        pss = _rate(rows, contender="parameter_server", batch_size=batch)
        in_process = _rate(rows, contender="tf_diffmap", batch_size=batch)
        out += [
            _target("cluster_vs_in_process", _ratio(ours, in_process)),
            _target("cluster_vs_parameter_server", _ratio(ours, pss), missing=tf_keras_missing),
            _target(
                "cluster_vs_parameter_server_per_update",
                _ratio(_rate(rows, contender="tf_diffmap_cluster", batch_size=per_update), pss),
                note=f"tf_diffmap at global batch {per_update}, ParameterServerStrategy at {batch}",
                missing=tf_keras_missing,
            ),
        ]
    if "fault_timeline" in chosen:
        out += _fault_targets(plan, results["fault_timeline"])
    if "embeddings" in chosen:
        out += _embedding_targets(plan, results["embeddings"], tf_keras_missing)
    return out


def _aggregation_targets(plan, throughput, straggler, inputs) -> list[dict[str, Any]]:
    """tf_diffmap's default (K = N shard gradients a step) against a step per
    shard, on the throughput rows at 4 replicas and the straggler's at k=4."""
    out = []
    note = "the same run, the contenders alternating"
    if "throughput" in plan.workloads:
        for model, input_ in inputs:
            kind = workloads.MODELS[model]["description"].split(" ")[0]
            suffix = f" ({kind}, NumPy arrays to fit)" if input_ == "numpy" else f" ({kind})"
            row = _find(throughput, contender="tf_diffmap", model=model, input=input_, replicas=4)
            measured = row and row["vs_per_shard"]
            out.append(_target("aggregation_throughput", measured, note=note, suffix=suffix))
    if "straggler" in plan.workloads:
        row = _find(straggler, contender="tf_diffmap", replicas=4, slowdown=4)
        out.append(_target("aggregation_straggler", row and row["vs_per_shard"], note=note))
    return out


def _accuracy_targets(plan, rows) -> list[dict[str, Any]]:
    ours = _find(rows, contender="tf_diffmap", rule=None, straggler=True)
    theirs = _find(rows, contender="mirrored", rule=None, straggler=True)
    top = str(max(plan.accuracy_targets))
    note = "tf_diffmap's default: one optimizer step per K = N shard gradients"
    if ours and theirs and theirs["seconds_to"].get(top) is None:
        note = (
            f"MirroredStrategy did not reach {float(top):.0%} within {theirs['epochs']} epochs "
            "in most runs"
        )
    elif ours and theirs and ours["seconds_to"].get(top) is None:
        note = f"tf_diffmap did not reach {float(top):.0%} in most runs"
    ratio = _ratio(ours and ours["seconds_to"].get(top), theirs and theirs["seconds_to"].get(top))
    accuracies = [r and r["final_accuracy"]["median"] for r in (ours, theirs)]
    gap = None if None in accuracies else 100 * (accuracies[0] - accuracies[1])
    return [
        _target("tta_vs_mirrored", ratio, note=note),
        _target(
            "final_accuracy_gap",
            gap,
            note="read as: not more than half a point below MirroredStrategy",
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


def _embedding_targets(plan, table, tf_keras_missing) -> list[dict[str, Any]]:
    small, large = min(plan.embedding_rows), max(plan.embedding_rows)
    ours = _rate(table, contender="tf_diffmap", rows=large, optimizer="sgd")
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
            _ratio(ours, _rate(table, contender="tf_diffmap", rows=small, optimizer="sgd")),
            note=f"{replicas} replicas, {large:,} rows / {small:,} rows",
        ),
        _target(
            "embedding_vs_keras",
            _ratio(ours, _rate(table, contender="plain_keras", rows=large, optimizer="sgd")),
            note=f"{replicas} replicas / one device, {large:,} rows",
        ),
        _target(
            "embedding_accuracy",
            min(gaps, default=None),
            note=f"{plan.embedding_epochs} epochs each",
        ),
    ]
    rows = plan.embedding_cluster_rows
    if rows is not None:
        ratios = [
            _ratio(
                _rate(table, contender="tf_diffmap_cluster", rows=rows, optimizer=o),
                _rate(table, contender="parameter_server", rows=rows, optimizer=o),
            )
            for o in plan.embedding_cluster_optimizers
        ]
        ratios = [r for r in ratios if r is not None]
        note = (
            f"{plan.embedding_cluster_workers} workers, {plan.embedding_cluster_ps} ps, "
            f"{rows:,} rows, {plan.embedding_batch_size} examples per update"
        )
        cluster = _target(
            "embedding_cluster", min(ratios, default=None), note, missing=tf_keras_missing
        )
        out.insert(2, cluster)
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
        for run in runs:
            if run["result"].get("status") == "ok":
                if CONTENDERS[run["config"]["contender"]].legacy == legacy:
                    return run["result"].get(key)
        return None

    bounded = plan.max_staleness
    straggler = _rows(
        _records(runs, "straggler"),
        ("replicas", "contender", "slowdown"),
        spreads=("examples_per_second", "median_epoch_seconds"),
        medians=("delay_seconds", "replica0_share", "mean_staleness"),
        max_staleness=bounded,
    )
    for row in straggler:
        where = {"replicas": row["replicas"], "slowdown": row["slowdown"]}
        base = _rate(straggler, replicas=row["replicas"], contender=row["contender"], slowdown=1)
        row["retention"] = _ratio(row["examples_per_second"]["median"], base)
        row["vs_per_shard"] = _vs_per_shard(row, straggler, where)
    throughput = _rows(
        _records(runs, "throughput"),
        ("model", "input", "replicas", "contender"),
        spreads=("examples_per_second",),
        medians=("median_epoch_seconds", "warmup_seconds", "mean_staleness"),
        max_staleness=bounded,
    )
    for row in throughput:
        where = {k: row[k] for k in ("model", "input", "replicas")}
        mirrored = _rate(throughput, contender="mirrored", **where)
        row["vs_mirrored"] = _ratio(row["examples_per_second"]["median"], mirrored)
        row["vs_per_shard"] = _vs_per_shard(row, throughput, where)
    accuracy = _rows(
        _records(runs, "accuracy"),
        ("contender", "replicas", "rule", "straggler"),
        spreads=("final_accuracy",),
        medians=("best_accuracy", "train_seconds", "mean_staleness", "replica0_share"),
        firsts=("drop_above", "delay", "epochs"),
        extra=_accuracy_extra,
        max_staleness=bounded,
    )
    rules = {None: 0, "none": 1, "inverse": 2, "dc": 3, "drop": 4}  # in the table's order
    accuracy.sort(key=lambda r: (not r["straggler"], _order(r["contender"]), rules.get(r["rule"])))
    cluster = _rows(
        _records(runs, "cluster"),
        ("contender", "batch_size"),
        spreads=("examples_per_second", "median_replica_ms_per_update", "cpu_ms_per_update")
        + ("cpu_ms_per_1000_examples",),
        medians=("median_epoch_seconds", "mean_staleness", "warmup_seconds"),
        firsts=("devices", "replica_time_source", "cpu_processes"),
    )
    for row in cluster:
        name = "tf_diffmap, one process" if row["contender"] == "tf_diffmap" else row["label"]
        row["label"] = f"{name}, batch {row['batch_size']}"
    points = _rows(
        _records(runs, "points"),
        ("replicas",),
        spreads=("ms_per_batch", "point_cpu_ms_median", "point_cpu_ms_p90")
        + ("snapshots_overhead", "every_point_overhead", "budget_overhead"),
        firsts=("batches_per_fit",),
        extra=lambda group: {
            "points_per_run": [r["points"] for r in group],
            "budget_points": _spread(p for r in group for p in r["budget_points"]),
        },
    )
    control = _rows(
        _records(runs, "control"),
        ("contender", "steps_per_loop", "steps_per_execution"),
        spreads=("steps_per_second", "updates_per_second", "cpu_us_per_update"),
        medians=("mean_staleness",),
        firsts=("updates_per_step",),
        extra=lambda group: {
            "updates_counted": [r.get("updates_counted") for r in group],
            "updates_expected": [r.get("updates_expected") for r in group],
        },
    )
    control.sort(
        key=lambda r: (
            _order(r["contender"]),
            -(r["steps_per_loop"] or 0),
            -r["steps_per_execution"],
        )
    )
    embeddings = _rows(
        _records(runs, "embeddings"),
        ("optimizer", "rows", "contender", "replicas"),
        medians=("examples_per_second", "cpu_seconds_per_1000_examples", "val_accuracy")
        + ("best_val_accuracy", "bytes_sent_per_update", "mean_staleness"),
        firsts=("table_mb", "examples_per_update", "table_shards"),
    )
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
        "memory": _memory(runs, bounded),
        "points": points,
        "control": control,
        "cluster": cluster,
        "fault_timeline": _fault_timeline(runs),
        "embeddings": embeddings,
        "errors": _errors(runs),
        "sessions": runs,
    }
    results["targets"] = _all_targets(plan, results, tf_keras)
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


def _layout(title, rows, spec, notes=()) -> dict[str, Any]:
    """A table of `rows` (the results' own) laid out by `spec`: one
    `(column, field, format)` per column, the format None for the default."""
    columns = [c for c, _, _ in spec]
    cells = [{c: r.get(f) for c, f, _ in spec} for r in rows]
    return _table(title, columns, cells, {c: p for c, _, p in spec if p}, notes)


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
    if isinstance(value, list):
        return ", ".join(cell(v, pattern) for v in value)
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


EPS, RATIO, SHARE = "{:,.0f}", "{:.2f}x", "{:.1%}"
THROUGHPUT = [
    ("Model", "model", None),
    ("Input", "input", None),
    ("Replicas", "replicas", None),
    ("Contender", "label", None),
    ("examples/s", "examples_per_second", EPS),
    ("/ MirroredStrategy", "vs_mirrored", RATIO),
    ("/ a step per shard", "vs_per_shard", RATIO),
]
STRAGGLER = [
    ("Replicas", "replicas", None),
    ("Contender", "label", None),
    ("k", "slowdown", None),
    ("delay, s", "delay_seconds", "{:.4f}"),
    ("examples/s", "examples_per_second", EPS),
    ("s/epoch", "median_epoch_seconds", "{:.2f}"),
    ("kept (of k=1)", "retention", "{:.0%}"),
    ("/ a step per shard", "vs_per_shard", RATIO),
    ("replica 0 share", "replica0_share", SHARE),
]
POINTS = [
    ("Replicas", "replicas", None),
    ("CPU per point, ms", "point_cpu_ms_median", "{:.3f}"),
    ("p90, ms", "point_cpu_ms_p90", "{:.3f}"),
    ("batch, ms", "ms_per_batch", "{:.1f}"),
    ("fit, snapshots only", "snapshots_overhead", "{:+.1%}"),
    ("fit, every point", "every_point_overhead", "{:+.1%}"),
    ("fit, default budget", "budget_overhead", "{:+.1%}"),
    ("points at the default budget", "budget_points", "{:,.0f}"),
    ("batches per fit", "batches_per_fit", None),
]
MEMORY = [
    ("Contender", "label", None),
    ("Replicas", "replicas", None),
    ("after the MLP throughput task", "peak_rss_mb_mlp", EPS),
    ("whole session", "peak_rss_mb_session", EPS),
]
CONTROL = [
    ("Contender", "label", None),
    ("steps_per_loop", "steps_per_loop", None),
    ("steps_per_execution", "steps_per_execution", None),
    ("updates per step", "updates_per_step", None),
    ("updates/s", "updates_per_second", EPS),
    ("CPU µs per update", "cpu_us_per_update", EPS),
]
CLUSTER = [
    ("Contender", "label", None),
    ("devices", "devices", None),
    ("examples/s", "examples_per_second", EPS),
    ("replica ms per update", "median_replica_ms_per_update", "{:.2f}"),
    ("replica time from", "replica_time_source", None),
    ("CPU ms per update", "cpu_ms_per_update", "{:.2f}"),
    ("CPU ms per 1,000 examples", "cpu_ms_per_1000_examples", "{:.2f}"),
    ("processes", "cpu_processes", None),
    ("mean staleness", "mean_staleness", "{:.2f}"),
]
EMBEDDINGS = [
    ("Optimizer", "optimizer", None),
    ("Rows", "rows", None),
    ("MB", "table_mb", "{:.1f}"),
    ("Contender", "contender", None),
    ("examples/s", "examples_per_second", EPS),
    ("CPU s / 1k ex.", "cpu_seconds_per_1000_examples", "{:.3f}"),
    ("val. accuracy", "val_accuracy", "{:.3f}"),
    ("best val. accuracy", "best_val_accuracy", "{:.3f}"),
    ("mean staleness", "mean_staleness", "{:.2f}"),
]
EMBEDDINGS_CLUSTER = [
    ("Optimizer", "optimizer", None),
    ("Contender", "contender", None),
    ("examples/s", "examples_per_second", EPS),
    ("CPU s / 1k ex.", "cpu_seconds_per_1000_examples", "{:.3f}"),
    ("KB sent / update", "kb_sent_per_update", EPS),
    ("table shards", "shards", None),
]


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


def _run_table(results) -> dict[str, Any]:
    plan, machine, versions = results["plan"], results["machine"], results["versions"]
    tf_keras = results["tf_keras"]

    def load(values):
        return "/".join(f"{v:.1f}" for v in values) if values else "–"

    devices = f"logical CPU devices of one {machine.get('logical_cpus')}-CPU host"
    if machine.get("device") == "gpu":
        devices = (
            f"GPUs ({machine.get('gpus')}: one per replica, or logical GPUs of "
            f"{machine.get('gpu_memory_mb')} MiB of GPU 0 when fewer than the replicas)"
        )
    rows = {
        "run": f"{results['created']}, preset `{plan['name']}`, {plan['repeats']} repeat(s), "
        f"{results['seconds'] / 60:.1f} min",
        "command": f"`{results['command']}`",
        "machine": f"{machine.get('cpu')}, {machine.get('logical_cpus')} logical CPUs, "
        f"{machine.get('memory_gib')} GiB, {machine.get('platform')}",
        "load average, start; end": f"{load(machine.get('load_average_start'))}; "
        f"{load(machine.get('load_average_end'))}",
        "replicas": devices,
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
        rows["global batch, Adam's learning rate"] = (
            f"{plan['batch_size']}, {plan['learning_rate']:g}"
        )
        rows["timed window"] = (
            f"≥ {plan['min_epochs']} epochs and ≥ {plan['min_seconds']:g} s after a warm-up fit"
        )
        rows["examples per epoch"] = ", ".join(
            f"{n:,} ({m.upper()})"
            for m, n in plan["examples_per_epoch"].items()
            if m in plan["models"] or m == plan["straggler_model"]
        )
    for replicas, entry in results["calibration"].items():
        delays = ", ".join(
            f"k={k}: {1000 * d:.1f} ms"
            for k, d in (entry.get("delays") or {}).items()
            if int(k) > 1
        )
        rows[f"straggler t, {replicas} replicas"] = (
            f"{1000 * entry['step_seconds']:.1f} ms ({delays}; {entry['source']})"
            if "step_seconds" in entry
            else f"not calibrated: {entry.get('error')}"
        )
    return _table(
        "Run", ["Setting", "Value"], [{"Setting": k, "Value": v} for k, v in rows.items()]
    )


def _accuracy_table(results) -> dict[str, Any]:
    rows = results["accuracy"]
    targets = list(rows[0]["seconds_to"]) if rows else []
    shown = []
    for r in rows:
        row = {
            **r,
            "rule": _rule_label(r),
            "straggler": f"replica 0 ×{results['plan']['accuracy_slowdown']}"
            if r["straggler"]
            else "none",
        }
        for t in targets:
            seconds, reached = r["seconds_to"][t], f"{r['reached'][t]}/{r['runs']}"
            row[f"s_{t}"] = seconds if seconds is not None else f"not reached ({reached} runs did)"
            row[f"epochs_{t}"] = r["epochs_to"][t]
        shown.append(row)
    spec = [("Contender", "label", None), ("Replicas", "replicas", None)]
    spec += [("Rule", "rule", None), ("Straggler", "straggler", None)]
    spec += [(f"s to {float(t):.0%}", f"s_{t}", "{:.2f}") for t in targets]
    spec += [(f"epochs to {float(t):.0%}", f"epochs_{t}", "{:.0f}") for t in targets[-1:]]
    spec += [
        ("final accuracy", "final_accuracy", "{:.4f}"),
        ("mean staleness", "mean_staleness", "{:.2f}"),
        ("max staleness", "max_staleness", None),
        ("dropped", "dropped_fraction", SHARE),
        ("replica 0 share", "replica0_share", SHARE),
        ("train s", "train_seconds", "{:.1f}"),
    ]
    title = f"Time to accuracy (digits, {results['plan']['accuracy_epochs']} epochs)"
    return _layout(title, shown, spec)


def _rule_label(row) -> str | None:
    """A time-to-accuracy row's rule: "default" for tf_diffmap's own step
    (the plain optimizer), "drop (> n)", or the `AsyncOptimizer` rule."""
    if row["rule"] is None:
        return "default" if CONTENDERS[row["contender"]].asynchronous else None
    if row["rule"] == "drop":
        return f"drop (> {row['drop_above']})"
    return row["rule"]


def _short(device: str) -> str:
    """`/job:worker/replica:0/task:1/device:CPU:0` as `worker 1 CPU:0`."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    where = f"{parts['job']} {parts.get('task', 0)} " if "job" in parts else ""
    return where + parts.get("device", device)


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
    spans = {
        "before": f"{plan['fault_warmup_seconds']:g} s to the kill",
        "outage": "kill to restart",
        "restarting": "restart to rejoin",
        "after": f"{plan['fault_settle_seconds']:g} s after the rejoin to the end",
    }
    windows = [
        {
            "Window": f"{name} ({spans[name]})",
            "examples/s": w["examples_per_second"],
            "of the rate before": row.get(f"{name}_share"),
            "slowest bin": w["min_examples_per_second"],
            "per worker, examples/s": " / ".join(
                cell(v, EPS) for v in w["replica_examples_per_second"]
            ),
            "CPU cores per process": ", ".join(
                f"{n} {cell(v, '{:.2f}')}" for n, v in w["cpu_cores"].items() if n != "host"
            ),
        }
        for name, w in row["windows"].items()
    ]
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
    setting = (
        f"{workloads.MODELS[plan['cluster_model']]['description']}, global batch "
        f"{plan['cluster_batch_size']}, input: {source}; fit of {plan['fault_seconds']:g} s, "
        f"kill at {plan['fault_kill_at']:g} s, restart at {plan['fault_restart_at']:g} s; "
        f"{plan['fault_bin_seconds']:g}-s bins; {runs} run(s)"
    )
    window_columns = list(windows[0])
    formats = {"examples/s": EPS, "of the rate before": RATIO, "slowest bin": EPS}
    return [
        _table(title, window_columns, windows, formats, [setting]),
        _table(
            "Fault timeline: the worker's return",
            ["What", "Value"],
            facts,
            {"Value": "{:.2f}"},
            notes,
        ),
    ]


def _embedding_tables(results) -> list[dict[str, Any]]:
    plan, rows = results["plan"], results["embeddings"]
    on_cluster = plan.get("embedding_cluster_contenders", ())
    small, large = min(plan["embedding_rows"]), max(plan["embedding_rows"])
    scaling = [
        {
            "Optimizer": o,
            **{
                c: _ratio(
                    _rate(rows, contender=c, rows=large, optimizer=o),
                    _rate(rows, contender=c, rows=small, optimizer=o),
                )
                for c in plan["embedding_contenders"]
            },
        }
        for o in plan["embedding_optimizers"]
    ]
    cluster = [
        {
            **r,
            "kb_sent_per_update": r["bytes_sent_per_update"] and r["bytes_sent_per_update"] / 1024,
            "shards": ", ".join(
                f"{shape[0]:,} rows on {device.split('/device')[0]}"
                for device, shape in r["table_shards"] or []
            ),
        }
        for r in rows
        if r["contender"] in on_cluster
    ]
    setting = (
        f"{plan['embedding_replicas']} replicas for tf_diffmap, batch "
        f"{plan['embedding_batch_size']}, {plan['embedding_examples_per_epoch']:,} examples an "
        f"epoch, {plan['embedding_epochs']} epochs (the first not timed)"
    )
    out = [
        _layout(
            "Embeddings: cost per update against table size",
            [r for r in rows if r["contender"] not in on_cluster],
            EMBEDDINGS,
            [setting],
        ),
        _table(
            f"Embeddings: examples/s at {large:,} rows / at {small:,}",
            ["Optimizer", *plan["embedding_contenders"]],
            scaling,
            dict.fromkeys(plan["embedding_contenders"], RATIO),
        ),
    ]
    if cluster:
        title = (
            f"Embeddings on a localhost cluster ({plan['embedding_cluster_workers']} workers, "
            f"{plan['embedding_cluster_ps']} ps, {plan['embedding_cluster_rows']:,} rows split "
            "over the ps tasks)"
        )
        each = f"{plan['embedding_batch_size']} examples in each update for both"
        out.append(_layout(title, cluster, EMBEDDINGS_CLUSTER, [each]))
    return out


def tables(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every table of a results document, in the order of `results.md`."""
    plan = results["plan"]
    chosen = set(plan["workloads"])
    out = [_run_table(results), _targets_table(results)]
    # The column of tf_diffmap's default over a step per shard, where both ran.
    spec = {"throughput": THROUGHPUT, "straggler": STRAGGLER}
    if "tf_diffmap_per_shard" not in plan["contenders"]:
        spec = {k: [c for c in v if c[1] != "vs_per_shard"] for k, v in spec.items()}
    if "throughput" in chosen:
        title = "Throughput (examples/s, no straggler)"
        out.append(_layout(title, results["throughput"], spec["throughput"]))
    if "straggler" in chosen:
        title = "Straggler: replica 0 k times slower"
        out.append(_layout(title, results["straggler"], spec["straggler"]))
    if "accuracy" in chosen:
        out.append(_accuracy_table(results))
    if results["points"]:
        note = (
            f"digits, MLP, batch {plan['points_batch_size']}, {plan['points_epochs']} epoch(s) "
            f"per fit, {plan['points_rounds']} round(s); fit: median time against no callback"
        )
        title = 'Staleness points (`StalenessTensorBoard(update_freq="batch")`)'
        out.append(_layout(title, results["points"], POINTS, [note]))
    if results["memory"]:
        out.append(_layout("Peak memory (RSS, MiB, per process)", results["memory"], MEMORY))
    if "control" in chosen:
        note = (
            f"{workloads.CONTROL_MODEL['description']} {plan['control_learning_rate']:g}, global "
            f"batch {plan['control_batch_size']}, {plan['control_steps_per_epoch']} steps an epoch"
        )
        title = "Control path (updates/s; plain Keras: steps/s)"
        out.append(_layout(title, results["control"], CONTROL, [note]))
    if "cluster" in chosen:
        notes = [
            f"{workloads.MODELS[plan['cluster_model']]['description']}, Adam "
            f"{plan['learning_rate']:g}, {plan['cluster_examples_per_epoch']:,} examples an epoch",
            "every server ran on the host's CPUs, not on the GPUs --device names"
            if results["machine"].get("device") == "gpu"
            else "",
        ]
        title = (
            f"Cluster: {plan['cluster_workers']} workers + {plan['cluster_ps']} ps + chief on "
            "localhost"
        )
        rows = [{**r, "devices": ", ".join(map(_short, r["devices"]))} for r in results["cluster"]]
        out.append(_layout(title, rows, CLUSTER, notes))
    if "fault_timeline" in chosen:
        out += _fault_tables(results)
    if "embeddings" in chosen:
        out += _embedding_tables(results)
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
