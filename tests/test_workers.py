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

from tf_diffmap.engine import workers
from tf_diffmap.engine.workers import ReplicaLoops, ReplicaState

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
        self.holding = [0] * replicas
        self.fences: set[int] = set()

    def submit(self, tasks):
        with self.lock:
            self.put += len(tasks)
        for task in tasks:
            self.items.put(task)

    def run_loop(self, replica_id, max_steps):
        with self.lock:
            self.loop_calls += 1
        taken = 0
        while taken < max_steps and replica_id not in self.fences:
            item = self.items.get()
            if replica_id in self.fences:
                self.items.put(item)  # given back, untouched
                break
            if item is STOP:
                return taken, True
            with self.lock:
                self.holding[replica_id] = self.steps[replica_id] + 1
            if not self.failed:
                item(replica_id)  # may raise: the loop call raises
                with self.lock:
                    self.steps[replica_id] += 1
            with self.lock:
                self.done += 1
                self.holding[replica_id] = 0
            taken += 1
        return taken, False

    def stamps(self):
        with self.lock:
            return list(self.holding)

    def fence(self, replica_ids, fenced):
        with self.lock:
            if fenced:
                self.fences.update(replica_ids)
            else:
                self.fences.difference_update(replica_ids)

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
            self.holding[replica_id] = 0
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


def test_a_first_replica_takes_one_item_before_the_other_threads_start():
    runner, errors, loops = make(3)
    ran = []

    def task(replica):
        ran.append((replica, len(loops.threads())))

    runner.submit([task] * 6)
    runner.steps = [1, 0, 4]  # the replica with the most steps goes first
    loops.start(first=True)
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    # The first item ran on replica 2, its thread the only one then.
    assert ran[0] == (2, 1) and len(ran) == 6
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


class Hangs:
    """A `HangHandler` that records, and rejoins answered groups."""

    def __init__(self):
        self.loops = None
        self.seen = []
        self.answers = []

    def group_of(self, replica_id):
        return [replica_id]

    def hung(self, replica_id, group, seconds):
        self.seen.append((replica_id, list(group), seconds))

    def answered(self, group):
        self.answers.append(list(group))
        self.loops.rejoin(group)


def make_with_hangs(replicas, timeout, **kwargs):
    runner = Runner(replicas)
    hangs = Hangs()
    errors = []

    def on_error(replica_id, error):
        errors.append(error)
        return ReplicaState.FAILED

    loops = ReplicaLoops(
        runner,
        replicas,
        on_error,
        name="loops-test",
        worker_timeout=timeout,
        hangs=hangs,
        **kwargs,
    )
    hangs.loops = loops
    return runner, hangs, errors, loops


def until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def hang_once(release: threading.Event):
    """Items of which the first one taken blocks until `release` is set."""
    first = threading.Lock()
    hung = []

    def item(replica):
        if first.acquire(blocking=False):
            hung.append(replica)
            release.wait()
        else:
            time.sleep(0.005)

    return item, hung


def hanging(replicas, timeout, items, **kwargs):
    """Loops with a hang watch, `items` queued, the first one taken hanging."""
    runner, hangs, errors, loops = make_with_hangs(replicas, timeout=timeout, **kwargs)
    release = threading.Event()
    item, hung_replica = hang_once(release)
    runner.submit([item] * items)
    return runner, hangs, errors, loops, release, hung_replica


@pytest.mark.timeout(60)
def test_a_hung_replica_is_lost_past_the_timeout_and_rejoins_when_it_answers():
    runner, hangs, errors, loops, release, hung_replica = hanging(3, 0.5, 30, steps_per_loop=4)
    started = time.monotonic()
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    waited = time.monotonic() - started
    # The others applied the other 29 and waited for the held one only
    # until the timeout (plus the monitor's look and a busy host's delays).
    assert runner.done == 29 and loops.excused() == 1 and runner.pending() == 1
    assert waited < 0.5 + 5.0
    (replica,) = hung_replica
    assert [(r, g) for r, g, _ in hangs.seen] == [(replica, [replica])]
    assert hangs.seen[0][2] >= 0.5
    assert loops.states()[replica] is ReplicaState.LOST and replica in runner.fences
    loops.stop()  # no STOP for the hung call, and no wait for it
    assert loops.states().count(ReplicaState.STOPPED) == 2
    # It answers: its shard is applied and counted, it takes nothing more,
    # and its replica rejoins (stopped, as the loops are).
    release.set()
    assert until(lambda: hangs.answers == [[replica]])
    assert until(lambda: loops.threads() == [])
    assert runner.done == 30 and runner.pending() == 0 and loops.excused() == 0
    assert loops.states() == [ReplicaState.STOPPED] * 3 and runner.fences == set()
    assert runner.items.empty() and not errors
    # The next round has every replica again.
    runner.submit([lambda r: time.sleep(0.02)] * 30)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    assert runner.steps[replica] > 1 and runner.pending() == 0
    loops.stop()
    assert loops.threads() == []


