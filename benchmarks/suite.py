"""The benchmark suite's command line: `python -m benchmarks [--quick] [--out DIR]`.

1. Describes the machine and checks whether tf-keras can be imported by the
   Python given as `--tf-keras-python` (CentralStorageStrategy runs there).
2. Calibrates the straggler: per device count, the time of one
   MirroredStrategy step without a straggler, `t`. A replica "k times slower"
   then sleeps `(k - 1) * t` in every training step, the same delay in
   seconds for every contender.
3. Runs the plan's sessions (one subprocess each, `benchmarks.worker`) once per
   repeat, in the same order every round, so that contenders alternate.
4. Writes `results.json`, `results.md` and PNG plots to the output directory,
   and prints `results.md`'s tables.

`--device` picks the replicas' devices: logical CPU devices, or GPUs (one
per replica, or slices of the first GPU when there are fewer GPUs than
replicas); `auto` takes the GPUs when the `--python` sees any. The cluster
workload runs on CPUs whatever the device (see `docs/benchmarks.md`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import plan as plans
from benchmarks.contenders import CONTENDERS
from benchmarks.worker import RESULT_PREFIX

__all__ = ["main", "run", "detect_tf_keras", "run_session", "machine_info", "resolve_device"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "logical_cpus": os.cpu_count(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as f:
            total = next(line for line in f if line.startswith("MemTotal"))
        info["memory_gib"] = round(int(total.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        info["memory_gib"] = None
    return info


_DETECT = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None
print(json.dumps({
    "tf_keras": version("tf-keras", "tf_keras") if iu.find_spec("tf_keras") else None,
    "tensorflow": version("tensorflow-cpu", "tensorflow") if iu.find_spec("tensorflow") else None,
    "sklearn": iu.find_spec("sklearn") is not None,
    "python_version": "%d.%d.%d" % sys.version_info[:3],
}))
"""


def detect_tf_keras(python: str) -> dict[str, Any]:
    """Whether `python` can run the tf-keras contender, and if not, why not.

    Looks for the packages without importing TensorFlow (which takes seconds).
    """
    out: dict[str, Any] = {"python": python, "available": False}
    if not Path(python).exists():
        out["reason"] = f"{python} does not exist"
        return out
    try:
        proc = subprocess.run(
            [python, "-c", _DETECT], capture_output=True, text=True, timeout=60, check=False
        )
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as error:
        out["reason"] = f"could not ask {python} for its packages: {error}"
        return out
    out.update(found)
    missing = [
        name
        for name, have in (
            ("tf-keras", found["tf_keras"]),
            ("tensorflow", found["tensorflow"]),
            ("scikit-learn", found["sklearn"]),
        )
        if not have
    ]
    if missing:
        out["reason"] = (
            f"{', '.join(missing)} not importable by {python}; make an environment with "
            "`python -m venv /tmp/tfkeras-venv && /tmp/tfkeras-venv/bin/pip install "
            '"tensorflow-cpu==2.21.*" "tensorboard==2.21.*" scikit-learn && '
            "/tmp/tfkeras-venv/bin/pip install "
            '--no-deps "tf-keras==2.21.*"` and pass --tf-keras-python /tmp/tfkeras-venv/bin/python'
        )
    else:
        out["available"] = True
    return out


_COUNT_GPUS = (
    "import os; os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3'); import tensorflow as tf; "
    "print(len(tf.config.list_physical_devices('GPU')))"
)


