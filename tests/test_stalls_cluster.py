"""Tasks that hang, on multi-process clusters on 127.0.0.1: no task stalls the run.

A worker or the ps is paused (SIGSTOP) or cut off by a partition (a
`PartitionProxy` in a process of its own at the task's address, relaying to
the port it listens on, that starts dropping everything without closing a
connection), and never comes back while the test runs. A hung
worker costs `worker_timeout` once: `fit` with validation, `evaluate`,
`predict`, `save` and a second `fit` all finish, and the chief's other
Python threads run throughout. A hung ps ends training within
`ps_timeout` and a probe, with an error that names it. Each test's chief
runs in a subprocess that starts its cluster with `LocalCluster`, pauses
only those processes and stops them by their handles.
"""

import textwrap

import pytest
from cluster_chief import run_chief_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCENARIOS = ["paused", "partitioned"]
WORKER_TIMEOUT, PS_TIMEOUT = 5.0, 8.0

CHIEF = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import keras, numpy as np, tensorflow as tf
    from cluster_chief import pause_task, toy_task
    from tf_diffmap import cluster

    scenario, job = sys.argv[1], sys.argv[2]  # "paused" or "partitioned"; "worker" or "ps"
    index = 1 if job == "worker" else 0
    report = {"warnings": []}
    import logging
    handler = logging.Handler()
    handler.emit = lambda record: report["warnings"].append(record.getMessage())
    logging.getLogger("tf_diffmap").addHandler(handler)
    # Ticks of a thread of the chief: a gap means that its Python stood still.
    ticks = []
    def tick():
        while True:
            ticks.append(time.monotonic())
            time.sleep(0.25)
    threading.Thread(target=tick, daemon=True).start()

    def longest_gap(since):
        seen = [t for t in ticks if t >= since]
        return max((b - a for a, b in zip(seen, seen[1:])), default=None)

    # Partitioned: the task listens at a port of its own, and a proxy at its
    # address in the cluster relays every connection to it until it drops
    # (from a process of its own, as a partition is outside the chief).
    hidden = cluster.local.free_ports(1)[0]
    ports = {(job, index): hidden} if scenario == "partitioned" else {}
    local = cluster.LocalCluster(workers=2, ps=1, listen_ports=ports)
    proxy = None
    if scenario == "partitioned":
        port = int(local.cluster_spec[job][index].rpartition(":")[2])
        proxy = cluster.PartitionProxy(f"127.0.0.1:{hidden}", port=port, subprocess=True).start()
    with local:
        strategy = cluster.strategy_for_cluster(
            local.resolver(), worker_timeout=WORKER_TIMEOUT, ps_timeout=PS_TIMEOUT
        )
        x, y, model = toy_task(strategy, 2048)
        pid = local.pids[(job, index)]

        def hang():
            report["hung_at"] = time.monotonic()
            if proxy is not None:
                proxy.drop()
            else:
                pause_task(pid)

        class Hang(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                report.setdefault("epoch_began", []).append(time.monotonic())
                if epoch == 1:
                    hang()

        seconds = {}
        try:
            start = time.monotonic()
            model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Hang()],
                      validation_data=(x[:256], y[:256]))
            seconds["fit"] = time.monotonic() - start
            # A timer of the chief, due while the calls below run.
            fired = []
            due = time.monotonic() + 2.0
            threading.Timer(2.0, lambda: fired.append(time.monotonic() - due)).start()
            after = time.monotonic()
            for name, call in [
                ("evaluate", lambda: model.evaluate(x, y, verbose=0)),
                ("predict", lambda: model.predict(x[:64], verbose=0)),
                ("save", lambda: model.save(os.path.join(os.environ["TMPDIR"], "m.keras"))),
                ("fit_again", lambda: model.fit(x, y, batch_size=32, epochs=1, verbose=0)),
            ]:
                start = time.monotonic()
                call()
                seconds[name] = time.monotonic() - start
            while not fired and time.monotonic() < due + 30:
                time.sleep(0.05)
            report["timer_late"] = fired[0] if fired else None
            report["longest_gap"] = longest_gap(after)
            report["finished"] = True
        except Exception as error:
            report["raised"] = type(error).__name__
            report["message"] = str(error)
            report["seconds_after_hang"] = time.monotonic() - report["hung_at"]
            report["longest_gap"] = longest_gap(report["hung_at"])
        report["seconds"] = seconds
        report["states"] = [r.state for r in strategy.replica_states()]
        if proxy is None:
            os.kill(pid, signal.SIGCONT)  # so that the cluster can stop it
        else:
            proxy.close()
    print(json.dumps(report), flush=True)
    os._exit(0)  # hung calls leave the runtime's threads behind
    """
)


def run_chief(scenario: str, job: str, tmp_path) -> dict:
    source = f"WORKER_TIMEOUT, PS_TIMEOUT = {WORKER_TIMEOUT}, {PS_TIMEOUT}\n{CHIEF}"
    return run_chief_script(source, tmp_path, scenario, job, timeout=360)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_worker_that_never_answers_stalls_nothing(scenario, tmp_path):
    report = run_chief(scenario, "worker", tmp_path)
    assert report.get("finished"), report
    # The hang cost worker_timeout once, in epoch 1 (with room for a busy host).
    seconds = report["seconds"]
    assert seconds["fit"] < 60, seconds
    for name in ("evaluate", "predict", "save", "fit_again"):
        assert seconds[name] < 30, seconds
    # The chief's Python ran throughout: its timer fired on time, and a
    # thread that ticks every 0.25 s never stood still for long.
    assert report["timer_late"] is not None and report["timer_late"] < 2.0, report
    assert report["longest_gap"] < 3.0, report
    assert report["states"][1] == "lost", report["states"]
    hung = [w for w in report["warnings"] if "did not answer" in w]
    assert hung and "/job:worker/replica:0/task:1" in hung[0], report["warnings"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_ps_that_never_answers_ends_training_with_an_error_naming_it(scenario, tmp_path):
    report = run_chief(scenario, "ps", tmp_path)
    assert report.get("raised") == "UnavailableError", report
    message = report["message"]
    assert "/job:ps/replica:0/task:0" in message and "ps_timeout" in message, message
    assert "BackupAndRestore" in message, message
    # ps_timeout, a probe of at most 5 s, and room for a busy host.
    assert report["seconds_after_hang"] < PS_TIMEOUT + 5 + 30, report
    assert report["longest_gap"] < 3.0, report
    # No worker was blamed for the ps.
    assert not [w for w in report["warnings"] if "worker_timeout" in w], report["warnings"]
