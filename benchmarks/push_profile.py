"""Where a global batch's gradients go: remote calls, bytes and ops on the ps.

`python -m benchmarks.push_profile [--steps N] [--contenders ...]
[--tf-keras-path DIR] [--figure PNG] [--out DIR]` trains the dense MLP
(64-256-256-10, Adam, global batch 128) under each contender, each in a
process of its own (connecting makes a process a cluster's chief for good):

- `one_host`: `tf_diffmap.Strategy` on 2 logical CPU devices of this host;
- `cluster`: `tf_diffmap` on a localhost cluster (2 workers, 1 ps, this
  process the chief) with its defaults (fresh windows);
- `cluster_async`: the same with asynchronous windows
  (`max_step_staleness=1`);
- `parameter_server`: tf-keras' `ParameterServerStrategy` on the same
  cluster shape, run where tf-keras imports (`--tf-keras-path`: a folder
  that holds the `tf_keras` package, put on the child's path).

A contender runs twice, in the same way: a warm-up `fit`, then a `fit` of
`steps // 3` batches and one of `steps`. Counts per global batch are the
difference of those two fits over the batches between them, free of what a
`fit` does once (its start, its last drain); the time per batch is the
long fit's (the difference of two times is too noisy on a shared host). In
the first run a third `fit` of `--profile-steps` batches is traced with
TensorFlow's profiler on every task: the kernels each task ran per batch,
and the timeline of `--figure` (a typical batch's span). In the second run
(on a cluster) each task listens behind a `benchmarks.wire.WireTap` relay,
which counts every gRPC call into it, by caller, task and method, with its
messages, bytes and seconds; the relays slow the calls down, so the time
and the profile are the first run's. It prints two tables; `--out` keeps
each contender's JSON and profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import traces, workloads

__all__ = ["CONTENDERS", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = {
    "one_host": "tf_diffmap, one host (2 replicas)",
    "cluster": "tf_diffmap, cluster default (fresh windows)",
    "cluster_async": "tf_diffmap, cluster, asynchronous windows",
    "parameter_server": "ParameterServerStrategy (tf-keras)",
}
MODEL = "mlp_wide"
BATCH = 128
WARMUP_STEPS = 3
TASKS = (("worker", 0), ("worker", 1), ("ps", 0))


def _cluster(name: str, ports: list[int] | None):
    """The contender's servers (each behind a tap, with `ports` to listen
    on) and its strategy."""
    from benchmarks.wire import WireTap

    listen = dict(zip(TASKS, ports or ()))
    if name == "parameter_server":
        import tensorflow as tf

        from benchmarks.servers import LocalServers

        servers = LocalServers(2, 1, env={"CUDA_VISIBLE_DEVICES": ""}, listen_ports=listen)
    else:
        from tf_diffmap import cluster

        servers = cluster.LocalCluster(
            workers=2, ps=1, env={"CUDA_VISIBLE_DEVICES": ""}, listen_ports=listen
        )
    spec = servers.cluster_spec
    tap = None
    if listen:
        tap = WireTap([(spec[job][i], listen[job, i], f"{job} {i}") for job, i in TASKS]).start()
    try:
        servers.start()
        if name == "parameter_server":
            strategy = tf.distribute.experimental.ParameterServerStrategy(servers.resolver())
            pids = servers.task_pids
        else:
            options = {"max_step_staleness": 1} if name == "cluster_async" else {}
            strategy = cluster.strategy_for_cluster(servers.resolver(), **options)
            pids = {f"{job} {i}": pid for (job, i), pid in servers.pids.items()}
    except BaseException:
        servers.stop()
        if tap is not None:
            tap.stop()
        raise
    remote = {f"{job} {i}": spec[job][i] for job, i in TASKS}
    return servers, tap, strategy, pids, remote


def measure(name: str, steps: int, profile_steps: int, out: Path, tapped: bool) -> dict[str, Any]:
    """One contender's figures (run in a process of its own): `tapped`,
    the calls through the relays; else the time and the profile."""
    if name not in CONTENDERS:
        raise ValueError(f"Unknown contender {name!r}; expected one of {list(CONTENDERS)}.")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    legacy = name == "parameter_server"
    if legacy:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    servers = None
    if name == "one_host":
        import tf_diffmap

        devices = tf_diffmap.split_devices(2, "CPU")
    import tensorflow as tf

    if legacy:
        keras = tf.keras
    else:
        import keras
    if name == "one_host":
        strategy = tf_diffmap.Strategy(devices=devices)
        pids, remote, tap = {}, {}, None
    else:
        from tf_diffmap.cluster.local import free_ports

        ports = free_ports(len(TASKS)) if tapped else None
        servers, tap, strategy, pids, remote = _cluster(name, ports)
    try:
        x, y = workloads.synthetic_data(MODEL, BATCH * 64)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = workloads.build_model(keras, MODEL)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy"
            )
        data = workloads.dataset(x, y, BATCH)

        def fit(n: int) -> float:
            start = time.perf_counter()
            model.fit(data, steps_per_epoch=n, epochs=1, verbose=0)
            return time.perf_counter() - start

        fit(WARMUP_STEPS)
        short, long_ = max(1, steps // 3), steps
        counted, pushes = {}, {}
        processes = {"chief": os.getpid(), **pids}
        for n in (short, long_):
            if tap is not None:
                tap.reset()
            if not legacy:
                strategy.reset_statistics()
            cpu_before = _cpu_seconds(processes)
            seconds = fit(n)
            cpu_after = _cpu_seconds(processes)
            counted[n] = (seconds, tap.report() if tap is not None else [])
            if not legacy:
                figures = strategy.statistics().as_dict()
                pushes[n] = (sum(figures["updates"]), sum(figures["dropped"]))
        # The long fit's time, its start and last drain included: the
        # difference of two fits' times is too noisy on a shared host.
        step_ms = 1000 * counted[long_][0] / long_
        # Each process' CPU per batch in the long fit (its start and last
        # drain included, as in its time).
        cpu_ms = {task: 1000 * (cpu_after[task] - cpu_before[task]) / long_ for task in processes}
        names = {pid: task for task, pid in pids.items()} | {os.getpid(): "chief"}
        calls = _per_step(counted[short][1], counted[long_][1], long_ - short, names)
        profile = None
        if tap is None:
            logdir = out / f"{name}_profile"
            span = traces.trace_tasks(
                lambda: fit(profile_steps),
                logdir,
                remote,
                seconds=3 * profile_steps * step_ms / 1000 + 5,
            )
            profile = _profile(traces.read_events(logdir), profile_steps, span)
    finally:
        if servers is not None:
            servers.stop()
        if tap is not None:
            tap.stop()
    return {
        "contender": name,
        "label": CONTENDERS[name],
        "steps": [short, long_],
        "step_ms": step_ms,
        "examples_per_second": 1000 * BATCH / step_ms,
        "cpu_ms": cpu_ms,
        # Gradients pushed per global batch (accepted, dropped as too stale).
        "pushes": [(pushes[long_][i] - pushes[short][i]) / (long_ - short) for i in (0, 1)]
        if pushes
        else None,
        "calls": calls,
        "profile": profile,
    }


def _cpu_seconds(processes: dict[str, int]) -> dict[str, float]:
    """Each process' user and system CPU seconds so far."""
    import psutil

    return {task: sum(psutil.Process(pid).cpu_times()[:2]) for task, pid in processes.items()}


