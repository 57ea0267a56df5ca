"""The worker pool: asynchronous tasks, draining, errors, bounded staleness."""

import threading
import time

import pytest

from tf_diffmap.workers import WorkerPool


def test_drain_waits_for_every_task_and_threads_exit_when_idle():
    pool = WorkerPool(3, name="pool-test")
    done = []
    lock = threading.Lock()

    def task(replica):
        time.sleep(0.01)
        with lock:
            done.append(replica)

    assert pool.submit([task] * 12)
    pool.drain()
    assert len(done) == 12 and pool.in_flight == 0
    deadline = time.monotonic() + 5
    while pool.threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.threads() == []


def test_error_is_raised_once_in_the_caller_as_raised():
    pool = WorkerPool(2, name="pool-test")

    class Boom(Exception):
        pass

    def bad(replica):
        raise Boom("replica failed")

    pool.submit([bad])
    with pytest.raises(Boom, match="replica failed"):
        pool.drain()
    pool.drain()  # raised once, then cleared
    pool.shutdown()
    assert pool.threads() == []


def test_submit_does_not_hang_when_workers_died():
    pool = WorkerPool(1, name="pool-test", queue_size=1)

    def bad(replica):
        raise RuntimeError("dead")

    start = time.monotonic()
    ok = pool.submit([bad] + [lambda r: time.sleep(1)] * 5)
    assert not ok and time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="dead"):
        pool.raise_error()


def test_max_staleness_holds_fast_replicas_back():
    pool = WorkerPool(2, name="pool-test", queue_size=64, max_staleness=1)
    lock = threading.Lock()
    spread = []

    def task(replica):
        time.sleep(0.03 if replica == 0 else 0.001)
        with lock:
            steps = pool.steps()
            steps[replica] += 1  # this task is about to count
            spread.append(max(steps) - min(steps))

    pool.submit([task] * 40)
    pool.drain()
    steps = pool.steps()
    assert sum(steps) == 40
    # Replica 1 may run at most one step ahead of replica 0, plus the step it is on.
    assert max(spread) <= 2
    assert abs(steps[0] - steps[1]) <= 2
    assert pool.seconds_waited()[1] > 0
