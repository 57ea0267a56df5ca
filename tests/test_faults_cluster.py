"""Faults across hosts, on multi-process clusters on 127.0.0.1.

Modelled on the cases of TensorFlow's own `ParameterServerStrategy` fault
tolerance tests (`coordinator/fault_tolerance_test_base.py`): workers killed
between steps and mid-step, two workers killed, a worker that keeps failing
and restarting, a worker that rejoins, the ps killed, a chief started while a
worker is down. Each test runs a chief in a subprocess, which starts its
cluster with `LocalCluster` and kills and restarts only those processes.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from cluster_chief import chief_env, run_chief_script

from tf_diffmap.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHIEF = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import keras, numpy as np, tensorflow as tf
    from cluster_chief import pause_task, record_fit_error, toy_task
    from tf_diffmap import cluster

    scenario, workers = sys.argv[1], int(sys.argv[2])
    report = {}
    # What a user's logging shows (basicConfig's format), from the package.
    import logging
    warnings = []
    handler = logging.Handler()
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    handler.emit = lambda record: warnings.append(handler.format(record))
    logging.getLogger("tf_diffmap").addHandler(handler)
    with cluster.LocalCluster(workers=workers, ps=1) as local:
        options = {"worker_timeout": PAUSE_TIMEOUT} if scenario == "paused" else {}
        strategy = cluster.strategy_for_cluster(local.resolver(), **options)
        x, y, model = toy_task(strategy, 2048)
        steps_by_epoch = []

        class Faults(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                epoch = len(steps_by_epoch)
                if scenario == "mid_step" and (epoch, batch) == (0, 10):
                    # From another thread, while the loops apply shards.
                    threading.Timer(0.05, local.kill, ("worker", workers - 1)).start()
                if scenario == "two_workers" and (epoch, batch) == (0, 10):
                    local.kill("worker", 1)
                    local.kill("worker", 2)
                if scenario == "flapping" and batch in (5, 25, 45) and epoch < 3:
                    if local.is_running("worker", 1):
                        local.kill("worker", 1)
                    if batch == 45:
                        local.restart("worker", 1)
                        # Rejoined before the next epoch kills it again: the
                        # rejoiner looks once a second, and a forked server
                        # serves sooner than that.
                        deadline = time.monotonic() + 60
                        while strategy.replica_states()[1].state in ("lost", "rejoining"):
                            assert time.monotonic() < deadline, strategy.replica_states()
                            time.sleep(0.05)
                        report["rejoined"] = report.get("rejoined", 0) + 1
                if scenario.startswith("rejoin") and (epoch, batch) == (0, 10):
                    local.kill("worker", 1)
                if scenario == "lost_before_fit" and (epoch, batch) == (0, 30):
                    report["steps_before_restart"] = strategy.replica_steps()
                    local.restart("worker", 1)
                if scenario.startswith("rejoin") and (epoch, batch) == (0, 30):
                    report["steps_before_restart"] = strategy.replica_steps()
                    local.restart("worker", 1)
                if scenario == "ps" and (epoch, batch) == (1, 10):
                    report["killed_at"] = time.monotonic()
                    local.kill("ps", 0)
                if scenario == "paused" and (epoch, batch) == (1, 0):
                    # Paused, not dead: its connections stay open.
                    pause_task(local.pids[("worker", 2)])
                if scenario == "all_lost" and (epoch, batch) == (0, 10):
                    report["killed_at"] = time.monotonic()
                    local.kill("worker", 0)

            def on_epoch_begin(self, epoch, logs=None):
                report.setdefault("epoch_began", []).append(time.monotonic())
                if scenario == "paused" and epoch == 2:
                    report["steps_at_resume"] = strategy.replica_steps()
                    os.kill(local.pids[("worker", 2)], signal.SIGCONT)

            def on_epoch_end(self, epoch, logs=None):
                report.setdefault("epoch_seconds", []).append(
                    time.monotonic() - report["epoch_began"][-1]
                )
                report.setdefault("states_by_epoch", []).append(
                    [r.state for r in strategy.replica_states()]
                )
                steps_by_epoch.append(strategy.replica_steps())
                if scenario == "between_steps" and epoch == 0:
                    local.kill("worker", workers - 1)

        if scenario == "lost_before_fit":
            # Worker 1 is lost in a fit before and still down when the next starts.
            class Kill(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    if batch == 10:
                        local.kill("worker", 1)

            model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Kill()])
            report["first_fit_version"] = strategy.version
            report["states_between"] = [r.state for r in strategy.replica_states()]
        if scenario.endswith("_after_fit"):
            # A fit before: the next fit distributes its dataset anew, with
            # new pipelines on the workers.
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
            report["first_fit_version"] = strategy.version
        try:
            model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[Faults()])
            report["finished"] = True
        except Exception as error:
            record_fit_error(report, error)
        if scenario == "paused":
            os.kill(local.pids[("worker", 2)], signal.SIGCONT)  # resumed in any case
        time.sleep(1.5)  # the idle monitor's second
        # Training's threads, not the LocalCluster's (its launcher's reader
        # lives as long as the cluster).
        report["threads"] = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith("tf_diffmap") and t.name != "tf_diffmap-launcher"
        ]
        if scenario not in ("ps",):
            stats = strategy.statistics()
            report["version"] = strategy.version
            report["claims"] = int(stats.updates.sum() + stats.dropped.sum())
            report["abandoned"] = stats.abandoned
            report["steps"] = strategy.replica_steps()
        report["steps_by_epoch"] = steps_by_epoch
        report["states"] = [
            (r.state, r.lost, r.error is not None) for r in strategy.replica_states()
        ]
    report["warnings"] = warnings
    print(json.dumps(report))
    os._exit(0)  # a lost ps leaves the runtime's own threads behind
    """
)

