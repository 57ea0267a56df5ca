"""Errors reach the caller as raised; nothing hangs; no thread is left."""

import logging
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp


def wait_for_no_threads(strategy, seconds=10.0):
    deadline = time.monotonic() + seconds
    while strategy.worker_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return strategy.worker_threads()


@pytest.mark.timeout(60)
def test_replica_error_reaches_fit_as_raised_and_threads_stop():
    x, y = classification_data(512)
    x[300] = np.nan  # one shard fails its check, in a worker thread
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Lambda(lambda t: tf.debugging.check_numerics(t, "bad input row")),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model)
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad input row") as raised:
        model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert time.monotonic() - start < 30
    # The error raised is the replica's own, not a wrapper from the dispatch op.
    assert "tf_diffmap_dispatch" not in str(raised.value)
    assert wait_for_no_threads(strategy) == []
    # The strategy is usable again once the data is fixed.
    x[300] = 0.0
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


@pytest.mark.timeout(60)
def test_a_replica_out_of_range_error_is_raised_not_taken_for_the_end_of_data():
    """Keras ends an epoch on OutOfRangeError from its own loop; a replica's is an error."""
    x, y = classification_data(512)
    calls = tf.Variable(0, dtype=tf.int64)  # made outside the scope: a plain counter

    def count(t):
        # The sixth training step raises OutOfRangeError ("Reached limit of 5").
        tick = tf.raw_ops.ResourceCountUpTo(resource=calls.handle, limit=5, T=tf.int64)
        with tf.control_dependencies([tick]):
            return tf.identity(t)

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Lambda(count), keras.layers.Dense(2)]
        )
        compile_logits(model)
    with pytest.raises(tf.errors.OutOfRangeError, match="Reached limit of 5"):
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert wait_for_no_threads(strategy) == []
    assert strategy.version == 5


@pytest.mark.timeout(60)
def test_keyboard_interrupt_during_fit_leaves_no_threads():
    x, y = classification_data(1024)
    strategy = tf_diffmap.Strategy()

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise KeyboardInterrupt

    with strategy.scope():
        model = mlp()
        compile_logits(model)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Interrupt()])
    assert wait_for_no_threads(strategy) == []
    # What was dispatched before the interrupt was applied, not lost.
    assert strategy.version == 6 * 4


def test_shutdown_stops_threads_at_once():
    x, y = classification_data(256)
    strategy, model = async_mlp()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    strategy.shutdown()
    assert strategy.worker_threads() == []


# -- classifying the runtime's errors (no cluster needed) ----------------------

from tf_diffmap.cluster import faults  # noqa: E402
from tf_diffmap.engine import replicas  # noqa: E402

WORKER_LOST = (
    "Graph execution error:\n\nDetected at node while/body/_1 defined at (most recent call last):\n"
    "<stack traces unavailable>\n2 root error(s) found.\n"
    "  (0) UNAVAILABLE:  recvmsg:Connection reset by peer\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1/device:CPU:0"
    " while calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
    "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling "
    "/tensorflow.WorkerService/RecvTensor:\n0 successful operations."
)


def test_an_error_naming_a_worker_and_the_ps_that_relayed_it_is_the_worker():
    error = tf.errors.UnavailableError(None, None, WORKER_LOST)
    assert replicas.named_tasks(error) == [
        "/job:worker/replica:0/task:1",
        "/job:ps/replica:0/task:0",
    ]
    down = {"/job:worker/replica:0/task:1"}
    fault = faults.classify(error, answers=lambda task: task not in down)
    assert fault == faults.Fault("worker", "/job:worker/replica:0/task:1")
    # The ps is lost only if it does not answer itself.
    down.add("/job:ps/replica:0/task:0")
    assert faults.classify(error, answers=lambda task: task not in down).job == "ps"


