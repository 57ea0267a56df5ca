"""The embedding workload's figures: rows of `results.json`, targets, a section.

The workload (`benchmarks.plan`, `benchmarks.worker.run_embeddings`) trains a
bag of ids, `workloads.EMBEDDING_MODEL`, with each optimizer and each table
size, under plain Keras on one device and tf_diffmap on several replicas. An
update touches at most `batch / replicas * 16` rows of the table, whatever
its size: what it costs should not grow with the table.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TARGETS", "rows", "targets", "section", "summary"]

# (key, description, comparison, threshold), as `benchmarks.report.TARGETS`.
TARGETS = (
    (
        "embedding_scaling",
        "Embeddings, SGD: tf_diffmap's examples/s at the largest table / at the smallest",
        ">=",
        0.8,
    ),
    (
        "embedding_vs_keras",
        "Embeddings, SGD, largest table: tf_diffmap / plain Keras examples/s",
        ">=",
        1.0,
    ),
    (
        "embedding_cluster",
        "Embeddings on a localhost cluster, the table split over the ps tasks: "
        "tf_diffmap / ParameterServerStrategy (tf-keras) examples/s, the worst over "
        "optimizers",
        ">=",
        1.0,
    ),
    (
        "embedding_accuracy",
        "Embeddings: best validation accuracy over the epochs, tf_diffmap minus "
        "plain Keras, the worst over optimizers and table sizes (points)",
        ">=",
        -1.0,
    ),
)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rows(runs) -> list[dict[str, Any]]:
    """Per contender, table size and optimizer: medians over the rounds."""
    grouped: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in runs:
        session = run["result"]
        for entry in session.get("tasks", []):
            task, result = entry["task"], entry["result"]
            if task["kind"] != "embeddings" or result.get("status") != "ok":
                continue
            key = (session["contender"], session["replicas"], task["rows"], task["optimizer"])
            grouped.setdefault(key, []).append((task, result))
    out = []
    for (contender, replicas, table_rows, optimizer), entries in grouped.items():
        results = [r for _, r in entries]
        staleness = [r.get("staleness") or {} for r in results]
        out.append(
            {
                "contender": contender,
                "replicas": replicas,
                "rows": table_rows,
                "optimizer": optimizer,
                "table_mb": results[0]["table_mb"],
                "runs": len(results),
                "examples_per_second": _median([r["examples_per_second"] for r in results]),
                "examples_per_second_values": [r["examples_per_second"] for r in results],
                "cpu_seconds_per_1000_examples": _median(
                    [r.get("cpu_seconds_per_1000_examples") for r in results]
                ),
                "val_accuracy": _median([r.get("val_accuracy") for r in results]),
                "best_val_accuracy": _median([r.get("best_val_accuracy") for r in results]),
                "examples_per_update": results[0].get("examples_per_update"),
                "bytes_sent_per_update": _median([r.get("bytes_sent_per_update") for r in results]),
                "table_shards": results[0].get("table_shards"),
                "mean_staleness": _median([s.get("overall_mean_staleness") for s in staleness]),
            }
        )
    return sorted(out, key=lambda r: (r["optimizer"], r["rows"], r["contender"]))


def _find(table, **match):
    return next((r for r in table if all(r[k] == v for k, v in match.items())), None)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _eps(table, contender, table_rows, optimizer="sgd"):
    row = _find(table, contender=contender, rows=table_rows, optimizer=optimizer)
    return row["examples_per_second"] if row else None


def targets(table, plan, target) -> list[dict[str, Any]]:
    """The embedding targets, made by `target(key, measured, note)`."""
    small, large = min(plan.embedding_rows), max(plan.embedding_rows)
    gaps = []
    for row in table:
        if row["contender"] != "tf_diffmap":
            continue
        same = _find(table, contender="plain_keras", rows=row["rows"], optimizer=row["optimizer"])
        if same and None not in (row["best_val_accuracy"], same["best_val_accuracy"]):
            gaps.append(100 * (row["best_val_accuracy"] - same["best_val_accuracy"]))
    replicas = plan.embedding_replicas
    cluster = [
        _ratio(
            _eps(table, "tf_diffmap_cluster", plan.embedding_cluster_rows, optimizer),
            _eps(table, "parameter_server", plan.embedding_cluster_rows, optimizer),
        )
        for optimizer in plan.embedding_cluster_optimizers
    ]
    cluster = [r for r in cluster if r is not None]
    out = [
        target(
            "embedding_scaling",
            _ratio(_eps(table, "tf_diffmap", large), _eps(table, "tf_diffmap", small)),
            note=f"{replicas} replicas, {large:,} rows / {small:,} rows",
        ),
        target(
            "embedding_vs_keras",
            _ratio(_eps(table, "tf_diffmap", large), _eps(table, "plain_keras", large)),
            note=f"{replicas} replicas / one device, {large:,} rows",
        ),
        target(
            "embedding_accuracy",
            min(gaps) if gaps else None,
            note=f"{plan.embedding_epochs} epochs each",
        ),
    ]
    if plan.embedding_cluster_rows is not None:
        out.insert(
            2,
            target(
                "embedding_cluster",
                min(cluster) if cluster else None,
                note=f"{plan.embedding_cluster_workers} workers, {plan.embedding_cluster_ps} ps, "
                f"{plan.embedding_cluster_rows:,} rows, "
                f"{plan.embedding_batch_size} examples per update",
            ),
        )
    return out


def _num(value, digits=0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def section(results) -> list[str]:
    """The Markdown section: one row per optimizer and table size."""
    plan = results["plan"]
    table = results.get("embeddings") or []
    small, large = min(plan["embedding_rows"]), max(plan["embedding_rows"])
    lines = [
        "## Embeddings: cost per update against table size",
        "",
        f"Bag of ids ({plan['embedding_examples_per_epoch']:,} examples an epoch, global batch "
        f"{plan['embedding_batch_size']}, {plan['embedding_epochs']} epochs, the first not "
        f"timed); plain Keras on one device, tf_diffmap on {plan['embedding_replicas']} "
        "replicas, whose lazy row updates are the default (`tf_diffmap.sparse`). Medians "
        "over the rounds; CPU is this process's, per 1,000 examples; validation "
        "accuracy after the last epoch and the best after any.",
        "",
        "| Optimizer | Rows (MB) | Contender | examples/s | CPU s / 1k ex. | "
        "val. accuracy (best) | mean staleness |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    cluster_contenders = plan.get("embedding_cluster_contenders", ())
    for row in table:
        if row["contender"] in cluster_contenders:
            continue
        lines.append(
            f"| {row['optimizer']} | {row['rows']:,} ({row['table_mb']:.1f}) | "
            f"{row['contender']} | "
            f"{_num(row['examples_per_second'])} | "
            f"{_num(row['cpu_seconds_per_1000_examples'], 3)} | "
            f"{_num(row['val_accuracy'], 3)} ({_num(row['best_val_accuracy'], 3)}) | "
            f"{_num(row['mean_staleness'], 2)} |"
        )
    lines += ["", f"Scaling, {large:,} rows / {small:,} rows (examples/s):", ""]
    for optimizer in plan["embedding_optimizers"]:
        cells = []
        for contender in plan["embedding_contenders"]:
            ratio = _ratio(
                _eps(table, contender, large, optimizer), _eps(table, contender, small, optimizer)
            )
            cells.append(f"{contender} {_num(ratio, 2)}x")
        lines.append(f"- {optimizer}: " + ", ".join(cells))
    lines.append("")
    cluster_rows = [r for r in table if r["contender"] in cluster_contenders]
    if cluster_rows:
        lines += [
            f"On a localhost cluster ({plan['embedding_cluster_workers']} workers, "
            f"{plan['embedding_cluster_ps']} ps tasks, the chief), "
            f"{plan['embedding_cluster_rows']:,} rows split over the ps tasks, "
            f"{plan['embedding_batch_size']} examples in each update (tf_diffmap: each "
            "worker's share of a global batch twice as large). CPU: every process of the "
            "cluster, per 1,000 examples; bytes: sent by all of them (the kernel's TCP "
            "counters), per update. ParameterServerStrategy trains SGD with tf-keras' "
            "legacy SGD, which updates rows.",
            "",
            "| Optimizer | Contender | examples/s | CPU s / 1k ex. | KB sent / update | "
            "table shards |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in cluster_rows:
            sent = row.get("bytes_sent_per_update")
            shards = ", ".join(
                f"{shape[0]:,} rows on {device.split('/device')[0]}"
                for device, shape in row.get("table_shards") or []
            )
            lines.append(
                f"| {row['optimizer']} | {row['contender']} | "
                f"{_num(row['examples_per_second'])} | "
                f"{_num(row['cpu_seconds_per_1000_examples'], 3)} | "
                f"{_num(None if sent is None else sent / 1024, 0)} | {shards} |"
            )
        lines.append("")
    return lines


def summary(results) -> list[str]:
    """Lines the suite prints."""
    out = []
    for row in results.get("embeddings") or []:
        out.append(
            f"embeddings: {row['optimizer']}, {row['rows']:,} rows, {row['contender']}: "
            f"{_num(row['examples_per_second'])} examples/s, val. accuracy "
            f"{_num(row['val_accuracy'], 3)} (best {_num(row['best_val_accuracy'], 3)}), "
            f"mean staleness {_num(row['mean_staleness'], 2)}"
        )
    return out
