"""The replicas' threads: loops over shared work, stopping, errors, bounded staleness.

`ReplicaLoops` is driven here by a runner made of plain Python (a
`queue.Queue` of callables), so that its thread logic is tested on its own;
the TensorFlow loop functions it drives in the package are tested through
the strategy.
"""

import queue
import threading
import time

import pytest

from tf_diffmap import workers
from tf_diffmap.workers import ReplicaLoops, ReplicaState

STOP = object()


class Runner:
    """A `LoopRunner` over Python callables taking the replica id."""

    def __init__(self, replicas: int):
        self.items: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.put = self.done = 0
        self.steps = [0] * replicas
        self.failed = False
        self.loop_calls = 0

    def submit(self, tasks):
        with self.lock:
            self.put += len(tasks)
        for task in tasks:
            self.items.put(task)

    def run_loop(self, replica_id, max_steps):
        with self.lock:
            self.loop_calls += 1
        taken = 0
        while taken < max_steps:
            item = self.items.get()
            if item is STOP:
                return taken, True
            if not self.failed:
                item(replica_id)  # may raise: the loop call raises
                with self.lock:
                    self.steps[replica_id] += 1
            with self.lock:
                self.done += 1
            taken += 1
        return taken, False

    def pending(self):
        with self.lock:
            return self.put - self.done

    def progress(self):
        with self.lock:
            return self.put, self.done

    def send_stops(self, count):
        for _ in range(count):
            self.items.put(STOP)

    def release(self, replica_id, requeue):
        with self.lock:
            self.done += 1
        return True

    def drop_loop(self, replica_id, max_steps):
        taken = 0
        while taken < max_steps:
            if self.items.get() is STOP:
                return taken, True
            with self.lock:
                self.done += 1
            taken += 1
        return taken, False

    def replica_steps(self):
        with self.lock:
            return list(self.steps)


def make(replicas=3, **kwargs):
    runner = Runner(replicas)
    errors = []

    def on_error(replica_id, error):
        errors.append(error)
        runner.failed = True
        return ReplicaState.FAILED

    return runner, errors, ReplicaLoops(runner, replicas, on_error, name="loops-test", **kwargs)


def test_waits_for_every_shard_and_python_is_called_once_per_k_shards():
    runner, errors, loops = make(3, steps_per_loop=8)
    done = []
    lock = threading.Lock()

    def task(replica):
        with lock:
            done.append(replica)

    runner.submit([task] * 48)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    assert len(done) == 48 and runner.pending() == 0 and not errors
    # 48 shards over loops of up to 8: at most 6 full calls, plus one open
    # call per thread still waiting for more.
    assert runner.loop_calls <= 48 // 8 + 3
    loops.stop()
    assert loops.threads() == []
    assert loops.states() == [ReplicaState.STOPPED] * 3


def test_idle_loops_stop_by_themselves(monkeypatch):
    monkeypatch.setattr(workers, "IDLE_SECONDS", 0.2)
    runner, errors, loops = make(2)
    idle = []
    runner.submit([lambda r: None] * 4)
    loops.start(on_idle=lambda: idle.append(True) or True)
    deadline = time.monotonic() + 5
    while loops.threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loops.threads() == [] and idle == [True]
    assert runner.pending() == 0


def test_replicas_that_keep_up_are_not_idle(monkeypatch):
    """Shards that arrive one at a time and are applied at once leave nothing
    in flight at most looks of the idle monitor: that is no pause."""
    monkeypatch.setattr(workers, "IDLE_SECONDS", 0.1)
    runner, errors, loops = make(2)
    idle = []
    loops.start(on_idle=lambda: idle.append(True) or True)
    feeding_until = time.monotonic() + 1.0
    while time.monotonic() < feeding_until:
        runner.submit([lambda r: None])
        time.sleep(0.01)
    assert idle == [] and len(loops.threads()) == 3  # two replicas and the monitor
    deadline = time.monotonic() + 5
    while loops.threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loops.threads() == [] and idle == [True] and runner.pending() == 0


def test_loops_go_on_when_shards_arrived_while_they_stopped(monkeypatch):
    """Shards put behind the STOP items of an idle stop are applied: the
    owner says so (`on_idle` returns False) and the loops start again."""
    monkeypatch.setattr(workers, "IDLE_SECONDS", 0.1)
    runner, errors, loops = make(2)
    applied = []
    calls = []

    def on_idle():
        calls.append(loops.threads())
        if len(calls) == 1:
            runner.submit([applied.append] * 5)  # nobody left to take them
            return False
        return True

    loops.start(on_idle=on_idle)
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    loops.stop()
    # Each call saw only the monitor: its replicas had stopped.
    assert [len(threads) for threads in calls] == [1, 1]
    assert len(applied) == 5 and runner.pending() == 0 and not errors


def test_error_is_handed_over_as_raised_and_nothing_blocks():
    runner, errors, loops = make(2)

    class Boom(Exception):
        pass

    def bad(replica):
        raise Boom("replica failed")

    runner.submit([bad] + [lambda r: time.sleep(0.01)] * 10)
    loops.start()
    start = time.monotonic()
    loops.wait_idle(failed=lambda: False)  # the others drop what is left
    assert time.monotonic() - start < 5
    assert len(errors) == 1 and isinstance(errors[0], Boom)
    assert runner.pending() == 0  # the failed shard is counted too
    assert ReplicaState.FAILED in loops.states()
    loops.stop()
    assert loops.threads() == []


