"""A lost ps survived without a human: the supervisor of `--local` restarts it,
and the chief it runs, which resumes by BackupAndRestore.

The test starts `python -m tf_diffmap.cluster --local ... -- python chief`,
kills the ps process it printed (SIGKILL, by that pid) when the chief asks,
and waits for the whole run to end by itself.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from cluster_chief import chief_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BATCHES = 2048 // 32

CHIEF = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    import keras, numpy as np
    from cluster_chief import toy_task
    from tf_diffmap import cluster

    backup, report_path, flags = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    first_run = not (flags / "asked").exists()
    strategy = cluster.strategy_for_cluster()
    x, y, model = toy_task(strategy, 2048)
    run = {"first": first_run, "epochs": [], "started": time.time()}

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            run["epochs"].append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            run["batches_in_epoch"] = batch + 1
            if first_run and (run["epochs"][-1], batch) == (2, 10):
                (flags / "asked").touch()
                while not (flags / "killed").exists():
                    time.sleep(0.05)
                run["killed_at"] = time.time()

    try:
        model.fit(x, y, batch_size=32, epochs=4, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), Record()])
        run["finished"] = True
        run["version"] = strategy.version
    except Exception as error:
        run["raised"] = type(error).__name__
        run["message"] = str(error)
        # Updates of the epoch that BackupAndRestore will train again.
        run["updates_lost"] = run["batches_in_epoch"] * len(strategy.replica_devices)
    run["ended"] = time.time()
    with open(report_path, "a") as f:
        f.write(json.dumps(run) + "\\n")
    os._exit(0 if run.get("finished") else 1)
    """
)


def test_a_killed_ps_is_restarted_and_the_chief_resumes_without_a_human(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    report = tmp_path / "runs.jsonl"
    command = [
        sys.executable,
        "-m",
        "tf_diffmap.cluster",
        "--local",
        "workers=2,ps=1",
        "--max-restarts",
        "1",
        "--",
        sys.executable,
        "-c",
        CHIEF,
        str(tmp_path / "backup"),
        str(report),
        str(flags),
    ]
    env = chief_env(tmp_path)
    supervisor = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines, errors = [], []
    readers = [
        threading.Thread(target=lambda: lines.extend(supervisor.stdout), daemon=True),
        threading.Thread(target=lambda: errors.extend(supervisor.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 300
        while not (flags / "asked").exists():
            assert supervisor.poll() is None, "".join(errors)[-4000:]
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        found = [re.match(r"ps 0 .* pid (\d+)", line) for line in lines]
        ps_pid = int(next(m for m in found if m).group(1))
        os.kill(ps_pid, signal.SIGKILL)  # the ps that the run started, as a crash
        (flags / "killed").touch()
        assert supervisor.wait(timeout=400) == 0, "".join(errors)[-4000:]
    finally:
        if supervisor.poll() is None:
            supervisor.terminate()  # our own child: it stops what it started
            supervisor.wait(30)
    for reader in readers:
        reader.join(5)
    runs = [json.loads(line) for line in report.read_text().splitlines()]
    said = "".join(errors)
    printed = "".join(lines)
    assert len(runs) == 2, runs
    lost, resumed = runs
    assert lost["raised"] == "UnavailableError", lost
    assert "/job:ps/replica:0/task:0" in lost["message"]
    # Killed after batch 10 of epoch 2; Keras goes on a few batches until
    # the error stops the input.
    assert 11 * 2 <= lost["updates_lost"] <= BATCHES * 2, lost
    assert resumed.get("finished"), resumed
    assert resumed["epochs"] == [2, 3]  # BackupAndRestore saved epochs 0 and 1
    assert resumed["version"] == 2 * BATCHES * 2
    # What the supervisor did, and what it cost, in its own words.
    assert "ps 0 exited; starting it again" in said, said
    assert re.search(r"ps 0 serves again \(pid \d+\) after [\d.]+ s", said), said
    assert re.search(r"chief: run 2 started \(pid \d+\), [\d.]+ s after", said), said
    assert "chief: finished after 2 run(s)" in said, said
    # Every task's TF_CONFIG is printed.
    assert printed.count("TF_CONFIG=") == 3, printed
    print(
        f"\nps killed -> error raised: {lost['ended'] - lost['killed_at']:.1f} s; "
        f"-> new chief started: {resumed['started'] - lost['killed_at']:.1f} s; "
        f"-> training finished: {resumed['ended'] - lost['killed_at']:.1f} s; "
        f"updates lost: {lost['updates_lost']}"
    )
    print([line for line in said.splitlines() if "ps 0" in line or "chief:" in line])
