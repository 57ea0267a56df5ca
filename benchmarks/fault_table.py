"""A table of faults on short epochs: what each costs in seconds and updates.

`python -m benchmarks.fault_table [--repeats N] [--out FILE]` trains a
digits-shaped MLP (64-128-10, Adam, batch 32) on a localhost cluster of 2
workers and 1 ps, in epochs of about a second, and at the start of epoch
3 of 8 makes one event happen:

- `kill worker`: worker 1 gets SIGKILL and stays down;
- `pause worker`: worker 1 gets SIGSTOP for twice `worker_timeout` (2 s);
- `partition worker`: a relay at worker 1's address (a process of its own,
  `PartitionProxy(..., subprocess=True)`) drops everything from then on,
  closing no connection, and never heals;
- `kill and restart ps`: the ps gets SIGKILL; the supervisor of `--local`
  starts it and the training script again, which resumes by
  `BackupAndRestore`.

Each run is a chief in a subprocess of its own, which stops only the
processes its `LocalCluster` started. For the worker events the table
gives the epochs' median time before and after, the event's epoch, and
updates lost (tokens the epoch counted but no replica applied, which is
`steps - version`); for the ps, the time from the kill to the end of the
epoch the second run resumed at, and the updates of the interrupted epoch.
With `--tf-keras-python PYTHON` (an environment with TensorFlow and
tf-keras; `python -m benchmarks` says how to make one), the same model, data
and events run under `tf.distribute.experimental.ParameterServerStrategy`
(Keras' `fit` of tf-keras, 2 workers and 1 ps as plain servers,
`benchmarks.servers`): one update per batch of 32, so its updates lost are
`steps - iterations`; the ps event there is a kill without a supervisor
(ParameterServerStrategy asks its users to restart the job): the row gives
the time from the kill to `fit`'s error. A ParameterServerStrategy run
that has not finished `HANG_LIMIT` s after the event is stopped and counted
as hung (it has no timeout of its own for a task that hangs).
"""

from __future__ import annotations

