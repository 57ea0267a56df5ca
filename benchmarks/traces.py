"""Profiles of a few training steps, read back: ops per task and a timeline.

`trace_tasks` records TensorFlow's profiler on this process
(`tf.profiler.experimental.start`/`stop`) and, at once, on each remote task
of a cluster (`tf.profiler.experimental.client.trace` to the task's own
server, which serves TensorFlow's profiler service). `op_summary` reads the
kernels out of the events (an op's event is named `node:OpType`), and
`draw_timeline` renders a span of them, one row per thread that ran an op.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["draw_timeline", "op_summary", "read_events", "sends", "trace_tasks"]

# A kernel's event: `node name:OpType` (a node's name holds no colon); the
# gRPC services' own events (`EagerService:Enqueue`) are not kernels.
_OP = re.compile(r"[^\s:]+:(_?[A-Z][A-Za-z0-9_]*)")
_NOT_KERNELS = ("EagerService:", "WorkerService:")
# How long a remote trace waits for the traced window to begin.
_LEAD_SECONDS = 1.0


def op_type(name: str) -> str | None:
    """The op type of a kernel's event name, else None."""
    match = _OP.fullmatch(name)
    return match.group(1) if match and not name.startswith(_NOT_KERNELS) else None


def trace_tasks(run, logdir: Path, remote: dict[str, str], seconds: float) -> tuple[int, int]:
    """Profiles `run()` here and on each remote task; returns when it
    started and ended (ns since the epoch, as the events' times are).

    Args:
        run: what to profile (a few steps of `fit`).
        logdir: where each task's profile goes (`logdir/<task>/...`).
        remote: task name to `host:port` of its server.
        seconds: how long the remote traces last (at least `run`'s time).

    Raises:
        RuntimeError: a remote trace failed (with the task and its error).
    """
    import tensorflow as tf

    errors: dict[str, BaseException] = {}

    def trace(task: str, address: str) -> None:
        try:
            tf.profiler.experimental.client.trace(
                f"grpc://{address}", str(logdir / task.replace(" ", "_")), int(seconds * 1000)
            )
        except Exception as error:  # reported below, with its task
            errors[task] = error

    threads = [threading.Thread(target=trace, args=item, daemon=True) for item in remote.items()]
    for thread in threads:
        thread.start()
    if threads:
        time.sleep(_LEAD_SECONDS)
    tf.profiler.experimental.start(str(logdir / "chief"))
    start = time.time_ns()
    try:
        run()
    finally:
        end = time.time_ns()
        tf.profiler.experimental.stop()
        for thread in threads:
            thread.join()
    if errors:
        raise RuntimeError(
            "Remote traces failed: " + "; ".join(f"{t}: {e!r}" for t, e in errors.items())
        )
    return start, end


def read_events(logdir: Path) -> dict[str, list]:
    """Each task's profile events (`tf_diffmap._tf_internal.ProfileEvent`),
    by the folder `trace_tasks` wrote it to.

    Raises:
        FileNotFoundError: a task's folder holds no profile.
    """
    from tf_diffmap._tf_internal import profile_events

    out = {}
    for folder in sorted(p for p in logdir.iterdir() if p.is_dir()):
        files = sorted(folder.glob("plugins/profile/*/*.xplane.pb"))
        if not files:
            raise FileNotFoundError(f"No profile (*.xplane.pb) under {folder}.")
        out[folder.name.replace("_", " ")] = [e for f in files for e in profile_events(f)]
    return out


def op_summary(events, start_ns: int, end_ns: int, steps: int) -> dict[str, Any]:
    """The kernels run between `start_ns` and `end_ns`, per step.

    Returns:
        `{"ops": n, "op_ms": ms, "by_type": {type: {"ops": n, "ms": ms}}}`,
        each divided by `steps`.
    """
    by_type: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        kind = op_type(event.name)
        if kind is None or not start_ns <= event.start_ns <= end_ns:
            continue
        by_type[kind][0] += 1
        by_type[kind][1] += event.duration_ns / 1e6
    return {
        "ops": sum(n for n, _ in by_type.values()) / steps,
        "op_ms": sum(ms for _, ms in by_type.values()) / steps,
        "by_type": {
            k: {"ops": n / steps, "ms": ms / steps}
            for k, (n, ms) in sorted(by_type.items(), key=lambda kv: -kv[1][1])
        },
    }


