"""A table of faults on short epochs: what each costs in seconds and updates.

`python -m benchmarks.fault_table [--repeats N] [--out FILE]` trains a
digits-shaped MLP (64-128-10, Adam, batch 32) on a localhost cluster of 2
workers and 1 ps, in epochs of about a second, and at the start of epoch
3 of 8 makes one event happen:

- `kill worker`: worker 1 gets SIGKILL and stays down;
- `pause worker`: worker 1 gets SIGSTOP for twice `worker_timeout` (2 s);
- `kill and restart ps`: the ps gets SIGKILL; the supervisor of `--local`
  starts it and the training script again, which resumes by
  `BackupAndRestore`.

Each run is a chief in a subprocess of its own, which stops only the
processes its `LocalCluster` started. For the worker events the table
gives the epochs' median time before and after, the event's epoch, and
updates lost (tokens the epoch counted but no replica applied, which is
`steps - version`); for the ps, the time from the kill to the end of the
epoch the second run resumed at, and the updates of the interrupted epoch.
ParameterServerStrategy's column is not measured here (see the run's
note).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

__all__ = ["main"]

EPOCHS, EVENT_EPOCH = 8, 3
STEPS = 112  # about a second of updates per epoch on the 2-core host

CHIEF = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, threading, time
    import keras, numpy as np
    from tf_diffmap import cluster

    event, out = sys.argv[1], sys.argv[2]
    EPOCHS, EVENT_EPOCH, STEPS = {epochs}, {event_epoch}, {steps}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 32, 64)).astype("float32")
    y = rng.integers(0, 10, size=STEPS * 32).astype("int32")
    run = {{"epoch_seconds": [], "versions": []}}

    def model_for(strategy):
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)),
                                      keras.layers.Dense(128, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Times(keras.callbacks.Callback):
        def __init__(self, strategy, local=None):
            self.strategy, self.local = strategy, local

        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.monotonic()
            if epoch == EVENT_EPOCH and self.local is not None:
                pid = self.local.pids[("worker", 1)]
                run["event_at"] = time.monotonic()
                if event == "kill_worker":
                    self.local.kill("worker", 1)
                elif event == "pause_worker":
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(4.0, os.kill, (pid, signal.SIGCONT)).start()

        def on_epoch_end(self, epoch, logs=None):
            run["epoch_seconds"].append(time.monotonic() - self.began)
            run["versions"].append(self.strategy.version)

    if event == "ps":
        flags = pathlib.Path(sys.argv[3])
        first = not (flags / "asked").exists()
        strategy = cluster.strategy_for_cluster()
        model = model_for(strategy)
        run["started"] = time.time()

        class Kill(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                run.setdefault("epochs", []).append(epoch)

            def on_train_batch_end(self, batch, logs=None):
                run["batches"] = batch + 1
                if first and (run["epochs"][-1], batch) == (EVENT_EPOCH, STEPS // 2):
                    (flags / "asked").touch()
                    while not (flags / "killed").exists():
                        time.sleep(0.02)
                    run["killed_at"] = time.time()

            def on_epoch_end(self, epoch, logs=None):
                run.setdefault("epoch_ended", {{}})[epoch] = time.time()

        try:
            model.fit(x, y, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=[
                keras.callbacks.BackupAndRestore(str(flags / "backup")), Kill()])
            run["finished"] = True
        except Exception as error:
            run["raised"] = type(error).__name__
            run["updates_lost"] = run["batches"] * len(strategy.replica_devices)
        with open(out, "a") as f:
            f.write(json.dumps(run) + "\\n")
        os._exit(0 if run.get("finished") else 1)

    with cluster.LocalCluster(workers=2, ps=1) as local:
        strategy = cluster.strategy_for_cluster(local.resolver(), worker_timeout=2.0)
        model = model_for(strategy)
        model.fit(x, y, batch_size=32, epochs=EPOCHS, verbose=0,
                  callbacks=[Times(strategy, local)])
        run["abandoned"] = strategy.statistics().abandoned
        run["replicas"] = len(strategy.replica_devices)
    with open(out, "w") as f:
        f.write(json.dumps(run))
    os._exit(0)
    """
).format(epochs=EPOCHS, event_epoch=EVENT_EPOCH, steps=STEPS)