def test_a_probe_that_fails_with_another_task_s_error_does_not_say_its_task_is_down():
    # An op for the ps, failing with the error of a worker that just died
    # (as the runtime reports it on the client's next op).
    relayed = tf.errors.UnavailableError(
        None,
        None,
        "failed to connect to all addresses\nAdditional GRPC error information from remote "
        "target /job:worker/replica:0/task:1 while calling /tensorflow.eager.EagerService/Enqueue",
    )
    assert not faults.says_down("/job:ps/replica:0/task:0", relayed)
    assert faults.says_down("/job:worker/replica:0/task:1", relayed)
    # An error that names no task is the probed task's own.
    assert faults.says_down("/job:ps/replica:0/task:0", tf.errors.UnavailableError(None, None, "x"))


@pytest.mark.parametrize(
    "named, serving, answers",
    [
        ("worker/replica:0/task:1", True, True),
        ("worker/replica:0/task:1", False, False),
        ("ps/replica:0/task:0", True, False),
    ],
    ids=["another's error, serving", "another's error, not serving", "its own error"],
)
def test_a_probe_failing_with_another_task_s_error_asks_the_server(
    monkeypatch, named, serving, answers
):
    ps = "/job:ps/replica:0/task:0"

    def fails(_):
        raise tf.errors.UnavailableError(None, None, f"Socket closed /job:{named}")

    asked = []
    monkeypatch.setattr(faults.tf, "constant", fails)
    monkeypatch.setattr(faults._tf_internal, "cluster_addresses", lambda: {ps: "127.0.0.1:1"})
    monkeypatch.setattr(faults, "serves", lambda address, timeout: asked.append(address) or serving)
    assert faults.task_answers(ps) is answers
    # Its own error is the answer: the server is not asked.
    assert asked == ([] if named.startswith("ps") else ["127.0.0.1:1"])


W0 = "/job:worker/replica:0/task:0"


@pytest.mark.parametrize(
    "error, lost",
    [
        (
            tf.errors.UnavailableError(None, None, "Socket closed /job:worker/replica:0/task:0"),
            True,
        ),
        (
            tf.errors.CancelledError(None, None, "connection reset /job:worker/replica:0/task:0"),
            True,
        ),
        (tf.errors.CancelledError(None, None, "Cancelled by the user"), False),
        (
            tf.errors.InvalidArgumentError(
                None, None, "bad input row /job:worker/replica:0/task:0"
            ),
            False,
        ),
        (ValueError("/job:worker/replica:0/task:0 unavailable"), False),
    ],
)
def test_only_the_runtime_s_unreachable_errors_are_faults(error, lost):
    assert (faults.classify(error, answers=lambda task: False) is not None) == lost


def test_a_replica_error_is_restated_short_with_its_type_task_and_cause():
    original = tf.errors.InvalidArgumentError(
        None,
        None,
        "Graph execution error:\n\nDetected at node x\n  (0) INVALID_ARGUMENT:  bad input row : "
        "Tensor had NaN values\nAdditional GRPC error information from remote target "
        "/job:worker/replica:0/task:1 while calling RunComponentFunction",
    )
    raised = replicas.restated(original, 2, "/job:worker/replica:0/task:1/device:CPU:0")
    assert type(raised) is tf.errors.InvalidArgumentError
    assert str(raised) == (
        "bad input row : Tensor had NaN values (replica 2 on /job:worker/replica:0/task:1)"
    )
    assert raised.__cause__ is original
    # On one host, an error is raised exactly as the replica raised it.
    local = tf.errors.InvalidArgumentError(None, None, "bad input row")
    assert replicas.restated(local, 0, "/job:localhost/replica:0/task:0/device:CPU:0") is local


def test_lost_ps_error_names_the_task_and_what_to_do():
    cause = tf.errors.UnavailableError(None, None, "Socket closed")
    error = faults.lost_ps_error(faults.Fault("ps", "/job:ps/replica:0/task:1"), cause)
    assert isinstance(error, tf.errors.UnavailableError) and error.__cause__ is cause
    assert "/job:ps/replica:0/task:1" in str(error) and "BackupAndRestore" in str(error)