def test_a_first_replica_takes_one_item_in_the_calling_thread_before_the_threads():
    runner, errors, loops = make(3)
    ran = []

    def task(replica):
        ran.append((replica, threading.current_thread() is threading.main_thread()))

    runner.submit([task] * 6)
    runner.steps = [1, 0, 4]  # the replica with the most steps goes first
    loops.start(first=True)
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    # The first item ran on replica 2, here, before any thread took one.
    assert ran[0] == (2, True)
    assert all(not here for _, here in ran[1:]) and len(ran) == 6
    assert not errors and runner.pending() == 0
    assert loops.states() == [ReplicaState.STOPPED] * 3


def test_under_max_staleness_the_first_item_goes_to_the_slowest_live_replica():
    runner, errors, loops = make(3, max_staleness=4)
    ran = []
    runner.submit([lambda r: ran.append(r)] * 3)
    runner.steps = [3, 1, 2]
    loops.start(first=True)
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    assert ran[0] == 1 and not errors


def test_an_error_of_the_first_replica_is_handled_as_a_threads_and_nothing_blocks():
    runner, errors, loops = make(2)
    released = []
    release = runner.release

    def record_release(replica_id, requeue):
        released.append((replica_id, requeue))
        return release(replica_id, requeue)

    runner.release = record_release

    class Boom(Exception):
        pass

    def bad(replica):
        raise Boom("first shard failed")

    runner.submit([bad] + [lambda r: None] * 5)
    runner.steps = [0, 2]
    loops.start(first=True)  # returns: the error is handed over, not raised here
    loops.wait_idle(failed=lambda: False)  # the others drop what is left
    assert len(errors) == 1 and isinstance(errors[0], Boom)
    assert released == [(1, False)]  # its item counted, not run again
    assert runner.pending() == 0
    loops.stop()
    assert loops.threads() == []


def test_a_base_exception_is_wrapped_with_its_cause():
    runner, errors, loops = make(1)

    def interrupted(replica):
        raise KeyboardInterrupt

    runner.submit([interrupted])
    loops.start()
    loops.wait_idle(failed=lambda: False)
    loops.stop()
    assert isinstance(errors[0], workers.WorkerError)
    assert isinstance(errors[0].__cause__, KeyboardInterrupt)


def test_max_staleness_holds_fast_replicas_back():
    runner, errors, loops = make(2, max_staleness=1)
    lock = threading.Lock()
    spread = []

    def task(replica):
        time.sleep(0.03 if replica == 0 else 0.001)
        with lock:
            steps = runner.replica_steps()
            steps[replica] += 1  # this task is about to count
            spread.append(max(steps) - min(steps))

    runner.submit([task] * 40)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    steps = runner.replica_steps()
    assert sum(steps) == 40
    # Replica 1 may run at most one step ahead of replica 0, plus the step it is on.
    assert max(spread) <= 2
    assert loops.seconds_waited()[1] > 0


@pytest.mark.timeout(30)
def test_a_stop_made_while_the_monitor_looks_does_not_wait_for_its_next_look(monkeypatch):
    """The idle monitor reads the progress outside its wait; a stop made then
    (an epoch's end) is seen at once, not after the monitor's next period."""
    monkeypatch.setattr(workers, "POLL_SECONDS", 0.001)
    runner, errors, loops = make(2)
    looking, go_on = threading.Event(), threading.Event()
    progress = runner.progress

    def slow_progress():
        if not looking.is_set():
            looking.set()
            go_on.wait(10)
        return progress()

    runner.progress = slow_progress
    loops.start()
    assert looking.wait(10)  # the monitor is between two waits
    monkeypatch.setattr(workers, "POLL_SECONDS", 60.0)  # its next wait: 5 minutes
    stopper = threading.Thread(target=loops.stop, kwargs={"timeout": 20.0})
    stopper.start()
    deadline = time.monotonic() + 10
    while not loops._stopping and time.monotonic() < deadline:
        time.sleep(0.01)
    go_on.set()
    stopper.join(10)
    assert not stopper.is_alive() and loops.threads() == []
    assert not errors


def test_stop_returns_when_threads_are_gone():
    runner, errors, loops = make(2)
    loops.stop()  # nothing started: nothing to wait for
    assert loops.threads() == []


def test_a_lost_replica_gives_its_item_back_and_rejoins():
    runner = Runner(2)
    requeued = []

    class Lost(Exception):
        pass

    def release(replica_id, requeue):
        requeued.append((replica_id, requeue))
        runner.items.put(lambda r: None)  # back on the queue, still counted as put
        return True

    runner.release = release
    loops = ReplicaLoops(
        runner, 2, lambda r, e: ReplicaState.LOST, name="loops-test", steps_per_loop=1
    )

    def on_replica_1(replica):
        if replica == 1:
            raise Lost("worker gone")
        time.sleep(0.01)

    runner.submit([on_replica_1] * 20)
    loops.start()
    loops.wait_idle(failed=lambda: False)
    assert runner.pending() == 0  # replica 0 applied every item, the one given back too
    assert loops.states()[1] is ReplicaState.LOST and requeued[0] == (1, True)
    assert len(loops.threads()) == 2  # replica 0 and the idle monitor
    loops.rejoin([1])
    assert loops.states()[1] is ReplicaState.RUNNING
    loops.stop()
    assert loops.threads() == [] and loops.states() == [ReplicaState.STOPPED] * 2
    with pytest.raises(RuntimeError, match="cannot go from stopped to rejoining"):
        with loops._lock:
            loops._move(0, ReplicaState.REJOINING)