EPOCHS, BATCHES = 4, 2048 // 32
PAUSE_TIMEOUT = 5.0


def run_chief(scenario: str, workers: int, tmp_path, timeout=240, log_level="3") -> dict:
    return run_chief_script(
        f"PAUSE_TIMEOUT = {PAUSE_TIMEOUT}\n{CHIEF}",
        tmp_path,
        scenario,
        str(workers),
        timeout=timeout,
        log_level=log_level,
        with_stderr=True,
    )


def check_counts(report: dict, replicas: int) -> None:
    """Every token was completed once or abandoned once: never both, never twice.

    A token whose step was cut off before it marked its claim ran again on
    a live replica; one cut off after is abandoned, with its claim.
    """
    assert sum(report["steps"]) + report["abandoned"] == EPOCHS * BATCHES * replicas
    assert report["version"] == sum(report["steps"]) + report["abandoned"]
    assert report["version"] - report["abandoned"] <= report["claims"] <= report["version"]
    assert report["threads"] == []


@pytest.mark.parametrize("scenario", ["between_steps", "mid_step"])
def test_a_killed_worker_costs_no_update_and_training_goes_on(scenario, tmp_path):
    # With the runtime's errors shown (TF_CPP_MIN_LOG_LEVEL=2, as a user has it).
    report = run_chief(scenario, 2, tmp_path, log_level="2")
    assert report.get("finished"), report
    check_counts(report, 2)
    # The survivor did the work of the epochs after the loss.
    first, last = report["steps_by_epoch"][0], report["steps_by_epoch"][-1]
    assert last[1] - first[1] <= 2 * BATCHES // 10
    assert last[0] - first[0] >= (EPOCHS - 1) * BATCHES * 2 - 2 * BATCHES // 10
    assert report["states"][1][:2] == ["lost", 1] and report["states"][1][2]
    # One warning names the lost worker, with one prefix, as basicConfig shows it.
    lost = [w for w in report["warnings"] if "unreachable" in w]
    assert len(lost) == 1, report["warnings"]
    assert lost[0].startswith("WARNING:tf_diffmap:worker /job:worker/replica:0/task:1 "), lost
    assert lost[0].count("tf_diffmap") == 1, lost
    if scenario == "between_steps":
        # Lost after an epoch, once everything the package runs on its
        # fault path is known to every task: the runtime has nothing of the
        # package's to send the lost worker (register or remove).
        assert "function remotely" not in report["stderr"], report["stderr"][-4000:]


def test_two_workers_killed_leave_one_that_trains(tmp_path):
    report = run_chief("two_workers", 3, tmp_path)
    assert report.get("finished"), report
    check_counts(report, 3)
    assert [s[0] for s in report["states"]] == ["stopped", "lost", "lost"]


def test_a_worker_that_keeps_failing_and_restarting(tmp_path):
    report = run_chief("flapping", 2, tmp_path)
    assert report.get("finished"), [report.get(k) for k in ("message", "runtime_error", "stderr")]
    check_counts(report, 2)
    # Killed while it trained in each of three epochs, back each time.
    assert report["rejoined"] == 3, report
    assert report["states"][1] == ["stopped", 3, False], report


def test_a_restarted_worker_rejoins_and_trains_again(tmp_path):
    report = run_chief("rejoin", 2, tmp_path)
    assert report.get("finished"), report
    check_counts(report, 2)
    before = report["steps_before_restart"][1]
    assert report["steps"][1] > before + BATCHES // 4, report
    assert report["states"][1][0] == "stopped" and report["states"][1][1] == 1