@pytest.mark.timeout(60)
def test_a_hung_call_that_answers_while_the_loops_run_rejoins_them():
    runner, hangs, errors, loops, release, hung_replica = hanging(2, 0.3, 10, steps_per_loop=2)
    loops.start()
    assert until(lambda: hangs.seen)
    release.set()
    assert until(lambda: hangs.answers)
    (replica,) = hung_replica
    assert loops.states()[replica] is ReplicaState.RUNNING
    runner.submit([lambda r: time.sleep(0.01)] * 40)
    loops.wait_idle(failed=lambda: bool(errors))
    assert runner.pending() == 0 and loops.excused() == 0 and runner.steps[replica] > 1
    loops.stop()
    assert loops.threads() == [] and not errors


@pytest.mark.timeout(60)
def test_a_slow_step_is_not_a_hang_while_the_others_apply_shards():
    runner, hangs, errors, loops = make_with_hangs(2, timeout=0.3)
    slow = threading.Lock()

    def item(replica):
        time.sleep(1.5 if slow.acquire(blocking=False) else 0.02)

    runner.submit([item] * 60)  # about 1.2 s of work for the other replica
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    assert runner.done == 60 and hangs.seen == [] and not errors


@pytest.mark.timeout(60)
def test_the_last_live_replica_is_waited_for():
    runner, hangs, errors, loops = make_with_hangs(1, timeout=0.2)
    runner.submit([lambda r: time.sleep(1.0)])
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    assert runner.done == 1 and hangs.seen == [] and loops.threads() == []


@pytest.mark.timeout(60)
def test_a_hung_call_whose_worker_is_lost_stays_lost_and_gives_its_item_back():
    runner, hangs, errors, loops = make_with_hangs(2, timeout=0.3)
    verdicts = []

    def on_error(replica_id, error):
        verdicts.append(replica_id)
        return ReplicaState.LOST

    loops._on_error = on_error
    release = threading.Event()
    first = threading.Lock()

    def item(replica):
        if first.acquire(blocking=False):
            release.wait()
            raise RuntimeError("worker gone")
        time.sleep(0.005)

    runner.submit([item] * 10)
    loops.start()
    loops.wait_idle(failed=lambda: False)
    assert until(lambda: hangs.seen)
    release.set()
    assert until(lambda: verdicts)
    assert until(lambda: loops.excused() == 0)
    (replica,) = verdicts
    assert hangs.answers == [] and loops.states()[replica] is ReplicaState.LOST
    assert runner.done == 10 and runner.pending() == 0  # released as a failed call's
    loops.stop()
    assert loops.threads() == []
    loops.rejoin([replica])  # as when it serves again
    assert loops.states()[replica] is ReplicaState.STOPPED and runner.fences == set()


@pytest.mark.timeout(60)
def test_a_first_call_that_hangs_holds_the_caller_up_to_the_timeout_only():
    runner, hangs, errors, loops, release, hung_replica = hanging(3, 0.5, 12)
    runner.steps = [0, 5, 1]
    started = time.monotonic()
    loops.start(first=True)
    assert 0.5 <= time.monotonic() - started < 0.5 + 5.0
    loops.wait_idle(failed=lambda: bool(errors))
    assert hung_replica == [1] and [r for r, _, _ in hangs.seen] == [1]
    assert runner.done == 11 and loops.excused() == 1
    loops.stop()
    release.set()
    assert until(lambda: hangs.answers == [[1]])
    assert until(lambda: loops.threads() == [])
    assert runner.pending() == 0 and loops.states() == [ReplicaState.STOPPED] * 3


