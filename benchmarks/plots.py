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
    "tf_diffmap_bounded": "#ff7f0e",
    "central_storage": "#2ca02c",
}
RULE_STYLES = {None: "-", "none": "-", "inverse": "--", "dc": "-.", "drop": ":"}
RULE_COLORS = {"inverse": "#9467bd", "dc": "#8c564b", "drop": "#e377c2"}


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
        if row["rule"] is not None and row["contender"].startswith("tf_diffmap"):
            name += f", rule {row['rule']}"
        name += ", straggler" if row["straggler"] else ", no straggler"
        ax.plot(
            [0.0] + [h["train_seconds"] for h in history],
            [None] + [h["val_accuracy"] for h in history],
            RULE_STYLES.get(row["rule"], "-"),
            marker="." if row["straggler"] else "x",
            color=RULE_COLORS.get(row["rule"], COLORS[row["contender"]]),
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


def write_all(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Writes every figure the results allow; returns their file names."""
    plt = _pyplot()
    written = []
    for name, draw in (
        ("throughput.png", _throughput),
        ("straggler.png", _straggler),
        ("time_to_accuracy.png", _accuracy),
        ("memory.png", _memory),
    ):
        if draw(results, Path(out_dir) / name, plt):
            written.append(name)
    return written