def _worker_event(event: str, tmp: Path) -> dict:
    out = tmp / f"{event}.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TMPDIR=str(tmp))
    subprocess.run([sys.executable, "-c", CHIEF, event, str(out)], env=env, check=True, timeout=600)
    run = json.loads(out.read_text())
    seconds = run["epoch_seconds"]
    before = statistics.median(seconds[1:EVENT_EPOCH])
    after = statistics.median(seconds[EVENT_EPOCH + 1 :])
    tokens = STEPS * run["replicas"]
    versions = run["versions"]
    applied = versions[EVENT_EPOCH] - versions[EVENT_EPOCH - 1]
    return {
        "before": before,
        "event_epoch": seconds[EVENT_EPOCH],
        "after": after,
        "cost": seconds[EVENT_EPOCH] - before,
        "updates_lost": tokens - applied,
        "speed_after": before / after,
    }


def _ps_event(tmp: Path) -> dict:
    flags = tmp / "flags"
    flags.mkdir(exist_ok=True)
    out = tmp / "ps.jsonl"
    command = [
        sys.executable, "-m", "tf_diffmap.cluster", "--local", "workers=2,ps=1",
        "--max-restarts", "1", "--", sys.executable, "-c", CHIEF, "ps", str(out), str(flags),
    ]  # fmt: skip
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TMPDIR=str(tmp))
    supervisor = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    ps_pid = None
    for line in supervisor.stdout:
        if line.startswith("ps 0 "):
            ps_pid = int(line.rsplit("pid", 1)[1])
            break
    while not (flags / "asked").exists():
        if supervisor.poll() is not None:
            raise RuntimeError("the supervised run ended before the ps was killed")
        time.sleep(0.05)
    os.kill(ps_pid, 9)  # the ps that this run's supervisor started, as a crash
    (flags / "killed").touch()
    supervisor.stdout.read()
    if supervisor.wait(timeout=600) != 0:
        raise RuntimeError("the supervised run failed")
    lost, resumed = [json.loads(line) for line in out.read_text().splitlines()]
    resumed_epoch = resumed["epochs"][0]
    return {
        "to_new_chief": resumed["started"] - lost["killed_at"],
        "to_resumed_epoch_end": resumed["epoch_ended"][str(resumed_epoch)] - lost["killed_at"],
        "updates_lost": lost["updates_lost"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_table")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument(
        "--events",
        default="kill_worker,pause_worker,ps",
        help="which events, comma-separated (default: all three)",
    )
    args = parser.parse_args(argv)
    rows = {event: [] for event in args.events.split(",")}
    with tempfile.TemporaryDirectory(prefix="fault_table_") as tmp:
        for repeat in range(args.repeats):
            for event in rows:
                folder = Path(tmp) / f"{event}-{repeat}"
                folder.mkdir()
                result = _ps_event(folder) if event == "ps" else _worker_event(event, folder)
                rows[event].append(result)
    med = lambda key, event: statistics.median(r[key] for r in rows[event])  # noqa: E731
    lines = [
        f"Short epochs ({STEPS} steps of batch 32, 2 workers + 1 ps on localhost), event at "
        f"the start of epoch {EVENT_EPOCH} of {EPOCHS}; medians of {args.repeats} run(s).",
        "",
        "| Event | Epoch before (s) | Event's epoch (s) | Epoch after (s) | Cost (s) "
        "| Updates lost | Speed after / before |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for event, name in (("kill_worker", "kill worker 1"), ("pause_worker", "pause worker 1 4 s")):
        if not rows.get(event):
            continue
        lines.append(
            f"| {name} | {med('before', event):.2f} | {med('event_epoch', event):.2f} "
            f"| {med('after', event):.2f} | {med('cost', event):.2f} "
            f"| {med('updates_lost', event):.0f} | {med('speed_after', event):.2f}x |"
        )
    if rows.get("ps"):
        lines.append(
            "| kill and restart the ps (supervisor) | | | "
            f"| {med('to_resumed_epoch_end', 'ps'):.1f} "
            f"(new chief after {med('to_new_chief', 'ps'):.1f}) "
            f"| {med('updates_lost', 'ps'):.0f} | |"
        )
    lines += [
        "",
        "Partitioning a worker or the ps is not in the table: tests/test_stalls_cluster.py "
        "checks its bounds (a relay in a process of its own, `PartitionProxy(..., "
        "subprocess=True)`). ParameterServerStrategy (tf-keras) was not run on these events.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
