"""One inference batch's shards, run exactly once on the live workers of a cluster.

`ShardRun` hands a batch's shards to runners (a replica of each live worker
task, `ClusterInference` gives them), one thread per runner, and keeps each
shard's result once. Here a shard is what one call runs: a worker slot's
share of the batch, one piece per replica of that slot. A call holds the
step's writes as outputs (`_tf_internal.deferring_writes`): a call cut off
by a lost worker has written nothing, so its shard runs again on another
worker and is counted once, from the one call that returned. This is the
exactly-once visitation that `ParameterServerStrategy`'s inline evaluation
offers.

A shard's life is a `ShardState`; a replica's comes from the strategy's
record (`ClusterRecord.verdict`: lost, or another task was, or fatal), and
a call that holds a shard past `worker_timeout` makes its worker hung, as in
training (`ReplicaRecord.hung`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tf_diffmap.engine.workers import ReplicaState

if TYPE_CHECKING:
    from tf_diffmap.engine.runtime import Runtime

__all__ = ["ShardRun", "ShardState"]

# How often the waiting thread looks for a call held past `worker_timeout`.
_LOOK_SECONDS = 0.05


class ShardState(enum.Enum):
    """A shard's life in one batch; `ShardRun` alone changes it.

    - QUEUED: waiting for a replica. Every shard starts here, and comes
      back here when the replica running it is lost (its worker is
      unreachable), when another task it exchanged with was (the call was
      cancelled), or when its call held it past `worker_timeout` (the
      worker is hung; that call's later result is dropped).
    - RUNNING: a replica's call holds it (`holder`, `attempt`).
    - DONE: the first call that returned for it did so; its result is kept,
      and no other call's result for it ever is.
    """

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class _Shard:
    """A shard's state, its current call, and its result once DONE."""

    def __init__(self, index: int, tensors: Any):
        self.index = index
        self.tensors = tensors
        self.state = ShardState.QUEUED
        self.holder: int | None = None
        self.attempt = 0
        self.started = 0.0
        self.result: Any = None


class ShardRun:
    """Runs a batch's shards once each on the live replicas (see the module).

    Args:
        runtime: the strategy's runtime (`worker_timeout`, the verdict on an
            error, and the replicas that hang together).
        call: `(runner, shard) -> result`, a runner's call of the step on a
            shard; its result is kept as it is.
        shards: the batch's shards, in order.
        runners: the replicas that run calls (one per live worker task).
    """

    def __init__(
        self,
        runtime: Runtime,
        call: Callable[[int, Any], Any],
        shards: Sequence[Any],
        runners: Sequence[int],
    ):
        self.runtime = runtime
        self.call = call
        self.runners = list(runners)
        self.shards = [_Shard(k, tensors) for k, tensors in enumerate(shards)]
        self._changed = threading.Condition()
        # Replicas that take no more shards: lost, hung, or whose call failed.
        self._out: set[int] = set()
        # Per hung group (this run's), its replicas; a late return answers it.
        self._hung: list[list[int]] = []
        self._error: BaseException | None = None
        self._stopped = False

    def run(self) -> list[Any]:
        """Every shard's result, in shard order.

        Raises:
            What the record makes of an error it finds fatal (a lost ps,
            every replica lost, a replica's own error), or
            `tf.errors.UnavailableError` once no replica is left to run a
            shard (every live one lost or hung).
        """
        replicas = self.runners
        threads = [
            threading.Thread(
                target=self._serve, args=(r,), name=f"tf_diffmap-inference-{r}", daemon=True
            )
            for r in replicas
        ]
        for thread in threads:
            thread.start()
        try:
            self._wait(replicas)
        finally:
            with self._changed:
                self._stopped = True
                self._changed.notify_all()
        return [shard.result for shard in self.shards]

    def holders(self) -> list[int]:
        """Per shard done, the replica whose call gave its result."""
        return [s.holder for s in self.shards if s.state is ShardState.DONE]

    def run_again(self) -> int:
        """The shards done whose kept call was not their first."""
        return sum(s.state is ShardState.DONE and s.attempt > 1 for s in self.shards)

    # -- the waiting thread ---------------------------------------------------

    def _wait(self, replicas: list[int]) -> None:
        timeout = self.runtime.worker_timeout
        with self._changed:
            while True:
                if self._error is not None:
                    self.runtime.raise_error()  # the runtime's, kept by `replica_failed`
                    raise self._error
                if all(s.state is ShardState.DONE for s in self.shards):
                    return
                if set(replicas) <= self._out:
                    raise _none_left(replicas, self.runtime.replica_devices)
                if timeout is not None:
                    self._find_hung(timeout)
                self._changed.wait(_LOOK_SECONDS if timeout is not None else None)

    def _find_hung(self, timeout: float) -> None:
        """A call that has held its shard for `timeout` seconds: its worker is
        hung; its shards go back on the queue (held: the lock)."""
        now = time.monotonic()
        for shard in self.shards:
            if shard.state is not ShardState.RUNNING or now - shard.started < timeout:
                continue
            group = self.runtime.group_of(shard.holder)
            self.runtime.hung(shard.holder, group, now - shard.started)
            self._hung.append(list(group))
            self._out.update(group)
            for other in self.shards:
                if other.state is ShardState.RUNNING and other.holder in group:
                    other.state, other.holder = ShardState.QUEUED, None
            self._changed.notify_all()

    # -- a replica's thread ---------------------------------------------------

    def _take(self, replica: int) -> _Shard | None:
        """The next queued shard for `replica`, or None once it has no more
        to do (every shard done, the run stopped, or the replica out)."""
        with self._changed:
            while True:
                if self._stopped or replica in self._out:
                    return None
                queued = [s for s in self.shards if s.state is ShardState.QUEUED]
                if queued:
                    shard = queued[0]
                    shard.state, shard.holder = ShardState.RUNNING, replica
                    shard.attempt += 1
                    shard.started = time.monotonic()
                    return shard
                if all(s.state is ShardState.DONE for s in self.shards):
                    return None
                # A running shard may come back (its replica lost or hung).
                self._changed.wait()

    def _serve(self, replica: int) -> None:
        while (shard := self._take(replica)) is not None:
            attempt = shard.attempt
            try:
                result = self.call(replica, shard.tensors)
            except Exception as error:  # noqa: BLE001 -- judged by the record, then kept or raised
                self._failed(replica, shard, attempt, error)
                continue
            self._returned(replica, shard, attempt, result)

    def _returned(self, replica: int, shard: _Shard, attempt: int, result: Any) -> None:
        answered = None
        with self._changed:
            if shard.state is ShardState.RUNNING and shard.attempt == attempt:
                shard.state, shard.result = ShardState.DONE, result
            # Otherwise its worker was taken for hung and the shard went to
            # another replica: this result is dropped.
            for group in self._hung:
                if replica in group:
                    answered = group
                    self._hung.remove(group)
                    break
            self._changed.notify_all()
        if answered is not None:
            self.runtime.answered(answered)

    def _failed(self, replica: int, shard: _Shard, attempt: int, error: BaseException) -> None:
        state = self.runtime.replica_failed(replica, error)
        with self._changed:
            if shard.state is ShardState.RUNNING and shard.attempt == attempt:
                shard.state, shard.holder = ShardState.QUEUED, None
            if state is ReplicaState.FAILED:
                self._error = self._error or error
                self._out.add(replica)
            elif state is not ReplicaState.RUNNING:
                self._out.update(self.runtime.group_of(replica))
            self._changed.notify_all()


def _none_left(replicas: list[int], devices: Sequence[str]) -> tf.errors.UnavailableError:
    names = ", ".join(sorted({devices[r] for r in replicas}))
    return tf.errors.UnavailableError(
        None,
        None,
        "Every replica that could run this evaluation or prediction batch is "
        f"lost or hung ({names}), and no replica is left to run its shards. "
        "Restart the worker tasks (or resume a paused one) and call it again.",
    )
