"""The fault timeline's arithmetic: bins, windows, state changes and the script's clock.

Pure functions of samples, checked on made-up samples; no TensorFlow, no
cluster (the workload itself runs in `test_benchmarks_smoke.py`, marked slow).
"""

import threading
import time

import pytest

from benchmarks import timeline


def sample(t, examples, states=None, since=None, cpu=None):
    n = len(examples)
    return {
        "t": t,
        "examples": list(examples),
        "updates": [e // 10 for e in examples],
        "states": states or ["running"] * n,
        "since": since or [None] * n,
        "cpu": cpu or {},
    }


def test_bins_interpolate_between_samples_and_keep_only_covered_bins():
    samples = [sample(0.5, [0, 0]), sample(1.5, [100, 50]), sample(3.2, [270, 50])]
    rows = timeline.bins(samples)
    # Bins [1, 2) and [2, 3): [0, 1) starts before the first sample, [3, 4) ends after the last.
    assert [r["start"] for r in rows] == [1.0, 2.0]
    assert rows[0]["replica_examples_per_second"] == pytest.approx([100.0, 25.0])
    assert rows[1]["replica_examples_per_second"] == pytest.approx([100.0, 0.0])
    assert rows[1]["examples_per_second"] == pytest.approx(100.0)


def test_cpu_cores_per_process_host_and_the_rest_of_the_host():
    def cpu(t, worker_pid, worker_seconds):
        return {
            "chief": [1, 0.5 * t],
            "worker 0": [worker_pid, worker_seconds],
            timeline.HOST: [0, 1.5 * t],
        }

    samples = [
        sample(0.0, [0], cpu=cpu(0.0, 10, 0.0)),
        sample(1.0, [0], cpu=cpu(1.0, 10, 0.25)),
        sample(2.0, [0], cpu=cpu(2.0, 10, 0.5)),
        # Restarted: a new pid whose counter starts again near zero.
        sample(3.0, [0], cpu=cpu(3.0, 11, 0.1)),
        sample(4.0, [0], cpu=cpu(4.0, 11, 0.3)),
    ]
    rows = timeline.bins(samples)
    cores = [r["cpu_cores"] for r in rows]
    assert [c["chief"] for c in cores] == pytest.approx([0.5] * 4)
    assert [c["worker 0"] for c in cores] == [0.25, 0.25, None, pytest.approx(0.2)]
    assert cores[0][timeline.OTHERS] == pytest.approx(1.5 - 0.5 - 0.25)


def test_cpu_of_a_window_sums_its_processes_per_update_and_per_example():
    import os
    import subprocess
    import sys

    # A child that spins for a moment of CPU when told to, and says when it
    # is done: the window holds the whole spin however busy the host is.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\n"
            "time.sleep(30)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [os.getpid(), child.pid]
        start = timeline.processes_cpu_seconds(pids)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"
        end = timeline.processes_cpu_seconds(pids)
        assert end - start >= 0.25  # the child's spin, at the clock's ticks
        work = timeline.cpu_per_work(start, end, len(pids), updates=10, examples=640)
        assert work["cpu_processes"] == 2
        assert work["cpu_ms_per_update"] == pytest.approx(100 * (end - start))
        assert work["cpu_ms_per_1000_examples"] == pytest.approx(1e6 * (end - start) / 640)
    finally:
        child.kill()
        child.wait()
    # A process gone, or a window without work: nothing to report.
    assert timeline.processes_cpu_seconds([os.getpid(), child.pid]) is None
    assert timeline.cpu_per_work(None, 1.0, 2, 10, 640) == {}
    assert timeline.cpu_per_work(0.0, 1.0, 2, 0, 0) == {}


def test_summarize_reads_each_window_and_the_delays():
    # 3 replicas at 100 examples/s each; replica 2 stops at t=10 and starts again at 22.
    samples, done = [], [0, 0, 0]
    for i in range(0, 121):
        t = i * 0.25
        if i:
            for r in range(3):
                if r < 2 or t <= 10 or t > 22.5:
                    done[r] += 25
        states = ["running", "running", "lost" if 10 < t <= 22 else "running"]
        since = [None, None, 10.2 if t <= 22 else 22.0] if t > 10 else None
        samples.append(sample(t, done, states, since))
    rows = timeline.bins(samples)
    events = {"kill": 10.0, "restart": 15.0, "serving": 21.0, "finish": 30.0}
    events.update(timeline.state_changes(samples, [2]))
    assert events["lost"] == 10.2 and events["rejoined"] == 22.0
    out = timeline.summarize(rows, events, [2], samples, warmup=2.0, settle=2.0)
    assert out["before_examples_per_second"] == pytest.approx(300.0)
    assert out["outage_share"] == pytest.approx(2 / 3)
    assert out["after_share"] == pytest.approx(1.0)
    assert out["windows"]["before"]["bins"] == 8  # [2, 10)
    assert out["windows"]["outage"]["bins"] == 5  # [10, 15)
    assert out["windows"]["after"]["bins"] == 6  # [24, 30)
    assert out["windows"]["outage"]["replica_examples_per_second"] == pytest.approx(
        [100.0, 100.0, 0.0]
    )
    assert out["seconds_kill_to_lost"] == pytest.approx(0.2)
    assert out["seconds_restart_to_serving"] == pytest.approx(6.0)
    assert out["seconds_restart_to_rejoin"] == pytest.approx(7.0)
    assert out["seconds_rejoin_to_first_update"] == pytest.approx(0.75)
    assert out["seconds_rejoin_to_full_rate"] == pytest.approx(2.0)  # bin [23, 24) ends at 24


def test_summarize_without_a_rejoin_leaves_the_after_window_empty():
    samples = [sample(t, [100 * t, 100 * t]) for t in range(0, 11)]
    rows = timeline.bins(samples)
    out = timeline.summarize(rows, {"kill": 4.0, "restart": 7.0}, [1], samples, warmup=1.0)
    assert out["after_share"] is None and out["windows"]["after"]["bins"] == 0
    assert out["seconds_restart_to_rejoin"] is None


def test_fault_script_kills_restarts_and_finishes_on_time_even_if_the_restart_is_slow():
    calls = []
    finished = threading.Event()

    def restart():
        calls.append("restart")
        time.sleep(0.6)  # a server that takes its time to serve
        return 2

    script = timeline.FaultScript(
        kill=lambda: calls.append("kill") or 1,
        restart=restart,
        finish=finished.set,
        kill_at=0.1,
        restart_at=0.2,
        seconds=0.4,
    )
    script.start(time.monotonic())
    assert finished.wait(0.55)  # not held back by the restart
    script.join()
    assert calls == ["kill", "restart"]
    assert script.events["killed_pid"] == 1 and script.events["restarted_pid"] == 2
    assert script.events["kill"] < script.events["restart"] < script.events["finish"]
    assert script.events["serving"] > script.events["finish"]


def test_fault_script_refuses_events_out_of_order():
    with pytest.raises(ValueError, match="kill_at < restart_at < seconds"):
        timeline.FaultScript(lambda: 0, lambda: 0, lambda: None, 5, 3, 10)


def test_tcp_bytes_counts_what_a_process_sent_over_its_sockets():
    import os
    import shutil
    import socket

    if shutil.which("ss") is None:
        pytest.skip("`ss` (iproute2) is not installed")
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        before = timeline.tcp_bytes([os.getpid()])[os.getpid()]
        payload = b"x" * 200_000
        client.sendall(payload)
        received = 0
        while received < len(payload):
            received += len(peer.recv(65536))
        after = timeline.tcp_bytes([os.getpid()])[os.getpid()]
        # Both ends are this process: it sent and received the payload.
        assert after["sent"] - before["sent"] >= len(payload)
        assert after["received"] - before["received"] >= len(payload)
    finally:
        for s in (client, peer, server):
            s.close()
    assert timeline.tcp_bytes([]) == {}
