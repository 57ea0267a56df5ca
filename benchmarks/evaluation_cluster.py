"""Evaluation and prediction on a localhost cluster: split over the workers, side by side.

The workload of `benchmarks.evaluation` (a 64-256-128-10 MLP, 10,240
examples in batches of 256, device time emulated at 0.1 ms an example, and
none) on the cluster of issue 48's target: `LocalCluster(workers=2, ps=1,
cpus_per_worker=2)`, 4 replicas, this process the chief. Variants:

- `split`: each batch cut into 4 shards, run at once on the replicas of
  both workers (`tf_diffmap.cluster.inference`);
- `whole batch (before)`: the path before the split, every batch whole on
  worker 0's first device (this process forces it by keeping the step
  unsplit).

With `--faults`, the `split` run ends with two more `evaluate` calls, with
device time: one during which worker 1 is paused (SIGSTOP) at the 10th
batch (a hung worker: it costs `worker_timeout`, 10 s here, then its shards
run on worker 0; it is resumed after), and one during which worker 1 is
killed at the 10th batch. Each is printed as its seconds beside the
fault-free median.

    python -m benchmarks.evaluation_cluster                 # 2 rounds, 3 timed calls each
    python -m benchmarks.evaluation_cluster --rounds 3 --faults

Every variant runs in a subprocess of its own, with a cluster of its own;
the variants alternate within each round. Each figure is the median of the
timed calls of all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from benchmarks.evaluation import (
    BATCH,
    EXAMPLES,
    median,
    model_builder,
    print_table,
    run_rounds,
    time_calls,
    workload_data,
)

__all__ = ["main"]

WORKERS, CPUS_PER_WORKER = 2, 2
VARIANTS = ("split", "whole batch (before)")
WORKER_TIMEOUT = 10.0
FAULT_BATCH = 10


def _run(variant: str, device_ms_per_example: float, repeats: int, faults: bool) -> dict:
    from tf_diffmap import cluster

    if variant == "whole batch (before)":
        import tf_diffmap.extended

        def whole_batch(self, step, fn, args, kwargs):
            return step  # the step as traced first: whole, on worker 0's device

        tf_diffmap.extended.AsyncExtended._cluster_inference = whole_batch
    delay = {"seconds_per_example": device_ms_per_example / 1e3}
    build = model_builder(delay)
    with cluster.LocalCluster(workers=WORKERS, ps=1, cpus_per_worker=CPUS_PER_WORKER) as local:
        strategy = cluster.strategy_for_cluster(local.resolver(), worker_timeout=WORKER_TIMEOUT)
        models = {}

        def model_for(device_ms: float):
            with strategy.scope():
                models[device_ms] = build(device_ms > 0)
            return models[device_ms]

        row = {"variant": variant}
        row.update(time_calls(model_for, delay, device_ms_per_example, repeats))
        if faults and variant == "split":
            delay["seconds_per_example"] = device_ms_per_example / 1e3
            row.update(_faults(local, models[device_ms_per_example], device_ms_per_example))
    return row


def _faults(local, model, device_ms: float) -> dict:
    """Seconds of one `evaluate` with worker 1 paused at the 10th batch
    (resumed after), and of one with it killed there."""
    import keras

    data, _ = workload_data()
    pid = local.pids[("worker", 1)]
    timed = {}
    for fault in ("paused", "killed"):

        class Fault(keras.callbacks.Callback):
            def on_test_batch_end(self, batch, logs=None, fault=fault):
                if batch != FAULT_BATCH:
                    return
                if fault == "paused":
                    os.kill(pid, 19)  # SIGSTOP: its calls neither fail nor return
                else:
                    threading.Thread(target=local.kill, args=("worker", 1)).start()

        start = time.perf_counter()
        model.evaluate(data, verbose=0, callbacks=[Fault()])
        timed[f"evaluate, worker 1 {fault}@{device_ms:g}"] = [time.perf_counter() - start]
        if fault == "paused":
            os.kill(pid, 18)  # SIGCONT
            time.sleep(2.0)  # it answers, and its replicas rejoin
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.evaluation_cluster", description=__doc__
    )
    parser.add_argument("--device-ms-per-example", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        row = _run(args.worker, args.device_ms_per_example, args.repeats, args.faults)
        print(json.dumps(row), flush=True)
        os._exit(0)  # a killed worker leaves the runtime's own threads behind
    env = dict(os.environ, TF_NUM_INTEROP_THREADS="12")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    options = ["--device-ms-per-example", str(args.device_ms_per_example)]
    options += ["--repeats", str(args.repeats)] + (["--faults"] if args.faults else [])
    times = run_rounds("benchmarks.evaluation_cluster", args.variants, args.rounds, options, env)
    faults = {k: v for k, v in times.get("split", {}).items() if "worker 1" in k}
    for key in faults:
        del times["split"][key]
    replicas = WORKERS * CPUS_PER_WORKER
    print_table(
        times,
        "split",
        f"Localhost cluster of {WORKERS} workers ({replicas} replicas) and 1 ps; "
        f"{EXAMPLES} examples, batch {BATCH}; seconds per call "
        f"(median of {args.rounds * args.repeats})",
    )
    if faults:
        base = median(times["split"][f"evaluate@{args.device_ms_per_example:g}"])
        print(f"\nevaluate with a fault (worker_timeout={WORKER_TIMEOUT:g} s)")
        print(f"- fault-free (median): {base:.3f} s")
        for key, seconds in faults.items():
            print(f"- {key.split('@')[0]}: {', '.join(f'{s:.2f}' for s in seconds)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