def _per_step(short: list[dict], long_: list[dict], steps: int, names) -> list[dict]:
    """The long fit's counts less the short one's, per step, by caller, task
    and method (a caller named by its task; `"(bytes)"`: the connections')."""
    from benchmarks.wire import FIELDS as fields

    totals: dict[tuple, dict[str, float]] = defaultdict(lambda: dict.fromkeys(fields, 0.0))
    for sign, rows in ((-1, short), (1, long_)):
        for row in rows:
            caller = names.get(row["caller_pid"], f"pid {row['caller_pid']}")
            entry = totals[caller, row["task"], row["method"]]
            for field in fields:
                entry[field] += sign * row[field]
    out = []
    for (caller, task, method), entry in sorted(totals.items()):
        figures = {k: v / steps for k, v in entry.items()}
        if method != "(bytes)" and abs(figures["calls"]) < 0.05 and not figures["requests"]:
            continue
        out.append({"caller": caller, "task": task, "method": method, **figures})
    return out


def _profile(events: dict[str, list], steps: int, span: tuple[int, int]) -> dict[str, Any]:
    """Kernels per step on each task over the traced `fit` (`span`: its
    start and end), and one step's span of them for the timeline.

    The timeline's span is a typical one: the time from the ps's first
    kernel of the fit to its last (the chief's, on one host) cut into
    `steps` equal spans, the one in which it ran the median count of
    kernels of those in which it ran any. (The fit's own time holds more
    than its batches: its start, and on a cluster a replica loop that runs
    several batches at once.)
    """
    first, last = span
    reference = events.get("ps 0", events.get("chief", []))
    starts = sorted(
        e.start_ns for e in reference if traces.op_type(e.name) and first <= e.start_ns <= last
    )
    if not starts:
        raise RuntimeError("The profile holds no kernel of the ps (or of this host) in the fit.")
    width = max(1.0, (starts[-1] - starts[0]) / steps)
    counts = [0] * steps
    for start in starts:
        counts[min(steps - 1, int((start - starts[0]) // width))] += 1
    busy = sorted((i for i in range(steps) if counts[i]), key=counts.__getitem__)
    typical = busy[len(busy) // 2]
    window = starts[0] + typical * width
    return {
        "seconds": (last - first) / 1e9,
        "span_ms": width / 1e6,
        "tasks": {
            task: traces.op_summary(task_events, first, last, steps)
            for task, task_events in events.items()
        },
        "sends": {
            task: traces.sends(task_events, first, last, steps)
            for task, task_events in events.items()
        },
        "timeline": {
            task: traces.op_spans(task_events, int(window), int(window + width))
            for task, task_events in events.items()
        },
    }


# -- the parent: one process per contender, the tables, the figure ----------


def _run_child(name: str, args, out: Path, tap: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), *_extra(args)])))
    command = [
        sys.executable,
        "-m",
        "benchmarks.push_profile",
        "--child",
        name,
        "--steps",
        str(args.steps),
        "--profile-steps",
        str(args.profile_steps),
        "--out",
        str(out),
        *(["--tap"] if tap else []),
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    return json.loads((out / f"{name}{'_tap' if tap else ''}.json").read_text())


def _saved(name: str, folder: Path) -> dict[str, Any]:
    """A contender's result as `_run` makes it, from a run saved with `--out`."""
    path = folder / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: was {name} run with --out {folder}?")
    result = json.loads(path.read_text())
    tapped = folder / f"{name}_tap.json"
    if tapped.exists():
        counted = json.loads(tapped.read_text())
        result["calls"] = counted["calls"]
        result["tapped_step_ms"] = counted["step_ms"]
    return result


def _run(name: str, args, out: Path) -> dict[str, Any]:
    """A contender's time and profile, and (on a cluster) its calls, counted
    in a second run: the relays slow every call down."""
    result = _run_child(name, args, out, tap=False)
    if name != "one_host":
        counted = _run_child(name, args, out, tap=True)
        result["calls"] = counted["calls"]
        result["tapped_step_ms"] = counted["step_ms"]
    return result


def _extra(args) -> list[str]:
    paths = [os.environ.get("PYTHONPATH", "")]
    if args.tf_keras_path:
        paths.append(args.tf_keras_path)
    return paths


def _remote_calls(result: dict) -> list[dict]:
    return [c for c in result["calls"] if c["method"] not in ("(bytes)", "Profile")]


def _flows(calls: list[dict]) -> dict[str, float]:
    """KB of gRPC messages between the ps and the workers, each way, and
    between the chief and the others. RecvTensor is a pull: a tensor goes
    from the task called to its caller, in the response."""
    flows = {"ps -> workers": 0.0, "workers -> ps": 0.0, "chief <-> others": 0.0}
    for c in calls:
        caller, task = c["caller"].split(" ")[0], c["task"].split(" ")[0]
        if "chief" in (caller, task):
            flows["chief <-> others"] += c["request_bytes"] + c["response_bytes"]
        elif (caller, task) == ("worker", "ps"):
            flows["ps -> workers"] += c["response_bytes"]
            flows["workers -> ps"] += c["request_bytes"]
        elif (caller, task) == ("ps", "worker"):
            flows["workers -> ps"] += c["response_bytes"]
            flows["ps -> workers"] += c["request_bytes"]
    return {k: v / 1024 for k, v in flows.items()}


def summary_rows(results: list[dict]) -> list[dict[str, str]]:
    """One row per contender: the figures of one global batch."""
    rows = []
    for r in results:
        calls = _remote_calls(r)
        ps = r["profile"]["tasks"].get("ps 0")
        methods = defaultdict(float)
        for c in calls:
            methods[c["method"]] += c["calls"]
        flows = _flows(calls)
        rows.append(
            {
                "contender": r["label"],
                "ms/batch": f"{r['step_ms']:.1f}",
                "examples/s": f"{r['examples_per_second']:,.0f}",
                "CPU ms/batch by process": ", ".join(
                    f"{task} {ms:.1f}" for task, ms in sorted(r.get("cpu_ms", {}).items())
                )
                or "–",
                "pushes (dropped)": "–"
                if not r.get("pushes")
                else f"{r['pushes'][0]:.1f} ({r['pushes'][1]:.1f})",
                "remote calls": f"{sum(c['calls'] for c in calls):.1f}",
                "by method": ", ".join(
                    f"{m} {n:.1f}" for m, n in sorted(methods.items(), key=lambda kv: -kv[1])
                )
                or "–",
                "responses < 1 KB": f"{sum(c['small_responses'] for c in calls):.1f}",
                **{f"KB {k}": f"{v:.1f}" for k, v in flows.items()},
                "ps kernels": "–" if ps is None else f"{ps['ops']:.0f}",
                "ps kernel ms": "–" if ps is None else f"{ps['op_ms']:.2f}",
                "ps top kernels": "–"
                if ps is None
                else ", ".join(f"{k} {v['ops']:.0f}" for k, v in list(ps["by_type"].items())[:4]),
            }
        )
    return rows


def detail_rows(results: list[dict]) -> list[dict[str, str]]:
    """One row per contender, caller, task and method: per global batch."""
    rows = []
    for r in results:
        for c in _remote_calls(r):
            rows.append(
                {
                    "contender": r["label"],
                    "caller -> task": f"{c['caller']} -> {c['task']}",
                    "method": c["method"],
                    "calls": f"{c['calls']:.1f}",
                    "request KB": f"{c['request_bytes'] / 1024:.1f}",
                    "response KB": f"{c['response_bytes'] / 1024:.1f}",
                    "responses < 1 KB": f"{c['small_responses']:.1f}",
                    "ms/call": f"{1000 * c['call_seconds'] / c['calls']:.2f}"
                    if c["calls"] > 0
                    else "–",
                }
            )
    return rows


def send_rows(results: list[dict], shown: int = 8) -> list[dict[str, str]]:
    """One row per contender and cluster task: the values it sent to other
    tasks per global batch (its `_Send` kernels), the most frequent named."""
    rows = []
    for r in results:
        for task, values in r["profile"].get("sends", {}).items():
            if r["contender"] == "one_host" or not values:
                continue
            rows.append(
                {
                    "contender": r["label"],
                    "task": task,
                    "values sent": f"{sum(values.values()):.1f}",
                    "most sent": ", ".join(
                        f"{name} {n:.1f}" for name, n in list(values.items())[:shown]
                    ),
                }
            )
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no rows)"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row[h] for h in head) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--contenders", default="one_host,cluster,cluster_async,parameter_server")
    parser.add_argument("--tf-keras-path", default=None)
    parser.add_argument("--figure", default=None, help="the timeline PNG to write")
    parser.add_argument("--out", default=None, help="keep each contender's JSON and profile")
    parser.add_argument(
        "--from",
        dest="saved",
        default=None,
        help="print the tables (and draw --figure) of a run saved with --out, without running",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be at least 3, received {args.steps}.")
    if args.profile_steps < 1:
        parser.error(f"--profile-steps must be at least 1, received {args.profile_steps}.")
    names = [n for n in args.contenders.split(",") if n]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"Unknown contenders {unknown}; expected some of {list(CONTENDERS)}.")
    if args.child:
        out = Path(args.out)
        result = measure(args.child, args.steps, args.profile_steps, out, tapped=args.tap)
        (out / f"{args.child}{'_tap' if args.tap else ''}.json").write_text(json.dumps(result))
        return 0
    if args.saved:
        results = [_saved(name, Path(args.saved)) for name in names]
    else:
        with tempfile.TemporaryDirectory(prefix="push_profile_") as scratch:
            out = Path(args.out or scratch)
            out.mkdir(parents=True, exist_ok=True)
            results = [_run(name, args, out) for name in names]
    print(
        f"Per global batch of {BATCH} (calls, bytes and pushes: the difference of two "
        f"fits; ms/batch: the fit of {args.steps} batches):\n"
    )
    print(markdown(summary_rows(results)))
    print("\nRemote calls per global batch, by caller, task and method:\n")
    print(markdown(detail_rows(results)))
    print("\nValues each task sent to another one per global batch (its _Send kernels):\n")
    print(markdown(send_rows(results)))
    if args.figure:
        panels = [
            {
                "title": f"{r['label']}: a typical batch's span ({r['profile']['span_ms']:.1f} ms, "
                f"1/{args.profile_steps} of the ps's first to last kernel of a traced fit)",
                "span_ms": r["profile"]["span_ms"],
                "tasks": r["profile"]["timeline"],
            }
            for r in results
            if r["contender"] != "one_host"
        ]
        traces.draw_timeline(panels, Path(args.figure))
        print(f"\nTimeline: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