import argparse
import functools
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
# Seconds after an event that ParameterServerStrategy's run is given before
# it counts as hung (it has no timeout of its own for a task that hangs).
HANG_LIMIT = 60
EVENTS = ("kill_worker", "pause_worker", "partition_worker", "ps")
WORKER_EVENTS = {
    "kill_worker": "kill worker 1",
    "pause_worker": "pause worker 1 4 s",
    "partition_worker": "partition worker 1 for good",
}

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
                elif event == "partition_worker":
                    proxy.drop()

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

    # Partitioned: worker 1 listens at a port of its own, behind a relay (a
    # process of its own) at its address, which drops everything for good.
    listen, proxy = {{}}, None
    if event == "partition_worker":
        hidden = cluster.local.free_ports(1)[0]
        listen = {{("worker", 1): hidden}}
    local = cluster.LocalCluster(workers=2, ps=1, listen_ports=listen)
    if listen:
        port = int(local.cluster_spec["worker"][1].rpartition(":")[2])
        proxy = cluster.PartitionProxy(f"127.0.0.1:{{hidden}}", port=port, subprocess=True)
        proxy.start()
    with local:
        strategy = cluster.strategy_for_cluster(local.resolver(), worker_timeout=2.0)
        model = model_for(strategy)
        model.fit(x, y, batch_size=32, epochs=EPOCHS, verbose=0,
                  callbacks=[Times(strategy, local)])
        run["abandoned"] = strategy.statistics().abandoned
        run["replicas"] = len(strategy.replica_devices)
    if proxy is not None:
        proxy.close()
    with open(out, "w") as f:
        f.write(json.dumps(run))
    os._exit(0)
    """
).format(epochs=EPOCHS, event_epoch=EVENT_EPOCH, steps=STEPS)


PSS_CHIEF = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import numpy as np, tensorflow as tf  # tf.keras is tf-keras: TF_USE_LEGACY_KERAS=1
    from benchmarks.servers import LocalServers

    event, out = sys.argv[1], sys.argv[2]
    EPOCHS, EVENT_EPOCH, STEPS = {epochs}, {event_epoch}, {steps}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 32, 64)).astype("float32")
    y = rng.integers(0, 10, size=STEPS * 32).astype("int32")
    run = {{"epoch_seconds": [], "versions": [], "replicas": 1}}

    def report():
        with open(out, "w") as f:
            f.write(json.dumps(run))

    def watchdog():
        # ParameterServerStrategy has no timeout of its own for a task that
        # does not answer: give up HANG_LIMIT s after the event.
        while "event_at" not in run:
            time.sleep(0.1)
        while time.monotonic() < run["event_at"] + {hang_limit}:
            if "finished" in run or "raised" in run:
                return
            time.sleep(0.2)
        run["hung_for"] = {hang_limit}
        report()
        os._exit(0)  # the servers and the relay end with this process's pipes

    threading.Thread(target=watchdog, daemon=True).start()
    listen, proxy = {{}}, None
    if event == "partition_worker":
        from tf_diffmap.cluster import PartitionProxy
        from tf_diffmap.cluster.local import free_ports
        hidden = free_ports(1)[0]
        listen = {{("worker", 1): hidden}}
    servers = LocalServers(workers=2, ps=1, env={{"CUDA_VISIBLE_DEVICES": ""}},
                           listen_ports=listen)
    if listen:
        port = int(servers.cluster_spec["worker"][1].rpartition(":")[2])
        proxy = PartitionProxy(f"127.0.0.1:{{hidden}}", port=port, subprocess=True).start()
    with servers:
        worker_1, ps_0 = servers.pids[1], servers.pids[2]
        strategy = tf.distribute.experimental.ParameterServerStrategy(servers.resolver())
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((64,)),
                                         tf.keras.layers.Dense(128, activation="relu"),
                                         tf.keras.layers.Dense(10)])
            model.compile(optimizer="adam",
                          loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

        class Times(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.began = time.monotonic()
                if epoch == EVENT_EPOCH:
                    run["event_at"] = time.monotonic()
                    if event == "kill_worker":
                        os.kill(worker_1, signal.SIGKILL)
                    elif event == "pause_worker":
                        os.kill(worker_1, signal.SIGSTOP)
                        threading.Timer(4.0, os.kill, (worker_1, signal.SIGCONT)).start()
                    elif event == "ps":
                        os.kill(ps_0, signal.SIGKILL)
                    elif event == "partition_worker":
                        proxy.drop()

            def on_epoch_end(self, epoch, logs=None):
                run["epoch_seconds"].append(time.monotonic() - self.began)
                run["versions"].append(int(self.model.optimizer.iterations.numpy()))

        try:
            model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[Times()])
            run["finished"] = True
        except Exception as error:
            run["raised"] = type(error).__name__
            run["to_error"] = time.monotonic() - run["event_at"]
    if proxy is not None:
        proxy.close()
    report()
    os._exit(0)
    """
).format(epochs=EPOCHS, event_epoch=EVENT_EPOCH, steps=STEPS, hang_limit=HANG_LIMIT)


def _pss_event(event: str, tmp: Path, python: str) -> dict:
    """One event under ParameterServerStrategy, in tf-keras' environment."""
    out = tmp / f"pss-{event}.json"
    root = str(Path(__file__).resolve().parents[1])
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        TMPDIR=str(tmp),
        TF_USE_LEGACY_KERAS="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    )
    subprocess.run(
        [python, "-c", PSS_CHIEF, event, str(out)], env=env, check=True, timeout=900, cwd=root
    )
    run = json.loads(out.read_text())
    if event == "ps":
        return {"raised": run.get("raised"), "to_error": run.get("to_error")}
    if "hung_for" in run:
        return {"hung_for": run["hung_for"], "epochs_done": len(run["epoch_seconds"])}
    return _epoch_figures(run)


def _epoch_figures(run: dict) -> dict:
    """Epoch times around the event, and updates lost in its epoch."""
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