def resolve_device(requested: str, python: str) -> tuple[str, int]:
    """`--device` as the sessions get it: `("cpu" or "gpu", GPUs seen by python)`.

    Raises:
        SystemExit: `gpu` where `python` sees no GPU, or `python` cannot tell.
    """
    if requested == "cpu":
        return "cpu", 0
    try:
        proc = subprocess.run(
            [python, "-c", _COUNT_GPUS], capture_output=True, text=True, timeout=120, check=False
        )
        gpus = int(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as error:
        if requested == "auto":
            _log(f"--device auto: could not count GPUs with {python} ({error}); using the CPU")
            return "cpu", 0
        raise SystemExit(f"--device gpu: could not count GPUs with {python}: {error}") from error
    if gpus == 0 and requested == "gpu":
        raise SystemExit(
            f"--device gpu: {python} sees no GPU (TensorFlow lists no physical GPU device "
            "on this host, or this TensorFlow build has no GPU support); run with "
            "--device cpu or --device auto, or pass a GPU build of TensorFlow as --python."
        )
    return ("gpu" if gpus else "cpu"), gpus


def run_session(
    python: str, config: dict, timeout: float, inter_op_threads: int | None = None
) -> dict[str, Any]:
    """Runs one session in a subprocess; returns its result (or why it failed)."""
    env = dict(os.environ)
    if inter_op_threads:
        env["TF_NUM_INTEROP_THREADS"] = str(inter_op_threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A crash inside TensorFlow then leaves the Python stacks of every thread
    # in the session's stderr tail.
    env["PYTHONFAULTHANDLER"] = "1"
    if CONTENDERS[config["contender"]].legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    else:
        env.pop("TF_USE_LEGACY_KERAS", None)
    command = [python, "-m", "benchmarks.worker", "--json-config", json.dumps(config)]
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        return {
            "status": "error",
            "error": f"session timed out after {timeout:.0f} s",
            "stderr_tail": (error.stderr or b"")[-2000:].decode(errors="replace")
            if isinstance(error.stderr, bytes)
            else (error.stderr or "")[-2000:],
            "contender": config["contender"],
            "replicas": config["replicas"],
        }
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        return {
            "status": "error",
            "error": f"worker exited with code {proc.returncode} and printed no result",
            "stderr_tail": proc.stderr[-3000:],
            "contender": config["contender"],
            "replicas": config["replicas"],
        }
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["wall_seconds"] = time.perf_counter() - start
    result["load_average_before"] = load
    if result.get("status") != "ok":
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def _calibrate(
    plan: plans.Plan,
    python: str,
    timeout: float,
    mirrored_reduce: str,
    inter_op_threads: int | None,
    plan_device: str = "cpu",
    gpu_memory_mb: int | None = None,
) -> dict[int, dict[str, Any]]:
    """Per device count: the no-straggler step time and the delay of each slowdown."""
    counts = set(plan.straggler_replicas) if "straggler" in plan.workloads else set()
    if "accuracy" in plan.workloads and (
        "mirrored" in plan.contenders or plan.step_seconds is not None
    ):
        counts.add(plan.accuracy_replicas)
    slowdowns = sorted(set(plan.slowdowns) | {plan.accuracy_slowdown})
    out: dict[int, dict[str, Any]] = {}
    for replicas in sorted(counts):
        entry: dict[str, Any] = {"replicas": replicas}
        if plan.step_seconds is not None:
            entry.update(step_seconds=plan.step_seconds, source="fixed by the plan")
        elif "mirrored" in plan.contenders:
            task = {
                "kind": "throughput",
                **plans.timed_task(plan, plan.straggler_model),
                "min_epochs": max(3, plan.min_epochs),
            }
            _log(f"calibrating the straggler: MirroredStrategy on {replicas} device(s) ...")
            session = run_session(
                python,
                {
                    "contender": "mirrored",
                    "replicas": replicas,
                    "seed": plan.seed,
                    "mirrored_reduce": mirrored_reduce,
                    "device": plan_device,
                    "gpu_memory_mb": gpu_memory_mb,
                    "tasks": [task],
                },
                timeout,
                inter_op_threads,
            )
            result = (session.get("tasks") or [{}])[0].get("result", {})
            if session.get("status") != "ok" or result.get("status") != "ok":
                entry["error"] = session.get("error") or result.get("error")
                _log(f"  calibration failed: {entry['error']}")
                out[replicas] = entry
                continue
            steps = plans.steps_per_epoch(plan, plan.straggler_model)
            entry.update(
                step_seconds=result["median_epoch_seconds"] / steps,
                source=(
                    f"MirroredStrategy, {plan.straggler_model}, global batch "
                    f"{plan.batch_size}: median epoch time / {steps} steps"
                ),
                examples_per_second=result["examples_per_second"],
            )
        else:
            entry["error"] = "no MirroredStrategy contender to calibrate on; set step_seconds"
            out[replicas] = entry
            continue
        entry["delays"] = {k: (k - 1) * entry["step_seconds"] for k in slowdowns}
        _log(
            f"  {replicas} device(s): step {1000 * entry['step_seconds']:.1f} ms; delays "
            + ", ".join(f"k={k}: {1000 * d:.1f} ms" for k, d in entry["delays"].items())
        )
        out[replicas] = entry
    return out


def _finite(value):
    """JSON without NaN or infinities (they become null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _without_tf_keras(plan: plans.Plan, reason: str) -> plans.Plan:
    """`plan` without the contenders that tf-keras runs, each named in the log."""
    # (workload, the plan's field of its contenders, the tf-keras contender)
    legacy = (
        (None, "contenders", "central_storage"),
        ("cluster", "cluster_contenders", "parameter_server"),
        ("embeddings", "embedding_cluster_contenders", "parameter_server"),
    )
    labels = {
        "central_storage": "CentralStorageStrategy",
        "parameter_server": "ParameterServerStrategy",
    }
    for workload, field, contender in legacy:
        chosen = getattr(plan, field)
        if contender in chosen and (workload is None or workload in plan.workloads):
            _log(f"{labels[contender]} (tf-keras) cannot be run: {reason}")
            plan = dataclasses.replace(plan, **{field: tuple(c for c in chosen if c != contender)})
    return plan


def run(plan: plans.Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Runs `plan` and writes its results; returns them."""
    from benchmarks import report

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine = machine_info()
    device, gpus = getattr(args, "resolved_device", ("cpu", 0))
    machine.update(device=device, gpus=gpus, gpu_memory_mb=args.gpu_memory_mb)
    tf_keras = detect_tf_keras(args.tf_keras_python)
    if not tf_keras["available"]:
        plan = _without_tf_keras(plan, tf_keras["reason"])
    calibration = _calibrate(
        plan,
        args.python,
        args.session_timeout,
        args.mirrored_reduce,
        args.inter_op_threads,
        device,
        args.gpu_memory_mb,
    )
    delays = {n: c["delays"] for n, c in calibration.items() if "delays" in c}
    round_sessions = plans.sessions(plan, delays)
    runs = []
    total = plan.repeats * len(round_sessions)

    def one(round_index: int, config: dict) -> dict[str, Any]:
        config = {
            "device": device,
            "gpu_memory_mb": args.gpu_memory_mb,
            **config,
            "mirrored_reduce": args.mirrored_reduce,
        }
        legacy = CONTENDERS[config["contender"]].legacy
        result = run_session(
            args.tf_keras_python if legacy else args.python,
            config,
            args.session_timeout,
            args.inter_op_threads,
        )
        failed = [
            t["task"]["kind"] for t in result.get("tasks", []) if t["result"].get("status") != "ok"
        ]
        _log(
            f"[{len(runs) + 1}/{total}] round {round_index + 1}: {config['contender']} on "
            f"{config['replicas']} device(s), {len(config['tasks'])} task(s): "
            f"{result.get('status')} in {result.get('wall_seconds', 0):.1f} s"
            + (f"; failed tasks: {failed}" if failed else "")
            + (f"; {result.get('error')}" if result.get("status") != "ok" else "")
        )
        run = {"round": round_index, "config": config, "result": result}
        runs.append(run)
        return run

    for round_index in range(plan.repeats):
        if args.jobs == 1:
            for config in round_sessions:
                one(round_index, config)
        else:
            # Only for smoke tests: concurrent sessions disturb each other's timing.
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(lambda c, r=round_index: one(r, c), round_sessions))
    runs.sort(key=lambda r: r["round"])
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results = report.build(
        plan=plan,
        runs=runs,
        calibration=calibration,
        machine=machine,
        tf_keras=tf_keras,
        command=command,
        mirrored_reduce=args.mirrored_reduce,
        inter_op_threads=args.inter_op_threads,
        seconds=time.perf_counter() - started,
    )
    results = _finite(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(report.markdown(results))
    if not args.no_plots:
        try:
            from benchmarks import plots

            results["figures"] = plots.write_all(results, out_dir)
        except ImportError as error:
            _log(f'no plots: {error} (install them with `pip install -e ".[benchmarks]"`)')
        else:
            (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
            (out_dir / "results.md").write_text(report.markdown(results))
    print(report.markdown(results), flush=True)
    _log(f"wrote {out_dir}/results.json, results.md and plots in {results['seconds']:.0f} s")
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark tf_diffmap against plain Keras, MirroredStrategy and "
        "tf-keras' CentralStorageStrategy on logical CPU devices (or GPUs), and against "
        "tf-keras' ParameterServerStrategy on a localhost cluster.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a run of a few minutes")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run for the test suite (its numbers mean nothing)",
    )
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help="output directory (default: benchmarks/results/)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="rounds of every session (default: the preset's)"
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="Python with TensorFlow 2.21, Keras 3 and tf_diffmap's "
        "dependencies (default: this one)",
    )
    parser.add_argument(
        "--tf-keras-python",
        default=sys.executable,
        help="Python with tensorflow-cpu 2.21, tf-keras 2.21 and scikit-learn, "
        "for CentralStorageStrategy (default: this one)",
    )
    parser.add_argument(
        "--contenders", default=None, help="comma-separated subset of: " + ", ".join(CONTENDERS)
    )
    parser.add_argument(
        "--mirrored-reduce",
        choices=("one_device", "collective"),
        default="one_device",
        help="MirroredStrategy's cross-device ops: ReductionToOneDevice "
        "(default: the faster on CPUs here) or its own choice on CPUs, "
        "collective all-reduce",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=None,
        help="skip the calibration: the straggler's delay is (k-1) times this",
    )
    parser.add_argument(
        "--inter-op-threads",
        type=int,
        default=None,
        help="TF_NUM_INTEROP_THREADS for every session (default: TensorFlow's "
        "own choice, one per core)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=900.0,
        help="seconds before a session subprocess is stopped",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="sessions run at once (default 1; more only for smoke tests, "
        "since concurrent sessions slow each other down)",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated workloads to run, of: "
        + ", ".join(plans.WORKLOADS)
        + " (default: the preset's; the smoke preset leaves out control, cluster, "
        "fault_timeline and embeddings)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="the replicas' devices: logical CPU devices, or GPUs (one per replica, or "
        "slices of the first GPU when there are fewer GPUs than replicas); auto "
        "(default): the GPUs when --python sees any, else the CPU",
    )
    parser.add_argument(
        "--gpu-memory-mb",
        type=int,
        default=2048,
        help="memory of each logical GPU when a GPU is split (default 2048)",
    )
    parser.add_argument(
        "--cluster-model",
        choices=("mlp_wide", "mlp_deep_bn"),
        default=None,
        help="the model of the cluster workloads (default mlp_wide: 6 variables; "
        "mlp_deep_bn: 50 small ones)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    plan = plans.PRESETS[preset]
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"--repeats must be >= 1, received {args.repeats}.")
        plan = dataclasses.replace(plan, repeats=args.repeats)
    if args.contenders:
        chosen = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
        unknown = [c for c in chosen if c not in CONTENDERS]
        if unknown:
            raise SystemExit(f"Unknown contenders {unknown}; choose from {list(CONTENDERS)}.")
        plan = dataclasses.replace(
            plan,
            contenders=chosen,
            control_contenders=tuple(c for c in plan.control_contenders if c in chosen),
            cluster_contenders=tuple(
                c
                for c in (*plan.cluster_contenders, *plans.EXTRA_CLUSTER_CONTENDERS)
                if c in chosen
            ),
            embedding_contenders=tuple(c for c in plan.embedding_contenders if c in chosen),
            embedding_cluster_contenders=tuple(
                c for c in plan.embedding_cluster_contenders if c in chosen
            ),
        )
    if args.cluster_model is not None:
        plan = plans.with_cluster_model(plan, args.cluster_model)
    if args.step_seconds is not None:
        plan = dataclasses.replace(plan, step_seconds=args.step_seconds)
    if args.only:
        chosen = tuple(w.strip() for w in args.only.split(",") if w.strip())
        unknown = [w for w in chosen if w not in plans.WORKLOADS]
        if unknown:
            raise SystemExit(f"Unknown workloads {unknown}; choose from {list(plans.WORKLOADS)}.")
        plan = dataclasses.replace(plan, workloads=chosen)
    args.resolved_device = resolve_device(args.device, args.python)
    command = "python -m benchmarks " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    run(plan, args, command.strip())
    return 0