@pytest.mark.timeout(60)
def test_a_call_that_hangs_holding_nothing_is_left_when_it_does_not_take_its_stop():
    """A call blocked before it takes anything (its worker paused between
    two items) holds no shard, so nothing waits for it until the loops
    stop: a stop then waits `worker_timeout` for its STOP, not longer."""
    runner, hangs, errors, loops = make_with_hangs(2, timeout=0.5)
    release = threading.Event()
    blocked = []
    run_loop = runner.run_loop

    def paused_run_loop(replica_id, max_steps):
        if replica_id == 1 and not blocked:
            blocked.append(True)
            release.wait()
        return run_loop(replica_id, max_steps)

    runner.run_loop = paused_run_loop
    runner.submit([lambda r: time.sleep(0.005)] * 20)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    assert runner.steps == [20, 0] and hangs.seen == []
    started = time.monotonic()
    loops.stop()
    assert 0.5 <= time.monotonic() - started < 0.5 + 5.0
    assert [(r, g) for r, g, _ in hangs.seen] == [(1, [1])] and loops.excused() == 0
    assert loops.states() == [ReplicaState.STOPPED, ReplicaState.LOST]
    release.set()  # it takes its STOP, or finds its fence, and answers
    assert until(lambda: hangs.answers == [[1]])
    assert until(lambda: loops.threads() == [])
    runner.submit([lambda r: time.sleep(0.005)] * 20)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    loops.stop()
    assert sum(runner.steps) == 40 and runner.pending() == 0 and not errors
    assert loops.threads() == []


def test_an_absent_replica_joins_and_leaves_and_nothing_is_lost():
    runner, errors, loops = make(3, steps_per_loop=4, absent=[2])
    done = []
    lock = threading.Lock()

    def task(replica):
        time.sleep(0.002)
        with lock:
            done.append(replica)

    assert loops.states()[2] is ReplicaState.ABSENT
    runner.submit([task] * 40)
    loops.start()
    loops.wait_idle(failed=lambda: bool(errors))
    assert 2 not in done and len(done) == 40
    assert loops.states()[2] is ReplicaState.ABSENT  # start() leaves it alone
    loops.join([2])
    assert loops.states()[2] is ReplicaState.RUNNING
    runner.submit([task] * 200)
    while runner.replica_steps()[2] == 0 and runner.pending():
        time.sleep(0.001)
    assert loops.leave([2], timeout=10.0) == []
    assert loops.states()[2] is ReplicaState.ABSENT
    steps_at_leave = runner.replica_steps()[2]
    runner.submit([task] * 40)
    loops.wait_idle(failed=lambda: bool(errors))
    # Every item applied once, by the replicas present; none after it left.
    assert len(done) == 280 and runner.pending() == 0 and not errors
    assert done.count(2) == runner.replica_steps()[2] == steps_at_leave > 0
    loops.stop()
    assert loops.threads() == []
    assert loops.states() == [ReplicaState.STOPPED, ReplicaState.STOPPED, ReplicaState.ABSENT]
    with pytest.raises(RuntimeError, match="cannot go from absent to running"):
        with loops._lock:
            loops._move(2, ReplicaState.RUNNING)


def test_a_replica_that_waits_for_an_item_leaves_at_once_while_another_holds_a_slow_shard():
    """Nothing is queued and a slow shard is in flight (the loops are not
    idle): a leaving replica blocked in its take ends without waiting for an
    item, and the STOP that woke it ends no other replica's work."""
    runner, errors, loops = make(3, steps_per_loop=4)
    release = threading.Event()
    runner.submit([lambda r: release.wait(20.0)])
    loops.start()
    try:
        assert until(lambda: any(runner.stamps()))
        holder = next(r for r, stamp in enumerate(runner.stamps()) if stamp)
        leaving = next(r for r in range(3) if r != holder)
        time.sleep(0.2)  # its thread is in its take, on an empty queue
        started = time.monotonic()
        assert loops.leave([leaving], timeout=10.0) == []
        seconds = time.monotonic() - started
        assert seconds < 2.0, seconds
        assert loops.states()[leaving] is ReplicaState.ABSENT
        assert loops.states()[holder] is ReplicaState.RUNNING  # it is still applying
    finally:
        release.set()
    runner.submit([lambda r: time.sleep(0.001)] * 30)
    loops.wait_idle(failed=lambda: bool(errors))
    assert sum(runner.steps) == 31 and runner.pending() == 0 and not errors
    assert runner.steps[leaving] == 0
    loops.stop()
    assert loops.threads() == []
