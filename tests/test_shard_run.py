"""A batch's shards run exactly once on a cluster's live workers (`ShardRun`).

Without a cluster: the runners' calls are Python functions, and a stand-in
for the strategy's runtime gives the verdict on an error, as the cluster's
record does (a lost worker, another task lost during the call, or fatal).
A call blocks on an event where a worker would hang.
"""

import threading

import pytest
import tensorflow as tf

from tf_diffmap.cluster.shard_run import ShardRun
from tf_diffmap.engine.workers import ReplicaState


class Lost(Exception):
    """What a call to a worker that is gone raises here."""


class Cancelled(Exception):
    """What a call raises here when another task it exchanged with was lost."""


class FakeRuntime:
    """The part of `engine.runtime.Runtime` that a `ShardRun` uses."""

    def __init__(self, replicas: int, worker_timeout=None):
        self.replica_devices = [
            f"/job:worker/replica:0/task:{r}/device:CPU:0" for r in range(replicas)
        ]
        self.worker_timeout = worker_timeout
        self.lost, self.hung_groups, self.answered_groups = set(), [], []
        self.answer = threading.Event()
        self._error = None

    def replica_failed(self, replica, error):
        if isinstance(error, Lost):
            self.lost.add(replica)
            return ReplicaState.LOST
        if isinstance(error, Cancelled):
            return ReplicaState.RUNNING
        self._error = error
        return ReplicaState.FAILED

    def raise_error(self):
        error, self._error = self._error, None
        if error is not None:
            raise error

    def group_of(self, replica):
        return [replica]

    def hung(self, replica, group, seconds):
        self.hung_groups.append(list(group))

    def answered(self, group):
        self.answered_groups.append(list(group))
        self.answer.set()


def test_every_shard_runs_once_and_the_results_keep_the_shards_order():
    calls = []

    def call(runner, shard):
        calls.append((runner, shard))
        return shard * 10

    run = ShardRun(FakeRuntime(3), call, list(range(12)), runners=[0, 1, 2])
    assert run.run() == [k * 10 for k in range(12)]
    assert sorted(shard for _, shard in calls) == list(range(12))
    assert len(run.holders()) == 12 and run.run_again() == 0


def test_a_lost_worker_has_its_shard_run_again_elsewhere_once():
    runtime = FakeRuntime(3)
    calls, lost = [], threading.Event()

    def call(runner, shard):
        calls.append((runner, shard))
        if runner == 1:
            lost.set()
            raise Lost()
        lost.wait(10)  # the others wait until worker 1 has taken a shard
        return shard

    run = ShardRun(runtime, call, list(range(9)), runners=[0, 1, 2])
    assert run.run() == list(range(9))
    assert runtime.lost == {1}
    assert sum(runner == 1 for runner, _ in calls) == 1  # it takes no more
    assert 1 not in run.holders()
    assert run.run_again() == 1


def test_a_call_cancelled_by_another_task_is_run_again_and_its_worker_goes_on():
    failed_once = []

    def call(runner, shard):
        if shard == 0 and not failed_once:
            failed_once.append(runner)
            raise Cancelled()
        return shard

    run = ShardRun(FakeRuntime(2), call, list(range(4)), runners=[0, 1])
    assert run.run() == [0, 1, 2, 3]
    assert run.run_again() == 1


def test_a_hung_worker_is_left_after_the_timeout_and_its_late_result_dropped():
    runtime = FakeRuntime(2, worker_timeout=0.2)
    holding, release = threading.Event(), threading.Event()

    def call(runner, shard):
        if runner == 1:
            holding.set()
            release.wait()
            return "late"
        holding.wait(10)  # worker 0 waits until worker 1 holds a shard
        return shard

    run = ShardRun(runtime, call, list(range(4)), runners=[0, 1])
    assert run.run() == [0, 1, 2, 3]
    assert runtime.hung_groups == [[1]]
    assert run.holders() == [0, 0, 0, 0] and run.run_again() == 1
    release.set()  # it answers: its result is dropped, and its group is back
    assert runtime.answer.wait(10)
    assert runtime.answered_groups == [[1]]
    assert run.holders() == [0, 0, 0, 0] and "late" not in [s.result for s in run.shards]


def test_a_fatal_error_is_raised():
    def call(runner, shard):
        if shard == 2:
            raise ValueError("the step's own error")
        return shard

    with pytest.raises(ValueError, match="the step's own error"):
        ShardRun(FakeRuntime(2), call, list(range(4)), runners=[0, 1]).run()


def test_with_every_runner_lost_the_run_says_so():
    def call(runner, shard):
        raise Lost()

    with pytest.raises(tf.errors.UnavailableError, match="Every replica"):
        ShardRun(FakeRuntime(2), call, list(range(4)), runners=[0, 1]).run()
