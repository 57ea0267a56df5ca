"""How a training step reaches the replicas: shards on a queue, loops that apply them.

For a `ReplicaStep` that trains, `StepFeed` builds what Keras' graph runs at
each step (`dispatch_in_graph`): native ops that split the batch into one
shard per replica, put the shards on a `ShardChannel` (a TensorFlow queue on
the client host), and return the outputs of the most recently finished
replica step. No op of Keras' graph waits for a replica. Each replica's loop
function (`loops.loop_function`), called again and again from its worker
thread (`workers.ReplicaLoops`), takes shards from the queue and runs the
replica step on them, then counts the step done and leaves its outputs where
Keras' graph reads them. The feed is the loops' `LoopRunner`, and registers
itself with the runtime, which drains it and brings replicas back to it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import tensorflow as tf

from tf_diffmap.engine.loops import (
    HeldShard,
    Late,
    ShardChannel,
    drop_function,
    held_shard,
    loop_function,
)
from tf_diffmap.engine.outputs import mark_one_replica
from tf_diffmap.engine.replica_step import ReplicaStep, batch_size
from tf_diffmap.engine.runtime import Runtime
from tf_diffmap.engine.shards import split_in_graph, stack_in_graph, stackable
from tf_diffmap.engine.threads import in_clean_thread
from tf_diffmap.engine.workers import ReplicaLoops, ReplicaState

__all__ = ["StepFeed"]

_names = itertools.count()


class StepFeed:
    """The queue, loop functions and replica loops of one training step.

    Args:
        step: the traced replica step (`step.trains`).
        runtime: the strategy's runtime; the feed registers with it.

    Attributes:
        loops: the replicas' worker threads (`workers.ReplicaLoops`).
        channel: the queue of shards (`loops.ShardChannel`).
        worker_input: on a cluster with input on the workers, what the
            loops read their shards from (the queue then carries tokens).
    """

    def __init__(self, step: ReplicaStep, runtime: Runtime):
        self.step = step
        self.runtime = runtime
        self.replicas = len(runtime.replica_devices)
        self.worker_input = runtime.worker_input_for(step.specs)
        self.output_variables: list[tf.Variable] = []
        self.loops: ReplicaLoops | None = None
        # Made in a clean thread, outside the strategy's scope: none of these
        # variables is a store variable.
        in_clean_thread(self._build, name="tf_diffmap-feed")
        self.loops = ReplicaLoops(
            self,
            self.replicas,
            on_error=runtime.replica_failed,
            name="tf_diffmap",
            steps_per_loop=runtime.steps_per_loop,
            max_staleness=runtime.max_staleness,
            worker_timeout=runtime.worker_timeout,
            hangs=runtime,
            stall_timeout=runtime.ps_timeout,
            absent=runtime.absent_replicas(),
        )
        runtime.add_feed(self)

    def _build(self) -> None:
        """The queue, the variables Keras' graph shares with the loops, and
        the loop functions."""
        runtime = self.runtime
        host = runtime.client_host
        name = f"tf_diffmap_{next(_names)}"
        self.channel = ShardChannel(
            self.step.specs, runtime.queue_size, host, name, replicas=self.replicas
        )
        _, leaves, positions = self.step.output_specs()
        with tf.init_scope(), tf.device(host):
            # Whether the loops run since the last drain: Keras' graph reads
            # it to choose between a first step and a plain dispatch.
            self.started = tf.Variable(False, trainable=False, name=f"{name}_started")
            for i in positions:
                spec = leaves[i]
                known = spec.shape.rank is not None
                shape = [d if d is not None else 0 for d in spec.shape.as_list()] if known else []
                self.output_variables.append(
                    tf.Variable(
                        tf.zeros(shape, spec.dtype),
                        trainable=False,
                        # A dimension the trace left open (a shard's
                        # examples) stays open: shards differ in size.
                        shape=spec.shape if known else tf.TensorShape(None),
                        name=f"{name}_output_{i}",
                    )
                )
        with tf.init_scope():
            self.channel.prepare()
            runtime.prepare_windows()
        self._trace_loops()
        with tf.device(host):
            self.drop_concrete = tf.function(
                drop_function(self.channel), autograph=False
            ).get_concrete_function(tf.TensorSpec([], tf.int32))

            def stop_if_settled(excused):
                settled = self.channel.settled(excused)

                def stop():
                    with tf.control_dependencies([self.started.assign(False, read_value=False)]):
                        return tf.identity(settled)

                return tf.cond(settled, stop, lambda: tf.identity(settled))

            self._stop_if_settled = tf.function(
                stop_if_settled, autograph=False
            ).get_concrete_function(tf.TensorSpec([], tf.int64))

    def _trace_loops(self) -> None:
        """The replicas' loop functions, for the input they read now."""
        runtime = self.runtime
        sources = []
        fetch = None
        if self.worker_input is not None:
            sources = [tf.data.IteratorSpec(self.worker_input.element_spec)]

            def fetch(token, iterator):
                del token  # It only stands for the shard.
                return [tf.convert_to_tensor(t) for t in tf.nest.flatten(iterator.get_next())]

        # A replica alone on the device it computes on has a loop function
        # of its own, its id a constant of it; replicas that share one (all
        # the CPU replicas of a host) share one, their id an argument, so
        # that tracing and graph memory do not grow with the replicas.
        # `loop_concretes`: each function, under the first replica that runs
        # it; `_loop_calls`: per replica, its function and the arguments that
        # name the replica.
        self.loop_concretes = {}
        self._loop_calls = {}
        devices = runtime.compute_devices
        # Where a shard whose gradient came too late for its window goes
        # back on the queue (one host: a queued item is the shard itself).
        gate = runtime.requeue_gate() if fetch is None else None
        late = None if gate is None else Late(gate.late_of, gate.requeued, batch_size)
        first_of = {}
        for replica, device in enumerate(devices):
            shared = devices.count(device) > 1
            named = (tf.constant(replica, tf.int32),) if shared else ()
            if shared and device in first_of:
                self._loop_calls[replica] = (self.loop_concretes[first_of[device]], named)
                continue
            first_of[device] = replica

            def apply_shard(replica_id, shard, claims, device=device):
                return self._run_replica_step(replica_id, shard, device, claims)[2]

            loop = loop_function(
                self.channel,
                apply_shard,
                self._skip,
                self._loop_start,
                self._stamp,
                fetch,
                before_take=runtime.window_waits,
                late=late,
            )
            specs = [tf.TensorSpec([], tf.int32), *sources]
            if shared:
                specs.insert(0, tf.TensorSpec([], tf.int32))
            else:
                loop = functools.partial(loop, replica)
            with tf.device(device):
                concrete = tf.function(loop, autograph=False).get_concrete_function(*specs)
            self.loop_concretes[replica] = concrete
            self._loop_calls[replica] = (concrete, named)
            # A first call (of no steps) prepares the function for running
            # here, once, rather than in a replica's first loop call; not
            # where no worker serves (lost, or a slot no worker holds yet),
            # nor where a worker that is joining has no input yet (its
            # iterator is made as it joins, after which its loop runs).
            if replica in runtime.absent_replicas():
                continue
            sources = self._sources(replica)
            if any(source is None for source in sources):
                continue
            if self.loops is None or self.loops.states()[replica] is not ReplicaState.LOST:
                concrete(*named, tf.constant(0, tf.int32), *sources)

    def follow_input(self) -> None:
        """Reads the latest distributed dataset's pipelines on the workers.

        Each `fit` distributes its dataset anew (new pipelines on the
        workers), while Keras keeps the traced step, and with it this
        feed: before its loops start, the feed moves to the pipelines of
        the dataset the chief now iterates tokens of (tracing its loop
        functions again if their elements differ).
        """
        if self.worker_input is None:
            return
        current = self.runtime.worker_input_for(self.step.specs)
        if current is None or current is self.worker_input:
            return
        traced = self.worker_input.element_spec
        self.worker_input = current
        if current.element_spec != traced:
            if self.runtime.lost_tasks():
                # Dropped now, they would be removed from the lost worker too.
                self.runtime.keep_functions(self.loop_concretes.values())
            self._trace_loops()

    def _sources(self, replica_id: int) -> list:
        if self.worker_input is None:
            return []
        return [self.worker_input.iterator_for(replica_id)]

    # -- one replica step with its bookkeeping (in a graph) --------------------

    def _run_replica_step(self, replica_id, shard, device: str | None = None, before=None):
        """Calls the replica's step, then counts it done.

        A step counts itself completed once it has finished writing, with
        the claims it made (its replica's claims after it, read after its
        updates, less those before it), in one op, and leaves its outputs
        where Keras' graph reads the latest ones.

        Returns:
            The step's outputs, the bookkeeping op, and the replica's claims
            after the step.
        """
        store = self.runtime.store
        if before is None:
            before = store.claims_of(replica_id)
        with tf.control_dependencies([before]):
            if device is not None:
                outputs, claims = self.step.concretes[device](replica_id, *shard)
            else:
                outputs, claims = self._call_step(replica_id, shard)
        flat = self.step.flat_outputs(outputs)
        with tf.control_dependencies([claims, *flat]):
            counted = store.complete(replica_id, claims - before)
            with tf.device(self.runtime.client_host):
                latest = [
                    v.assign(o, read_value=False) for v, o in zip(self.output_variables, flat)
                ]
        done = tf.group([counted, *latest])
        with tf.control_dependencies([done]):
            return outputs, done, tf.identity(claims)

    def _loop_start(self, replica_id):
        return self.runtime.store.claims_of(replica_id), self.runtime.failed.read_value()

    def _stamp(self, replica_id):
        # Beside the queue, where the stamp is written: no round trip.
        with tf.device(self.runtime.client_host):
            return tf.gather(self.runtime.store.steps(), replica_id) + 1

    def _call_step(self, replica_id, shard):
        compute_devices = self.runtime.compute_devices
        devices = list(dict.fromkeys(compute_devices))
        concretes = self.step.concretes
        if len(devices) == 1:
            return concretes[devices[0]](replica_id, *shard)
        device_of = tf.constant([devices.index(d) for d in compute_devices], tf.int32)
        branches = [
            functools.partial(lambda c: c(replica_id, *shard), concretes[d]) for d in devices
        ]
        return tf.switch_case(tf.gather(device_of, replica_id), branches)

    def _skip(self, item, failed) -> tf.Tensor:
        if self.worker_input is not None:
            return failed  # A token stands for a shard of the worker's input.
        examples = batch_size(item)
        empty = tf.constant(False) if examples is None else tf.equal(examples, 0)
        return tf.logical_or(empty, failed)

    # -- in Keras' graph --------------------------------------------------

    def dispatch_in_graph(self, args, kwargs):
        """An asynchronous step: queue the shards, return recent outputs.

        Every step queues its shards and reads the latest outputs. The first
        step after a drain has no recent outputs to return, and no replica
        loop runs: before it reads them, it starts the loops, and first
        applies one queued shard (on the replica with the most steps, or
        under `max_staleness` the fewest) in the thread that starts them,
        so that it returns a real step's outputs. The conditional between
        the two ways takes no tensor of the batch, only the flag, so that an
        ordinary step passes nothing through it. Tokens (input on the
        workers) are not applied there: the first step starts the loops,
        then queues its tokens, and reports the outputs from before the
        drain. No op here waits for a replica (a full queue holds the
        enqueue back without holding a thread).

        With a single inter-op thread, the call that applies the first shard
        would wait for the thread its own op holds: the first step then
        applies its first shard in Keras' graph (`_first_step_call`).
        """
        tensors = [tf.convert_to_tensor(t) for t in self.step.tensors_of(args, kwargs)]
        examples = batch_size(tensors) if self.worker_input is None else None
        if examples is not None:
            # Where windows are fresh, a full window holds a batch: known
            # before any of its shards is pushed.
            targets = self.runtime.window_targets(examples)
            if targets:
                with tf.control_dependencies(targets):
                    tensors = [tf.identity(t) for t in tensors]
        started = self.started.read_value()
        if self.worker_input is not None:
            running = tf.cond(started, lambda: tf.constant(True), self._start_in_graph)
            with tf.control_dependencies([running]):
                flat = self._dispatch_in_graph(tensors)
        elif self.runtime.graph_may_wait:
            with tf.control_dependencies([started]):
                queued = self._put_batch(tensors)
            with tf.control_dependencies([queued]):
                running = tf.cond(
                    started, lambda: tf.constant(True), lambda: self._start_in_graph(first=True)
                )
            with tf.control_dependencies([running]):
                flat = self._latest_outputs()
        else:
            flat = tf.cond(
                started,
                lambda: self._dispatch_in_graph(tensors),
                lambda: self._first_step_call(split_in_graph(tensors, self.replicas)),
            )
        # Both ways end with a flag, so that a step without tensor outputs
        # still runs them; a counter snapshot, when one is due, follows.
        recorded = self.runtime.snapshots.record_in_graph(flat)
        with tf.control_dependencies([recorded]):
            flat = [tf.identity(t) for t in flat[:-1]]
        # One replica step's outputs, marked as such for `strategy.reduce`.
        return mark_one_replica(self.step.pack_outputs(flat), self.replicas)

    def _first_step_call(self, shards):
        """The first step as a call that Keras' graph makes only when it runs.

        The first step runs a replica step on a replica's device; were its
        ops inlined into Keras' step, that step would span every replica
        device, and TensorFlow would run each of Keras' steps as a
        multi-device function (a partition and an executor per device, and
        transfers between them) where one executor on the client host does.
        Called, not inlined, it leaves Keras' step on the client host.
        """
        sizes = [len(shard) for shard in shards]

        def first_step(*flat):
            rebuilt, start = [], 0
            for size in sizes:
                rebuilt.append(list(flat[start : start + size]))
                start += size
            return self._first_step_in_graph(rebuilt)

        call = tf.function(first_step, autograph=False, experimental_attributes={"_noinline": True})
        return call(*[t for shard in shards for t in shard])

    def _first_step_in_graph(self, shards):
        steps = self.runtime.store.steps()
        pick = tf.argmin if self.runtime.max_staleness is not None else tf.argmax
        replica_id = tf.cast(pick(steps), tf.int32)
        outputs, done, _ = self._run_replica_step(replica_id, shards[0])
        with tf.control_dependencies([done]):
            marked = self.started.assign(True, read_value=False)
        with tf.control_dependencies([marked]):
            started = tf.py_function(self._start_loops, [], tf.bool, name="tf_diffmap_start_loops")
        with tf.control_dependencies([started]):
            queued = self.channel.put(shards[1:])
        flat = self.step.flat_outputs(outputs)
        with tf.control_dependencies([queued]):
            return [*(tf.identity(t) for t in flat), tf.constant(True)]

    def _put_batch(self, tensors) -> tf.Operation:
        """Queues a batch as one shard per replica, a run of equal shards
        per op (`stack_in_graph`): one run where the batch's size is known
        to divide evenly (a static batch size that is a multiple of the
        replicas), two otherwise. One replica, or a batch that cannot be
        stacked (a token: no examples), is queued shard by shard."""
        replicas = self.replicas
        if replicas == 1 or not stackable(tensors):
            return self.channel.put(split_in_graph(tensors, replicas))
        size = next(t for t in tensors if t.shape.rank != 0).shape[0]
        even = size is not None and size % replicas == 0
        runs, count = stack_in_graph(tensors, replicas, even=even)
        return self.channel.put_stacked(runs, count)

    def _start_in_graph(self, first: bool = False):
        """Starts the loops from Keras' graph; with `first`, a queued shard
        is applied first, in the starting thread (`_start_loops`)."""
        start = functools.partial(self._start_loops, first=first)
        with tf.control_dependencies([self.started.assign(True, read_value=False)]):
            started = tf.py_function(start, [], tf.bool, name="tf_diffmap_start_loops")
        started.set_shape([])
        return started

    def _dispatch_in_graph(self, tensors):
        queued = self._put_batch(tensors)
        with tf.control_dependencies([queued]):
            return self._latest_outputs()

    def latest_loss(self) -> float | None:
        """The training loss among the most recent replica step's outputs
        (Keras' running mean of the epoch), or None if the step has none."""
        structure, leaves, positions = self.step.output_specs()
        numbered = tf.nest.pack_sequence_as(structure, list(range(len(leaves))))
        index = numbered.get("loss") if isinstance(numbered, dict) else None
        if not isinstance(index, int) or index not in positions:
            return None
        variable = self.output_variables[positions.index(index)]
        return float(variable.numpy()) if variable.shape.rank == 0 else None

    def _latest_outputs(self):
        """The most recently finished replica step's outputs, and a flag."""
        return [*(v.read_value() for v in self.output_variables), tf.constant(True)]

    # -- the loops' lifecycle, from Python (`runtime.Feed`) ------------------

    def _start_loops(self, first: bool = False):
        """Starts the loops (from Keras' graph, at the first step after a
        drain); with `first`, one queued shard is applied before, in this
        thread (see `dispatch_in_graph`)."""
        self.follow_input()
        self.runtime.record.resume()
        self.runtime.training_started()
        self.loops.start(on_idle=self.stop_if_idle, first=first)
        return True

    def stop_if_idle(self) -> bool:
        """After the loops stopped for want of shards: the next step is a
        first step again, unless shards arrived while they stopped.

        Called from the loops' idle monitor while a step may be running. A
        step that read the loops as running puts its shards after their
        STOP items; were the feed then marked drained, steps after it
        would fill the queue with nobody to take from it. The check and the
        mark are one function: at most the step in flight (it read the mark
        before it was set) puts shards after them, which the next step, a
        first step, starts the loops for (the queue holds a step's shards).

        Returns:
            Whether it marked the feed drained; False: the loops go on.
        """
        if not bool(self._stop_if_settled(tf.constant(self.loops.excused(), tf.int64))):
            return False
        self.runtime.record.pause()
        return True

    def mark_drained(self) -> None:
        """Nothing in flight: the next step is a first step again."""
        self.started.assign(False)
        self.runtime.record.pause()

    def running(self) -> bool:
        return self.loops.running()

    def in_worker(self) -> bool:
        return self.loops.in_worker()

    def in_flight(self) -> int:
        """Shards queued or being applied, but for those hung calls hold,
        which nobody waits for."""
        return self.channel.pending(self.loops.excused())

    def wait_idle(self, failed) -> None:
        self.loops.wait_idle(failed=failed)

    def stop(self) -> None:
        self.loops.stop()

    def resync(self) -> None:
        """With no loop running: nothing in flight but what hung calls hold."""
        self.channel.resync(self.loops.excused())

    def rejoin(self, replica_ids: Sequence[int]) -> None:
        self.loops.rejoin(replica_ids)

    def join(self, replica_ids: Sequence[int]) -> None:
        self.loops.join(replica_ids)

    def leave(self, replica_ids: Sequence[int], timeout: float | None) -> list[int]:
        return self.loops.leave(replica_ids, timeout)

    def states(self) -> list[ReplicaState]:
        return self.loops.states()

    def threads(self):
        return self.loops.threads()

    def seconds_waited(self) -> list[float]:
        return self.loops.seconds_waited()

    def queued(self) -> int:
        """Items on the queue now, for a replica to take."""
        return int(self.channel.queue.size())

    # -- what the loops call, from their threads (`workers.LoopRunner`) ------

    def run_loop(self, replica_id: int, max_steps: int) -> tuple[int, bool]:
        """One call of the replica's loop function (in its worker thread)."""
        concrete, named = self._loop_calls[replica_id]
        taken, stopped = concrete(
            *named, tf.constant(max_steps, tf.int32), *self._sources(replica_id)
        )
        return int(taken), bool(stopped)

    def pending(self) -> int:
        """Shards queued or being applied (hung calls' included)."""
        return self.channel.pending()

    def stamps(self) -> list[int]:
        return self.channel.stamps()

    def fence(self, replica_ids, fenced: bool) -> None:
        self.channel.fence(replica_ids, fenced)

    def progress(self) -> tuple[int, int]:
        return self.channel.counts()

    def send_stops(self, count: int) -> None:
        self.channel.send_stops(count)

    def drop_loop(self, replica_id: int, max_steps: int) -> tuple[int, bool]:
        """A failed replica's loop: take items and drop them, on the client host."""
        del replica_id  # Any replica drops the same way.
        taken, stopped = self.drop_concrete(tf.constant(max_steps, tf.int32))
        return int(taken), bool(stopped)

    def release(self, replica_id: int, requeue: bool) -> bool:
        """The item a failed loop call held, once the call has ended.

        Its step completed: it is counted done. It had marked its claim: it
        is abandoned, not run again. Otherwise nothing of it was written: a
        token goes back on the queue (for a live replica to read its own
        shard) if `requeue`, a real shard is counted done (its data went
        down with the call). See `HeldShard`.

        Returns:
            Whether the replica held an item.
        """
        stamp = self.channel.held(replica_id)
        if not stamp:
            return False
        store = self.runtime.store
        may_requeue = requeue and self.worker_input is not None

        def marked() -> bool:
            if not requeue:
                # A failed replica's shard is not run again either way; its
                # claim, if any, is settled as the error is raised (the ps
                # may be gone).
                return False
            # The call has ended, so whether it marked is settled; only the
            # read can fail. An abandoned shard is counted by its mark
            # (`ParameterStore.settle_abandoned`): a guess miscounts one,
            # either a shard taken for marked that was neither completed
            # nor abandoned, or one taken for unmarked that is abandoned and
            # run again. So a read that fails as a worker is lost (with two
            # lost at once, it can name the other) is made again. Any other
            # error (a lost ps's) ends training, and with the store lost
            # nothing is settled: the shard is not run again.
            try:
                return self.runtime.store_call(lambda: store.cut_after_mark(replica_id))
            except tf.errors.OpError:
                return True

        fate = held_shard(store.steps_per_replica()[replica_id] >= stamp, marked, may_requeue)
        self.channel.release(replica_id, requeue=fate is HeldShard.REQUEUED)
        return True

    def replica_steps(self) -> list[int]:
        return self.runtime.store.steps_per_replica()
