"""The strategy's base classes and what it reads of TensorFlow's runtime.

`tf.distribute` has no public way to write a strategy: a strategy is a
subclass of `tf.distribute.Strategy` whose `StrategyExtended` overrides
private hooks (listed in `checks.EXTENDED_HOOKS`). Besides the hooks, the
strategy asks TensorFlow whether a graph is compiled by XLA, hands the
caller's `tf.summary` state to the threads that trace replica steps, keeps
a dataset's functions registered, reads and renews the cluster the
eager context is connected to, and tells whether the runtime has started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tensorflow as tf
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.eager import context
from tensorflow.python.ops import control_flow_util, summary_ops_v2

# Base classes of the strategy (public names for classes with private hooks).
StrategyBase = tf.distribute.Strategy
ExtendedBase = tf.compat.v1.distribute.StrategyExtended


def per_replica(values) -> tf.distribute.DistributedValues:
    """One value per replica, in replica order, as a synchronous strategy's
    `run` returns them (TensorFlow's private `PerReplica`).

    Keras reduces such a value over the replicas (the mean of a test step's
    results, the concatenation of predictions), and `strategy.reduce`,
    `gather` and `experimental_local_results` read its values.
    """
    return distribute_values.PerReplica(tuple(values))


def replica_values(value) -> tuple | None:
    """The replicas' values of a `per_replica` value, or None for any other value."""
    if isinstance(value, distribute_values.PerReplica):
        return tuple(value.values)
    return None


def in_xla_context() -> bool:
    """Whether the graph being built will be compiled by XLA (jit_compile)."""
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def is_mixed_strategy_error(error: BaseException) -> bool:
    """Whether TensorFlow refused a variable created under another strategy."""
    return isinstance(error, RuntimeError) and "Mixing different tf.distribute.Strategy" in str(
        error
    )


def capture_summary_state() -> Callable[[], None]:
    """Returns a function that installs this thread's `tf.summary` state.

    `tf.summary` keeps its default writer, step and recording condition per
    thread. Replica steps are traced in a helper thread, which must see the
    writer that the caller's thread has set.
    """
    state = summary_ops_v2._summary_state  # noqa: SLF001
    writer, step, recording = state.writer, state.step, state.is_recording

    def install() -> None:
        state.writer, state.step, state.is_recording = writer, step, recording

    return install


def dataset_functions(dataset) -> list:
    """The traced functions a `tf.data.Dataset` and its inputs hold.

    Each is registered in the eager context and, on a cluster, on every
    remote task; once the last reference to it is gone, the context removes
    it from every remote task too. Holding these keeps them registered.

    Uses the private `DatasetV2._functions` and `_inputs`; returns what it
    finds (nothing where a dataset lacks them).
    """
    found, seen, stack = [], set(), [dataset]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        for wrapper in getattr(current, "_functions", lambda: [])():
            function = getattr(wrapper, "function", None)
            if function is not None:
                found.append(function)
        stack.extend(getattr(current, "_inputs", lambda: [])())
    return found


def runtime_started() -> bool:
    """Whether this process' eager runtime exists: its context made and
    initialized (devices listed, thread pools made).

    Before that, importing TensorFlow has loaded code and made a few
    threads of its own, and a fork of the process can start a runtime of
    its own (`cluster.launcher`); after it, a fork would inherit a runtime
    whose threads it does not have. Where TensorFlow no longer says (its
    context's members moved), True: nothing is forked, which costs time
    only (tests/test_tf_internal.py fails on such a release).
    """
    context_safe = getattr(context, "context_safe", None)
    ctx = context_safe() if callable(context_safe) else None
    if ctx is None:
        return not callable(context_safe)
    initialized = getattr(ctx, "_initialized", None)
    if initialized is None or not hasattr(ctx, "_context_handle"):
        return True
    return bool(initialized) or ctx._context_handle is not None  # noqa: SLF001


def cluster_addresses() -> dict[str, str]:
    """Task name (`/job:<j>/replica:0/task:<i>`) to `host:port`, of the
    cluster this client is connected to (empty when it is not)."""
    server_def = context.context().get_server_def()
    if server_def is None:
        return {}
    return {
        f"/job:{job.name}/replica:0/task:{index}": address
        for job in server_def.cluster.job
        for index, address in job.tasks.items()
    }


def reconnect_cluster() -> None:
    """Reconnects to the same cluster: a restarted task gets a fresh context.

    `update_server_def` compares every task's incarnation with the one the
    client knew and makes a new remote context on each task that restarted,
    as `ParameterServerStrategy`'s recovery does; the other tasks keep theirs.
    """
    with _server_def_lock:
        ctx = context.context()
        ctx.update_server_def(ctx.get_server_def())


def set_cluster_task(job: str, index: int, address: str | None) -> None:
    """Adds a task to the cluster this client is connected to, or with
    `address` None removes it, while everything else runs on.

    TensorFlow's own mechanism for a cluster that changes
    (`update_server_def`): for a task added, the client lists its devices,
    makes a remote context on it and sends it every function registered so
    far (without waiting for the replies); every other task is told the new
    cluster (an `UpdateContext` request, which each answers), so that it
    can exchange tensors with the new one. A function traced earlier for a
    device of the new task runs there from then on. For a task removed, the
    client closes its remote context and waits for the reply: remove a task
    only while it still serves. Calls running on the other tasks go on.

    Args:
        job: the task's job, `"worker"`.
        index: the task's index in its job.
        address: its `host:port`, or None to remove it.

    Raises:
        ValueError: the client is not connected to a cluster.
        tf.errors.OpError: what the runtime raised (a task added that does
            not serve).
    """
    with _server_def_lock:
        ctx = context.context()
        current = ctx.get_server_def()
        if current is None:
            raise ValueError("This process is not connected to a cluster.")
        updated = type(current)()
        updated.CopyFrom(current)
        tasks = next((j.tasks for j in updated.cluster.job if j.name == job), None)
        if tasks is None:
            tasks = updated.cluster.job.add(name=job).tasks
        if address is None:
            if index not in tasks:
                return
            del tasks[index]
        else:
            if tasks.get(index) == address:
                return
            tasks[index] = address
        ctx.update_server_def(updated)


# One change of the cluster at a time: each reads the server definition and
# writes a new one.
_server_def_lock = threading.Lock()