def test_a_worker_restarted_during_a_second_fit_rejoins(tmp_path):
    # The second fit's pipelines are new: the rejoined worker's loop reads
    # the rebuilt pipeline of the dataset this fit iterates.
    report = run_chief("rejoin_after_fit", 2, tmp_path)
    assert report.get("finished"), report
    assert report["first_fit_version"] == BATCHES * 2
    assert sum(report["steps"]) + report["abandoned"] == (EPOCHS + 1) * BATCHES * 2
    assert report["version"] == sum(report["steps"]) + report["abandoned"]
    before = report["steps_before_restart"][1]
    assert report["steps"][1] > before + BATCHES // 4, report
    assert report["states"][1][0] == "stopped" and report["states"][1][1] == 1, report


def test_a_fit_started_while_a_worker_is_down_trains_and_the_worker_rejoins(tmp_path):
    """A worker lost in one fit and still down when the next starts: that fit
    builds input on the live workers only, trains on them, and builds the
    lost worker's input when it is restarted and rejoins."""
    report = run_chief("lost_before_fit", 2, tmp_path)
    assert report.get("finished"), report
    assert report["states_between"] == ["stopped", "lost"]
    assert report["first_fit_version"] >= BATCHES * 2 - 2
    before = report["steps_before_restart"]
    assert before[1] <= BATCHES // 2, report  # lost until restarted
    assert report["steps"][1] > before[1] + BATCHES // 4, report  # trains again
    assert report["states"][1][0] == "stopped" and report["states"][1][1] == 1, report
    assert sum(report["steps"]) + report["abandoned"] == (EPOCHS + 1) * BATCHES * 2
    assert report["version"] == sum(report["steps"]) + report["abandoned"]


def test_a_paused_worker_is_lost_past_the_timeout_and_rejoins_when_it_resumes(tmp_path):
    """Worker 2 of 3 is stopped (SIGSTOP) at the start of epoch 1 and resumed
    (SIGCONT) at the start of epoch 2: epoch 1 ends on the others within
    `worker_timeout` of their own work, worker 2 is reported lost with one
    warning, and it trains again once resumed; no update is lost or doubled."""
    report = run_chief("paused", 3, tmp_path)
    assert report.get("finished"), report
    check_counts(report, 3)
    first, paused = report["epoch_seconds"][:2]
    # The others' work of epoch 1 (a third more each), the timeout, and
    # room for a busy host.
    assert paused < 2 * first + PAUSE_TIMEOUT + 10.0, report["epoch_seconds"]
    assert report["states_by_epoch"][1][2] == "lost", report["states_by_epoch"]
    hung = [w for w in report["warnings"] if "did not answer" in w]
    assert len(hung) == 1, report["warnings"]
    assert hung[0].startswith("WARNING:tf_diffmap:worker /job:worker/replica:0/task:2 "), hung
    assert not [w for w in report["warnings"] if "unreachable" in w], report["warnings"]
    assert report["states_by_epoch"][-1][2] != "lost", report["states_by_epoch"]
    assert report["steps"][2] > report["steps_at_resume"][2] + BATCHES // 4, report
    assert report["states"][2][:2] == ["stopped", 1], report["states"]


def test_a_killed_ps_is_an_unavailable_error_naming_it(tmp_path):
    report = run_chief("ps", 2, tmp_path)
    assert report["raised"] == "UnavailableError", report
    message = report["message"]
    assert "/job:ps/replica:0/task:0" in message
    assert "BackupAndRestore" in message and "Restart that ps task" in message
    assert len(message) < 600
    assert report["seconds"] < 15
    assert report["threads"] == []
    # The runtime's own error, with the remote details, is kept on the error.
    kind, details = report["runtime_error"]
    assert kind != "NoneType" and "/job:ps/replica:0/task:0" in details


def test_every_replica_lost_is_a_clear_error(tmp_path):
    report = run_chief("all_lost", 1, tmp_path)
    assert report["raised"] == "UnavailableError", report
    assert "Every replica is lost" in report["message"]
    assert "/job:worker/replica:0/task:0" in report["message"]
    assert report["seconds"] < 15
    assert report["threads"] == []


DOWN = textwrap.dedent(
    """
    import json, sys, time
    import tensorflow as tf
    from tf_diffmap import cluster

    with cluster.LocalCluster(workers=2, ps=1) as local:
        local.kill("worker", 1)
        start = time.monotonic()
        try:
            cluster.strategy_for_cluster(local.resolver(), connect_timeout=3)
            print(json.dumps({"connected": True}))
        except tf.errors.UnavailableError as error:
            print(json.dumps({"message": str(error), "seconds": time.monotonic() - start,
                              "address": local.cluster_spec["worker"][1]}))
    """
)