def sends(events, start_ns: int, end_ns: int, steps: int) -> dict[str, float]:
    """What a task sent to another one between two times, per step: its
    `_Send` kernels by node name, shortened to the scopes that tell them
    apart (the loop's and the step function's own scopes left out, and
    the runtime's number of the edge), most first."""
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        if op_type(event.name) != "_Send" or not start_ns <= event.start_ns <= end_ns:
            continue
        node = event.name.rpartition(":")[0]
        node = _SEND_PREFIX.sub("", node)
        counts[_EDGE_NUMBER.sub("", node) or node] += 1
    return {k: n / steps for k, n in sorted(counts.items(), key=lambda kv: -kv[1])}


# The scopes of the replica loop and of the step function it calls.
_SEND_PREFIX = re.compile(r"^.*StatefulPartitionedCall/")
_EDGE_NUMBER = re.compile(r"/_\d+$")


def op_spans(events, start_ns: int, end_ns: int) -> list[list]:
    """The kernels that ran within two times as `[thread pool, op type,
    start, ms]` rows (start in ms from `start_ns`): what `draw_timeline`
    draws. A kernel that outlasts the span (a loop, a call of a function,
    a wait on a queue) holds the others and is left out."""
    rows = []
    for event in events:
        kind = op_type(event.name)
        inside = start_ns <= event.start_ns and event.start_ns + event.duration_ns <= end_ns
        if kind is not None and inside:
            pool = event.line.split("/")[0]
            rows.append([pool, kind, (event.start_ns - start_ns) / 1e6, event.duration_ns / 1e6])
    return rows


def _color(kind: str) -> str:
    if kind in ("_Send", "_Recv", "_HostSend", "_HostRecv"):
        return "tab:orange"
    if kind.startswith(("ResourceApply", "AssignAdd", "AssignVariable", "ResourceScatter")):
        return "tab:red"
    if kind in ("ReadVariableOp", "VarHandleOp"):
        return "tab:green"
    if any(math in kind for math in ("MatMul", "BiasAdd", "Relu", "Softmax", "Xent")):
        return "tab:blue"  # with oneDNN, `_MklMatMul` and the like
    return "tab:gray"


def draw_timeline(panels: list[dict[str, Any]], path: Path) -> None:
    """One panel per contender: a row per task thread that ran a kernel.

    Args:
        panels: `{"title": str, "span_ms": float, "tasks": {task: rows}}`
            with `rows` as `op_spans` gives them.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = []
    for panel in panels:
        threads = {(task, r[0]) for task, rows in panel["tasks"].items() for r in rows}
        heights.append(max(2, len(threads)))
    figure, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, 1.2 + 0.32 * sum(heights) + 0.6 * len(panels)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for axis, panel in zip(axes[:, 0], panels):
        labels = []
        for task in sorted(panel["tasks"], key=_task_order):
            rows = panel["tasks"][task]
            for thread in sorted({r[0] for r in rows}):
                y = len(labels)
                spans = [(r[2], max(r[3], 0.02)) for r in rows if r[0] == thread]
                colors = [_color(r[1]) for r in rows if r[0] == thread]
                axis.broken_barh(spans, (y - 0.4, 0.8), facecolors=colors)
                labels.append(f"{task}: {thread}")
        axis.set_yticks(range(len(labels)), labels, fontsize=7)
        axis.set_ylim(-0.6, max(len(labels), 1) - 0.4)
        axis.invert_yaxis()
        axis.set_xlim(0, panel["span_ms"])
        axis.set_title(panel["title"], fontsize=9, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the start of the span")
    legend = [
        Patch(color="tab:blue", label="forward/backward math"),
        Patch(color="tab:orange", label="_Send/_Recv (crossing tasks)"),
        Patch(color="tab:red", label="variable updates"),
        Patch(color="tab:green", label="variable reads"),
        Patch(color="tab:gray", label="other ops"),
    ]
    figure.legend(handles=legend, loc="lower center", ncol=5, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _task_order(task: str) -> tuple[int, str]:
    order = {"ps": 0, "worker": 1, "chief": 2}
    return order.get(task.split(" ")[0], 3), task
