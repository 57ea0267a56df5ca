"""PNG figures of a results document (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.contenders import CONTENDERS

__all__ = ["write_all"]

COLORS = {
    "plain_keras": "#7f7f7f",
    "mirrored": "#1f77b4",
    "tf_diffmap": "#d62728",
    "tf_diffmap_per_shard": "#9467bd",
    "tf_diffmap_fresh": "#e377c2",
    "tf_diffmap_fresh_fill": "#8c564b",
    "tf_diffmap_requeue": "#17becf",
    "tf_diffmap_async_windows": "#bcbd22",
    "tf_diffmap_bounded": "#ff7f0e",
    "central_storage": "#2ca02c",
}
# Time to accuracy: a color per contender, a line style per AsyncOptimizer rule
# (None: the contender's own step; tf_diffmap's default aggregates).
RULE_STYLES = {None: "-", "none": "-", "inverse": "--", "dc": "-.", "drop": ":"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _order(rows) -> list[str]:
    present = {r["contender"] for r in rows}
    return [c for c in CONTENDERS if c in present]


def _errors(spreads):
    low = [s["median"] - s["min"] if s["median"] is not None else 0 for s in spreads]
    high = [s["max"] - s["median"] if s["median"] is not None else 0 for s in spreads]
    return [low, high]


def _throughput(results, path: Path, plt) -> bool:
    rows = results["throughput"]
    if not rows:
        return False
    panels = list(dict.fromkeys((r["model"], r["input"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4), squeeze=False)
    for ax, (model, input_) in zip(axes[0], panels):
        mine = [r for r in rows if r["model"] == model and r["input"] == input_]
        counts = sorted({r["replicas"] for r in mine})
        names = _order(mine)
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, ys, spreads = [], [], []
            for j, n in enumerate(counts):
                row = next((r for r in mine if r["replicas"] == n and r["contender"] == name), None)
                if row and row["examples_per_second"]["median"] is not None:
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    ys.append(row["examples_per_second"]["median"])
                    spreads.append(row["examples_per_second"])
            if xs:
                ax.bar(
                    xs,
                    ys,
                    width,
                    yerr=_errors(spreads),
                    capsize=2,
                    color=COLORS[name],
                    label=next(r["label"] for r in mine if r["contender"] == name),
                )
        ax.set_xticks(range(len(counts)), [str(n) for n in counts])
        ax.set_xlabel("replicas (logical CPU devices)")
        ax.set_ylabel("examples / s (median, min–max)")
        source = "NumPy arrays to fit" if input_ == "numpy" else "tf.data, steps_per_epoch"
        ax.set_title(f"{model.upper()}, {source}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _straggler(results, path: Path, plt) -> bool:
    rows = results["straggler"]
    if not rows:
        return False
    counts = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        mine = [r for r in rows if r["replicas"] == n]
        for name in _order(mine):
            line = sorted((r for r in mine if r["contender"] == name), key=lambda r: r["slowdown"])
            ax.errorbar(
                [r["slowdown"] for r in line],
                [r["examples_per_second"]["median"] for r in line],
                yerr=_errors([r["examples_per_second"] for r in line]),
                marker="o",
                capsize=3,
                color=COLORS[name],
                label=line[0]["label"],
            )
        slowdowns = sorted({r["slowdown"] for r in mine})
        ax.set_xticks(slowdowns, [f"{k}x" for k in slowdowns])
        ax.set_xlabel("replica 0 slowdown k (it sleeps (k-1)·t per step)")
        ax.set_ylabel("examples / s (median, min–max)")
        ax.set_title(f"Straggler, {n} replicas, MLP")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _accuracy(results, path: Path, plt) -> bool:
    rows = results["accuracy"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        if not row["histories"]:
            continue
        # The run whose final training time is the median one.
        histories = sorted(row["histories"], key=lambda h: h[-1]["train_seconds"] if h else 0)
        history = histories[(len(histories) - 1) // 2]
        name = row["label"]
        if row["rule"] is not None:
            name += f", rule {row['rule']}"
        elif CONTENDERS[row["contender"]].asynchronous:
            name += ", default"
        name += ", straggler" if row["straggler"] else ", no straggler"
        ax.plot(
            [0.0] + [h["train_seconds"] for h in history],
            [None] + [h["val_accuracy"] for h in history],
            RULE_STYLES.get(row["rule"], "-"),
            marker="." if row["straggler"] else "x",
            color=COLORS[row["contender"]],
            alpha=1.0 if row["straggler"] else 0.5,
            label=name,
        )
    for target in results["plan"]["accuracy_targets"]:
        ax.axhline(target, color="black", linewidth=0.7, alpha=0.5)
    ax.set_ylim(0.85, 1.0)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Digits: time to accuracy (median run of each)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _memory(results, path: Path, plt) -> bool:
    rows = [r for r in results["memory"] if r["peak_rss_mb_mlp"] is not None]
    if not rows:
        return False
    counts = sorted({r["replicas"] for r in rows})
    names = _order(rows)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, n in enumerate(counts):
            row = next((r for r in rows if r["replicas"] == n and r["contender"] == name), None)
            if row:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(row["peak_rss_mb_mlp"])
        ax.bar(
            xs,
            ys,
            width,
            color=COLORS[name],
            label=next(r["label"] for r in rows if r["contender"] == name),
        )
    ax.set_xticks(range(len(counts)), [str(n) for n in counts])
    ax.set_xlabel("replicas")
    ax.set_ylabel("peak RSS, MiB (per process)")
    ax.set_title("Peak memory after the MLP throughput task")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# Processes of the fault timeline's CPU panel, bottom to top, and their colors.
PROCESS_COLORS = {"chief": "#d62728", "ps": "#9467bd", "worker": "#1f77b4", "other": "#bbbbbb"}


def _fault_timeline(results, path: Path, plt) -> bool:
    rows = results.get("fault_timeline") or []
    if not rows or not rows[0]["timelines"]:
        return False
    row = rows[0]
    timelines = row["timelines"]
    # The run whose outage share is the median one, drawn in full.
    ordered = sorted(timelines, key=lambda t: t["summary"].get("outage_share") or 0.0)
    median = ordered[(len(ordered) - 1) // 2]
    before = row["before_examples_per_second"]["median"]
    workers = row["workers"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9.5), sharex=True)
    events = [
        (row["kill_at"], f"worker {row['killed_worker']} killed", "black", "-"),
        (row["restart_at"], "restarted", "black", "--"),
    ]

    def mark(ax, timeline, labels):
        for x, text, color, style in events:
            ax.axvline(x, color=color, linestyle=style, linewidth=1, label=text if labels else None)
        for key, color, style, text in (
            ("rejoined", "#2ca02c", "-.", "rejoined"),
            ("serving", "#ff7f0e", ":", "new server serves"),
        ):
            x = timeline["events"].get(key)
            if x is not None:
                ax.axvline(
                    x, color=color, linestyle=style, linewidth=1.2, label=text if labels else None
                )

    def centers(timeline):
        return [s + 0.5 for s in timeline["start"]]

    ax = axes[0]
    for i, timeline in enumerate(timelines):
        main = timeline is median
        ax.plot(
            centers(timeline),
            timeline["examples_per_second"],
            color="#d62728" if main else "#d62728",
            alpha=1.0 if main else 0.3,
            linewidth=1.6 if main else 0.9,
            label="examples/s, median run"
            if main
            else ("other runs" if i == 0 or (i == 1 and timelines[0] is median) else None),
        )
    if before:
        ax.axhline(before, color="#555555", linewidth=0.8, label="rate before the kill")
        ax.axhline(
            before * (workers - 1) / workers,
            color="#555555",
            linestyle=":",
            linewidth=0.8,
            label=f"surviving workers' share ({workers - 1}/{workers})",
        )
    mark(ax, median, True)
    ax.set_ylabel("examples / s (1-s bins)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{workers} workers + ps + chief on one 2-core host: worker {row['killed_worker']} "
        f"killed at {row['kill_at']:g} s, restarted at {row['restart_at']:g} s",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[1]
    per_replica = list(zip(*median["replica_examples_per_second"]))
    for r, series in enumerate(per_replica):
        device = row["devices"][r]
        task = device.split("/task:")[1].split("/")[0] if "/task:" in device else str(r)
        ax.plot(centers(median), series, linewidth=1.2, label=f"worker {task}")
    mark(ax, median, False)
    ax.set_ylabel("examples / s per worker")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", ncol=workers)
    ax.grid(alpha=0.3)

    ax = axes[2]
    groups: dict[str, list[float]] = {}
    for cores in median["cpu_cores"]:
        for name in PROCESS_COLORS:
            groups.setdefault(name, [])
        totals = dict.fromkeys(PROCESS_COLORS, 0.0)
        for name, value in cores.items():
            if value is None or name == "host":
                continue
            kind = "other" if name.startswith("other") else name.split(" ")[0]
            totals[kind] = totals.get(kind, 0.0) + value
        for name in PROCESS_COLORS:
            groups[name].append(totals[name])
    ax.stackplot(
        centers(median),
        *[groups[n] for n in PROCESS_COLORS],
        labels=["chief", "ps", "workers", "rest of the host"],
        colors=list(PROCESS_COLORS.values()),
        alpha=0.85,
    )
    cpus = results.get("machine", {}).get("logical_cpus")
    if cpus:
        ax.axhline(cpus, color="black", linewidth=0.8)
    mark(ax, median, False)
    ax.set_ylabel("CPU cores in use")
    ax.set_xlabel("seconds of wall time since fit began")
    ax.legend(fontsize=7, loc="lower left", ncol=4)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Writes every figure the results allow; returns their file names."""
    plt = _pyplot()
    written = []
    for name, draw in (
        ("throughput.png", _throughput),
        ("straggler.png", _straggler),
        ("time_to_accuracy.png", _accuracy),
        ("memory.png", _memory),
        ("fault_timeline.png", _fault_timeline),
    ):
        if draw(results, Path(out_dir) / name, plt):
            written.append(name)
    return written