def _worker_event(event: str, tmp: Path) -> dict:
    out = tmp / f"{event}.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TMPDIR=str(tmp))
    subprocess.run([sys.executable, "-c", CHIEF, event, str(out)], env=env, check=True, timeout=600)
    return _epoch_figures(json.loads(out.read_text()))


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
        default=",".join(EVENTS),
        help=f"which events, comma-separated (default: all of {', '.join(EVENTS)})",
    )
    parser.add_argument(
        "--tf-keras-python",
        default=None,
        metavar="PYTHON",
        help="also run ParameterServerStrategy (tf-keras) with this interpreter",
    )
    args = parser.parse_args(argv)
    events = args.events.split(",")
    unknown = sorted(set(events) - set(EVENTS))
    if unknown:
        parser.error(f"unknown events {unknown}; choose from {', '.join(EVENTS)}.")
    strategies = ["tf_diffmap"] + (["pss"] if args.tf_keras_python else [])
    rows = {(strategy, event): [] for strategy in strategies for event in events}
    with tempfile.TemporaryDirectory(prefix="fault_table_") as tmp:
        for repeat in range(args.repeats):
            # Side by side: each event under each strategy before the next event.
            for event in events:
                for strategy in strategies:
                    folder = Path(tmp) / f"{strategy}-{event}-{repeat}"
                    folder.mkdir()
                    if strategy == "pss":
                        result = _pss_event(event, folder, args.tf_keras_python)
                    elif event == "ps":
                        result = _ps_event(folder)
                    else:
                        result = _worker_event(event, folder)
                    print(strategy, event, json.dumps(result), flush=True)
                    rows[strategy, event].append(result)
    text = _table(rows, events, strategies, args.repeats)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


NAMES = {"tf_diffmap": "tf_diffmap", "pss": "ParameterServerStrategy (tf-keras)"}


def _table(rows: dict, events: list[str], strategies: list[str], repeats: int) -> str:
    def med(strategy, event, key):
        values = [r[key] for r in rows[strategy, event] if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    lines = [
        f"Short epochs ({STEPS} steps of batch 32, 2 workers + 1 ps on localhost), event at "
        f"the start of epoch {EVENT_EPOCH} of {EPOCHS}; medians of {repeats} run(s).",
        "",
        "| Event | Strategy | Epoch before (s) | Event's epoch (s) | Epoch after (s) | Cost (s) "
        "| Updates lost | Speed after / before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for event, name in WORKER_EVENTS.items():
        if event not in events:
            continue
        for strategy in strategies:
            m = functools.partial(med, strategy, event)
            hung = [r for r in rows[strategy, event] if "hung_for" in r]
            if hung:
                lines.append(
                    f"| {name} | {NAMES[strategy]} | | | | fit did not finish: stopped "
                    f"{hung[0]['hung_for']} s after the event ({len(hung)} of "
                    f"{len(rows[strategy, event])} run(s)) | | |"
                )
                continue
            lines.append(
                f"| {name} | {NAMES[strategy]} | {m('before'):.2f} | {m('event_epoch'):.2f} "
                f"| {m('after'):.2f} | {m('cost'):.2f} | {m('updates_lost'):.0f} "
                f"| {m('speed_after'):.2f}x |"
            )
    if "ps" in events:
        m = functools.partial(med, "tf_diffmap", "ps")
        lines.append(
            "| kill the ps; the supervisor restarts it and the script | tf_diffmap | | | "
            f"| {m('to_resumed_epoch_end'):.1f} to the end of the resumed epoch "
            f"(new chief after {m('to_new_chief'):.1f}) | {m('updates_lost'):.0f} | |"
        )
        if "pss" in strategies:
            raised = sorted({str(r.get("raised")) for r in rows["pss", "ps"]})
            lines.append(
                f"| kill the ps (no supervisor) | {NAMES['pss']} | | | "
                f"| fit raised {', '.join(raised)} after {med('pss', 'ps', 'to_error'):.1f} s; "
                "a human restarts the job | | |"
            )
    lines += [
        "",
        "A partition is a relay in a process of its own at the worker's address "
        "(`PartitionProxy(..., subprocess=True)`) that drops everything without closing a "
        "connection; a partitioned ps is checked by tests/test_stalls_cluster.py, not here."
        + (
            ""
            if "pss" in strategies
            else " ParameterServerStrategy (tf-keras) was not run: pass --tf-keras-python."
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