def _remote_error(text: str, task: str) -> tf.errors.UnavailableError:
    """An eager call's error from `task`, as gRPC reports it."""
    return tf.errors.UnavailableError(
        None,
        None,
        f"{text}\nAdditional GRPC error information from remote target {task} while "
        "calling /tensorflow.eager.EagerService/Enqueue",
    )


def test_a_store_call_outside_the_loops_that_names_a_lost_ps_raises_the_lost_ps_error():
    """The window timer's calls to the store fail as a replica's would."""
    record = faults.ClusterRecord([W0 + "/device:CPU:0"], on_back=lambda task, ids: None)
    cause = _remote_error("Socket closed", "/job:ps/replica:0/task:0")
    # The ps of this one-host test answers no probe: it is lost.
    raised = record.store_error(cause)
    assert isinstance(raised, tf.errors.UnavailableError) and raised.__cause__ is cause
    assert "The parameter server /job:ps/replica:0/task:0 is unreachable" in str(raised)
    assert "BackupAndRestore" in str(raised)
    assert record.store_lost()
    other = tf.errors.InvalidArgumentError(None, None, "a bad value")
    assert record.store_error(other) is other
    assert replicas.ReplicaRecord([W0 + "/device:CPU:0"]).store_error(cause) is cause


def test_a_store_call_outside_the_loops_is_made_again_unless_a_ps_is_lost():
    """The window timer makes again a call that failed as a worker died or
    restarted (naming it, or no task), never one that names a lost ps, and
    none once the store is lost; on one host, none."""
    record = faults.ClusterRecord([W0 + "/device:CPU:0"], on_back=lambda task, ids: None)
    worker = _remote_error("failed to connect to all addresses", "/job:worker/replica:0/task:1")
    nameless = tf.errors.CancelledError(None, None, "Function was cancelled")
    assert record.transient_store_error(worker)
    assert record.transient_store_error(nameless)
    assert not replicas.ReplicaRecord([W0 + "/device:CPU:0"]).transient_store_error(worker)
    ps = _remote_error("Socket closed", "/job:ps/replica:0/task:0")
    # The ps of this one-host test answers no probe: it is lost.
    assert not record.transient_store_error(ps)
    record.store_error(ps)
    assert record.store_lost() and not record.transient_store_error(worker)


def test_the_runtime_s_details_survive_fit_s_traceback_filtering():
    """Keras re-raises what fit raises `from None`: `__cause__` is gone, the
    `runtime_error` attribute is not."""
    cause = tf.errors.UnavailableError(
        None, None, "recvmsg:Connection reset by peer (from /job:ps/replica:0/task:0)"
    )
    lost = faults.lost_ps_error(faults.Fault("ps", "/job:ps/replica:0/task:0"), cause)

    class LosePs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise lost

    x, y = classification_data(64)
    strategy, model = async_mlp()
    with pytest.raises(tf.errors.UnavailableError) as raised:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[LosePs()])
    assert raised.value is lost
    assert raised.value.__cause__ is None  # what Keras' filtering does
    assert raised.value.runtime_error is cause
    assert "Connection reset by peer" in str(raised.value.runtime_error)
    strategy.shutdown()


# -- a shard whose loop call fails: applied once, abandoned, or run again -----

from tf_diffmap.engine.loops import HeldShard, ShardChannel, held_shard  # noqa: E402
from tf_diffmap.engine.workers import POLL_SECONDS  # noqa: E402
from tf_diffmap.store.parameter_store import ParameterStore  # noqa: E402


@pytest.mark.parametrize(
    "completed, marked, may_requeue, fate",
    [
        (True, True, True, HeldShard.APPLIED),
        (True, False, False, HeldShard.APPLIED),
        (False, True, True, HeldShard.ABANDONED),
        (False, True, False, HeldShard.ABANDONED),
        (False, False, True, HeldShard.REQUEUED),
        (False, False, False, HeldShard.DROPPED),
    ],
)
def test_the_fate_of_a_held_shard(completed, marked, may_requeue, fate):
    asked = []

    def was_marked():
        asked.append(True)
        return marked

    assert held_shard(completed, was_marked, may_requeue) is fate
    assert asked == ([] if completed else [True])  # asked once, and only if needed


