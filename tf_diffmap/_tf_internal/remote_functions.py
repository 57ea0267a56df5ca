"""Remote requests that do not wait for a task that does not answer.

TensorFlow's eager context sends every function it registers, and every
removal, to every remote task it is connected to; so does an eager op it
wraps in a function of its own (some `tf.data` ops). With
`TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE=False` (what a cluster's client
sets, as `ParameterServerStrategy` does) each of those requests waits for
the task's reply, in `Context.add_c_function` and `remove_function` with
Python's GIL held. A task that is paused, wedged or cut off by a network
partition never replies: the call waits for ever, and with the GIL every
thread of the client's Python with it. A removal happens wherever the last
reference to a traced function goes (Keras drops its functions at the end
of `fit`), a registration wherever a function is first traced or an op
wrapped (`evaluate`, `predict`, a new `fit`, a new dataset).

The runtime reads that variable at each request. `quiet_tasks(tasks)`
names the tasks that may not answer now: while any is named, requests go
through the runtime's streaming RPC, which sends them in order on one
stream per task and does not wait for the reply. What a request changed
on a task that answers is then certain only once a later request on the
same stream has answered: `settle(tasks)` runs one op with a result on
each and waits for it (a function call is a separate RPC, not ordered
after the stream, and reads an iterator or a variable that a streamed op
may not have initialized yet).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import tensorflow as tf
from tensorflow.python.eager import context

__all__ = ["STREAMING", "quiet", "quiet_tasks", "settle"]

# The variable the runtime reads at each remote enqueue (see the module's
# docstring); "False" on a cluster's client (`cluster.connect.fail_fast`).
STREAMING = "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"

_lock = threading.Lock()
_quiet: set[str] = set()
_set_by_user: list[str | None] = []


def quiet_tasks(tasks: Iterable[str]) -> None:
    """The tasks (`/job:<j>/replica:0/task:<i>`) that may not answer now."""
    tasks = set(tasks)
    with _lock:
        if tasks and not _quiet:
            _set_by_user.append(os.environ.get(STREAMING))
            os.environ[STREAMING] = "True"
        elif not tasks and _quiet:
            before = _set_by_user.pop() if _set_by_user else None
            if before is None:
                os.environ.pop(STREAMING, None)
            else:
                os.environ[STREAMING] = before
        _quiet.clear()
        _quiet.update(tasks)


def quiet() -> set[str]:
    """The tasks named by the latest `quiet_tasks`."""
    with _lock:
        return set(_quiet)


def settle(tasks: Iterable[str] | None = None) -> None:
    """Waits until tasks have run what was streamed to them.

    Args:
        tasks: the tasks, which must answer; by default every remote task
            but the quiet ones. Nothing is done while no task is quiet
            (every request then waits for its reply).
    """
    with _lock:
        skipped = set(_quiet)
    if not skipped:
        return
    server_def = context.context().get_server_def()
    if server_def is None:
        return
    own = f"/job:{server_def.job_name}/replica:0/task:{server_def.task_index}"
    every = [
        f"/job:{job.name}/replica:0/task:{index}"
        for job in server_def.cluster.job
        for index in job.tasks
    ]
    if tasks is None:
        wanted = [t for t in every if t not in skipped]
    else:
        tasks = set(tasks)
        wanted = [t for t in every if t in tasks]
    with tf.init_scope():
        for task in wanted:
            if task == own:
                continue
            try:
                with tf.device(f"{task}/device:CPU:0"):
                    tf.identity(tf.constant(0)).numpy()
            except (tf.errors.OpError, ValueError, RuntimeError):
                pass  # Lost meanwhile: its replicas' own calls will say so.