def test_a_chief_started_while_a_worker_is_down_fails_in_bounded_time(tmp_path):
    report = run_chief_script(DOWN, tmp_path, timeout=120)
    assert "/job:worker/replica:0/task:1" in report["message"], report
    assert report["address"] in report["message"]
    assert "/job:worker/replica:0/task:0" not in report["message"]
    assert "connect_timeout" in report["message"]
    assert 3 <= report["seconds"] < 15


# A chief of its own cluster's ps-loss-and-resume run: the test owns the
# LocalCluster (so that the ps can be restarted between two chiefs); the chief
# asks the test to kill the ps (a line on stdout) and waits until it is gone.
RESUMING_CHIEF = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    import keras, numpy as np, tensorflow as tf
    from cluster_chief import record_fit_error, toy_task
    from tf_diffmap import cluster

    phase, backup_dir, killed_flag = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    strategy = cluster.strategy_for_cluster()
    x, y, model = toy_task(strategy, 2048)
    report = {"epochs": [], "weights_at_begin": {}, "weights_at_end": {}}

    def weights():
        return [w.tolist() for w in model.get_weights()]

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            report["epochs"].append(epoch)
            report["weights_at_begin"][epoch] = weights()

        def on_epoch_end(self, epoch, logs=None):
            report["weights_at_end"][epoch] = weights()

        def on_train_batch_end(self, batch, logs=None):
            if phase == "kill" and (report["epochs"][-1], batch) == (2, 10):
                print("KILL_PS", flush=True)
                deadline = time.monotonic() + 60
                while not killed_flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                report["killed_at"] = time.monotonic()

    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), Record()]
    try:
        model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=callbacks)
        report["finished"] = True
        report["version"] = strategy.version
    except Exception as error:
        record_fit_error(report, error)
    print(json.dumps(report), flush=True)
    os._exit(0)  # a lost ps leaves the runtime's own threads behind
    """
)


def run_resuming_chief(local, phase: str, tmp_path) -> dict:
    """Runs one chief of `local` (a process of this test) to its end; its report.

    In the "kill" phase the chief asks for the ps to be killed mid-fit; the
    ps is killed here, by the cluster that started it.
    """
    killed_flag = tmp_path / f"{phase}.killed"
    with open(tmp_path / f"chief-{phase}.err", "wb") as err:
        chief = subprocess.Popen(
            [
                sys.executable,
                "-c",
                RESUMING_CHIEF,
                phase,
                str(tmp_path / "backup"),
                str(killed_flag),
            ],
            env=chief_env(tmp_path, TF_CONFIG=local.tf_config("chief", 0)),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        lines = []
        for line in chief.stdout:
            lines.append(line)
            if line.startswith("KILL_PS"):
                local.kill("ps", 0)
                killed_flag.touch()
        assert chief.wait(timeout=60) == 0, (tmp_path / f"chief-{phase}.err").read_text()[-4000:]
    finally:
        if chief.poll() is None:
            chief.kill()  # our own child, by its handle
            chief.wait()
    return json.loads(lines[-1])


def test_a_killed_ps_is_restarted_and_backup_and_restore_resumes_at_its_epoch(tmp_path):
    with LocalCluster(workers=2, ps=1, log_dir=tmp_path / "servers") as local:
        first = run_resuming_chief(local, "kill", tmp_path)
        assert first["raised"] == "UnavailableError", first
        assert "/job:ps/replica:0/task:0" in first["message"]
        assert first["seconds"] < 15
        assert first["epochs"] == [0, 1, 2]  # killed during epoch 2
        assert "/job:ps/replica:0/task:0" in first["runtime_error"][1]
        assert not local.is_running("ps", 0)

        local.restart("ps", 0)  # the same address, a fresh server
        second = run_resuming_chief(local, "resume", tmp_path)

    assert second.get("finished"), second
    # BackupAndRestore saved after epochs 0 and 1: the new chief starts at 2 ...
    assert second["epochs"] == [2, 3]
    # ... from the weights the first chief had trained to by then, not fresh ones,
    for restored, saved in zip(second["weights_at_begin"]["2"], first["weights_at_end"]["1"]):
        np.testing.assert_allclose(restored, saved, rtol=1e-6)
    # and it trains the two epochs that were left (one update per token).
    assert second["version"] == 2 * BATCHES * 2
    assert not (tmp_path / "backup").exists()  # deleted once training finished