def tripwire(counter: tf.Variable, k: int) -> tf.Operation:
    """An op that fails the k-th time it runs (counted atomically, across calls).

    A raw op on the counter's handle: Keras' optimizer claims inside a
    `tf.custom_gradient` function, which refuses variables read in it.
    """
    before = tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=2**62, T=tf.int64)
    return tf.debugging.Assert(tf.not_equal(before + 1, k), ["injected failure"])


def fails_in_forward(counter: tf.Variable, k: int) -> keras.layers.Layer:
    """A layer that passes its input on, and fails the k-th step's forward pass."""

    def check(t):
        # In the forward pass once the shard is read. (A failure that runs
        # beside a read of the worker's input still waiting can end that
        # input for good: TensorFlow cancels the iterator with the read.)
        with tf.control_dependencies([t]):
            trip = tripwire(counter, k)
        with tf.control_dependencies([trip]):
            return tf.identity(t)

    return keras.layers.Lambda(check)


def cut_off_by_another_task(strategy, monkeypatch) -> list[int]:
    """Tokens, as on a cluster, and a verdict on an injected failure as on a
    call cut off by another task's loss (the replica goes on, what it held
    is released). Returns the list of the replicas cut off, filled as they are."""
    strategy.extended.runtime.read_input_on_workers()
    record = strategy.extended.runtime.record
    verdict = record.verdict
    cut_off = []

    def cut_off_by_another_task(replica_id, error):
        if "injected failure" in str(error):
            cut_off.append(replica_id)
            return "running", None
        return verdict(replica_id, error)

    monkeypatch.setattr(record, "verdict", cut_off_by_another_task)
    return cut_off


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cut, abandoned",
    [
        ("forward", 0),  # before the step marks its claim: its token runs again
        ("after_claim", 1),  # between the claim and the step's end: abandoned
        ("after_completion", 0),  # between its completion and its count: applied once
    ],
)
def test_a_loop_call_cut_off_applies_each_token_at_most_once(cut, abandoned, monkeypatch):
    """Each token is completed once or abandoned once; never both, never twice.

    Tokens, as on a cluster (each replica reads its shards from its own
    host's input); a loop call fails once, at the point `cut`, with an error
    handled as a call cut off by another task's loss (the replica goes on,
    what it held is released).
    """
    counter = tf.Variable(0, dtype=tf.int64)  # made outside the scope: a plain counter
    k = 20
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    if cut == "forward":
        layers.insert(1, fails_in_forward(counter, k))
    elif cut == "after_claim":
        record = ParameterStore.record

        def record_then_fail(self, replica_id, staleness, *args, **kwargs):
            with tf.control_dependencies([staleness]):
                trip = tripwire(counter, k)
            with tf.control_dependencies([trip]):
                return record(self, replica_id, staleness, *args, **kwargs)

        monkeypatch.setattr(ParameterStore, "record", record_then_fail)
    else:
        done = ShardChannel.done

        def fail_then_done(self, replica_id=None):
            # Inside the loop, under its step's completion.
            with tf.control_dependencies([tripwire(counter, k)]):
                return done(self, replica_id)

        monkeypatch.setattr(ShardChannel, "done", fail_then_done)

    # No hang watch: a replica left waiting for a window nobody settles
    # would wait until the test's timeout, not be rescued by the watch.
    strategy = tf_diffmap.Strategy(devices=["CPU:1", "CPU:2"], worker_timeout=None)
    cut_off = cut_off_by_another_task(strategy, monkeypatch)
    with strategy.scope():
        model = keras.Sequential(layers)
        compile_logits(model, "sgd")
    x, y = classification_data(512)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    tokens = 2 * (512 // 32) * 2
    steps = sum(strategy.replica_steps())
    assert len(cut_off) == 1 and int(counter.numpy()) > k
    assert strategy.statistics().abandoned == abandoned
    assert steps + abandoned == tokens
    assert strategy.version == steps + abandoned
    strategy.shutdown()


@pytest.mark.timeout(120)
def test_a_token_whose_mark_is_not_read_at_first_is_read_again_not_lost(monkeypatch):
    """A token cut off before its mark runs again, though the first read of
    the marks fails as a worker is lost (with two lost at once, the error
    names the other): taken for marked, it would be neither completed nor
    abandoned, and the steps and claims one short of the tokens."""
    counter = tf.Variable(0, dtype=tf.int64)  # made outside the scope: a plain counter
    strategy = tf_diffmap.Strategy(devices=["CPU:1", "CPU:2"])
    cut_off = cut_off_by_another_task(strategy, monkeypatch)
    runtime = strategy.extended.runtime
    # On one host no store error passes; on a cluster, one naming a worker does.
    cluster = faults.ClusterRecord([W0 + "/device:CPU:0"], on_back=lambda task, ids: None)
    monkeypatch.setattr(runtime.record, "transient_store_error", cluster.transient_store_error)
    cut_after_mark = runtime.store.cut_after_mark
    reads = []

    def fails_first(replica_id):
        reads.append(replica_id)
        if len(reads) == 1:
            raise _remote_error("Socket closed", "/job:worker/replica:0/task:2")
        return cut_after_mark(replica_id)

    monkeypatch.setattr(runtime.store, "cut_after_mark", fails_first)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                fails_in_forward(counter, 20),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, "sgd")
    x, y = classification_data(512)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    tokens = 2 * (512 // 32) * 2
    assert sum(strategy.replica_steps()) == tokens
    assert strategy.statistics().abandoned == 0
    assert strategy.version == tokens
    assert len(cut_off) == 1 and reads == cut_off * 2  # read again
    strategy.shutdown()


def test_a_store_call_after_a_cut_off_is_made_again_while_a_worker_is_named(monkeypatch):
    """`Runtime.store_call` (the mark's read, the settling of a window a
    cut-off call took) makes a call again while it fails with an error the
    record lets pass (on a cluster, one naming a worker), and raises any
    other at once (on one host, every error)."""
    strategy = tf_diffmap.Strategy(devices=["CPU:1", "CPU:2"])
    runtime = strategy.extended.runtime
    calls = []

    def fails_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise _remote_error("Socket closed", "/job:worker/replica:0/task:2")
        return 7

    with pytest.raises(tf.errors.UnavailableError):
        runtime.store_call(fails_twice)  # one host: made once
    assert len(calls) == 1
    calls.clear()
    cluster = faults.ClusterRecord([W0 + "/device:CPU:0"], on_back=lambda task, ids: None)
    monkeypatch.setattr(runtime.record, "transient_store_error", cluster.transient_store_error)
    assert runtime.store_call(fails_twice) == 7 and len(calls) == 3
    strategy.shutdown()


def test_a_store_call_that_fails_for_good_is_raised_after_worker_timeout(monkeypatch):
    """A store call that the record lets pass is made again for at most
    `worker_timeout` of failing (the bound of `Runtime.may_call_again`),
    then its error is raised: a call that fails for good, naming no task,
    is not made for ever. The window timer is given the same bound."""
    strategy = tf_diffmap.Strategy(devices=["CPU:1", "CPU:2"], worker_timeout=0.5)
    runtime = strategy.extended.runtime
    cluster = faults.ClusterRecord([W0 + "/device:CPU:0"], on_back=lambda task, ids: None)
    monkeypatch.setattr(runtime.record, "transient_store_error", cluster.transient_store_error)
    calls = []

    def always_fails():
        calls.append(time.monotonic())
        raise tf.errors.UnavailableError(None, None, "connection reset by peer")

    with pytest.raises(tf.errors.UnavailableError, match="connection reset"):
        runtime.store_call(always_fails)
    assert len(calls) > 1 and calls[-1] - calls[0] >= 0.5 - POLL_SECONDS
    now = time.monotonic()
    lost = _remote_error("Socket closed", "/job:worker/replica:0/task:2")
    assert runtime.may_call_again(lost, now) and not runtime.may_call_again(lost, now - 0.5)
    strategy.shutdown()


def test_a_claim_marked_and_cut_off_before_it_is_made_gets_its_version():
    strategy = tf_diffmap.Strategy(devices=["CPU:1", "CPU:2"])
    store = strategy.extended.runtime.store
    store.marks.scatter_nd_add([[1]], [1])  # replica 1 marked, then was cut off
    assert store.cut_after_mark(1)
    assert not store.cut_after_mark(1)  # accounted for once
    assert store.settle_abandoned() == 1
    assert strategy.version == 1 and strategy.statistics().abandoned == 1
    assert int(store.read_version().numpy()) == 1  # reads see every version settled
    assert store.settle_abandoned() == 0


class HangOnce(keras.layers.Layer):
    """Passes its input on; once armed, the first step through it waits on a
    queue until `release` (a native wait, which holds no thread)."""

    def __init__(self):
        super().__init__()
        self.armed = threading.Event()
        self.claimed = []
        self._claim_lock = threading.Lock()
        with tf.init_scope(), tf.device("/CPU:0"):
            self.gate = tf.queue.FIFOQueue(1, [tf.float32], shapes=[[]])

    def _claim(self):
        with self._claim_lock:
            if self.armed.is_set() and not self.claimed:
                self.claimed.append(threading.current_thread().name)
                return True
            return False

    def call(self, x):
        block = tf.numpy_function(self._claim, [], tf.bool)
        block.set_shape([])
        waited = tf.cond(block, self.gate.dequeue, lambda: tf.constant(0.0))
        return x + waited

    def compute_output_shape(self, input_shape):
        return input_shape

    def release(self):
        self.gate.enqueue(tf.constant(0.0))


@pytest.mark.timeout(180)
def test_a_replica_that_hangs_is_lost_past_worker_timeout_and_rejoins_when_it_answers(caplog):
    """A step that does not answer holds its shard past `worker_timeout`
    while the others wait at the end of the epoch: its replica is reported
    lost, the fit ends without it, and once it answers its shard is applied
    once and the replica trains again."""
    timeout = 2.0
    x, y = classification_data(1024)
    strategy = tf_diffmap.Strategy(worker_timeout=timeout)
    with strategy.scope():
        hang = HangOnce()
        model = keras.Sequential(
            [keras.Input((8,)), hang, keras.layers.Dense(16, "relu"), keras.layers.Dense(2)]
        )
        compile_logits(model)
    started = time.monotonic()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    unhung = time.monotonic() - started
    shards = 1024 // 64 * 4
    assert strategy.version == shards
    hang.armed.set()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tf_diffmap"):
        model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    hung_fit = time.monotonic() - started
    assert len(hang.claimed) == 1
    # Two epochs without the hung step, one wait of the timeout, and room
    # for the monitor's look and a busy host.
    assert hung_fit < 2 * unhung + timeout + 15.0
    lost = [r.replica for r in strategy.replica_states() if r.state == "lost"]
    assert len(lost) == 1
    warnings = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warnings) == 1 and f"replica {lost[0]} " in warnings[0]
    assert strategy.version == 3 * shards - 1  # the held shard is not applied yet
    hang.release()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(r.state == "lost" for r in strategy.replica_states()):
        time.sleep(0.05)
    assert [r.state for r in strategy.replica_states() if r.state == "lost"] == []
    strategy.drain()
    assert strategy.version == 3 * shards  # applied once, when it answered
    steps_before = strategy.replica_steps()[lost[0]]
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert strategy.replica_steps()[lost[0]] > steps_before
    assert strategy.version == 4 * shards
    assert wait_for_no_threads(strategy) == []
