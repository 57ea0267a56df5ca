"""A traced replica step and how it is fed: dispatch, shards, outputs.

`Program` traces the function Keras hands to `strategy.run` once per device
that replicas compute on (`devices.compute_device`), in a helper thread, and
builds what Keras' graph runs: for a training step native ops that queue one
shard per replica for the replicas' loops (`tf_diffmap.loops`) and return
recent outputs; for any other step a synchronous call on the first replica's
device.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.loops import HeldShard, ShardChannel, drop_function, held_shard, loop_function
from tf_diffmap.outputs import mark_one_replica
from tf_diffmap.step import StepState, tracing_step
from tf_diffmap.workers import ReplicaLoops, ReplicaState

if TYPE_CHECKING:
    from tf_diffmap.strategy import _AsyncExtended

__all__ = ["Program", "batch_size", "is_tensor", "split_in_graph", "stack_in_graph", "stackable"]


def batch_size(tensors) -> tf.Tensor | None:
    """Examples in a shard: the leading dimension of its first batched tensor."""
    for tensor in tensors:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank:
            return tf.shape(tensor, out_type=tf.int64)[0]
    return None


def split_in_graph(tensors, replicas: int) -> list[list[tf.Tensor]]:
    """Splits a batch into one shard per replica, as ops of the caller's graph.

    Shards differ in size by at most one example; a batch smaller than the
    number of replicas leaves some shards empty. Tensors without a batch
    dimension (scalars) go whole to every shard. Splitting in the graph costs
    one op per tensor, run by TensorFlow's executor rather than by Python.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    if replicas == 1 or not batched:
        return [list(tensors)]
    examples = tf.shape(batched[0])[0]
    sizes = examples // replicas + tf.cast(tf.range(replicas) < examples % replicas, tf.int32)
    pieces = [
        tf.split(t, sizes, num=replicas) if t.shape.rank != 0 else [t] * replicas for t in tensors
    ]
    return [list(shard) for shard in zip(*pieces)]


def stackable(tensors) -> bool:
    """Whether a batch's shards may go on a queue stacked (`stack_in_graph`).

    Each shard of a stacked run must hold data: TensorFlow's `enqueue_many`
    does not take items with no elements. So there must be a batched tensor,
    every batched tensor needs a known rank and, past the batch dimension,
    sizes known when tracing and not zero, and the batch must not be known
    to hold no example (a token); such a batch is queued shard by shard.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    if not batched or batched[0].shape.rank is not None and batched[0].shape[0] == 0:
        return False
    return all(
        t.shape.rank is not None and all(d is not None and d > 0 for d in t.shape[1:])
        for t in batched
    )


def stack_in_graph(
    tensors, replicas: int, even: bool = False
) -> tuple[list[tuple[list[tf.Tensor], Any]], Any]:
    """A batch's shards stacked in runs: the shards `split_in_graph` gives.

    The first `examples % replicas` shards hold one example more than the
    others, so the batch is two runs of equal shards: each batched tensor
    splits in two, and each part becomes `[shards, examples per shard, ...]`
    (a scalar is repeated once per shard). Each run then goes on a queue
    with one `enqueue_many` rather than one enqueue per shard, and no
    conditional decides between even and uneven batches. Shards that would
    hold no example (a batch smaller than the replicas) are left out.

    Args:
        tensors: the batch's tensors (`stackable`).
        replicas: how many shards.
        even: the examples are known to divide evenly: one run.

    Returns:
        `(stacked tensors, shards in the run)` per run, and the shards in all.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    examples = tf.shape(batched[0])[0]
    per_shard, larger = examples // replicas, examples % replicas
    if even:
        runs = [(per_shard, replicas)]
        parts = [[t] for t in tensors]
    else:
        smaller = tf.where(per_shard > 0, replicas - larger, 0)
        runs = [(per_shard + 1, larger), (per_shard, smaller)]
        sizes = [size * count for size, count in runs]
        parts = [tf.split(t, sizes) if t.shape.rank != 0 else None for t in tensors]
    stacked = []
    for k, (size, count) in enumerate(runs):
        run = []
        for t, pieces in zip(tensors, parts):
            if t.shape.rank == 0:
                run.append(tf.fill([count], t))
            else:
                rest = tf.shape(pieces[k])[1:]
                run.append(tf.reshape(pieces[k], tf.concat([[count, size], rest], 0)))
        stacked.append((run, count))
    return stacked, (replicas if even else larger + smaller)


def is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, np.ndarray)) or tf.is_tensor(value)


class Program:
    """One traced replica step and how to feed it."""

    def __init__(self, extended: _AsyncExtended, fn, args, kwargs):
        self.extended = extended
        self.structure = (args, kwargs)
        leaves = tf.nest.flatten(self.structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if is_tensor(leaf)]
        self.static_leaves = list(leaves)
        specs = []
        for i in self.tensor_positions:
            leaf = leaves[i]
            if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)):
                raise ValueError(
                    "tf_diffmap.Strategy splits batches of dense tensors into "
                    f"shards, received a {type(leaf).__name__}. Make it dense in the "
                    "input pipeline (`tf.sparse.to_dense(t)` for a SparseTensor, "
                    "`t.to_tensor()` for a RaggedTensor)."
                )
            leaf = tf.convert_to_tensor(leaf)
            shape = leaf.shape
            if shape.rank:
                shape = tf.TensorShape([None]).concatenate(shape[1:])
            specs.append(tf.TensorSpec(shape, leaf.dtype))
            self.static_leaves[i] = None
        self.specs = specs
        self.trains = False
        self.channel: ShardChannel | None = None
        # On a cluster with input on the workers, the queue carries tokens
        # and each loop reads its shards from its worker's iterator.
        self.worker_input = None
        self.loops: ReplicaLoops | None = None
        # Whether a step has finished since the last drain (Keras' graph reads
        # it to choose between a first step and a plain dispatch), and the
        # outputs of the most recently finished replica step.
        self.fresh: tf.Variable | None = None
        self.output_variables: list[tf.Variable] = []
        self._trace(fn)

    def _pack(self, tensors):
        leaves = list(self.static_leaves)
        for i, tensor in zip(self.tensor_positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def _trace(self, fn) -> None:
        extended = self.extended
        strategy = extended._container_strategy()
        install_summary_state = _tf_internal.capture_summary_state()
        dtype_policy = keras.config.dtype_policy()
        result: dict[str, Any] = {}

        # Shards that come from the client host (no input on the workers) are
        # counted there, beside the statistics that record their examples,
        # rather than on the replica's device, whence the count would travel
        # back at every step.
        counted_on_host = extended.worker_hosts is None

        def make_replica_step(device):
            def step_on_device(replica_id, *tensors):
                args, kwargs = self._pack(tensors)
                with tf.device(extended.client_host if counted_on_host else device):
                    examples = batch_size(tensors)
                with (
                    tf.device(device),
                    tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=replica_id),
                ):
                    state = StepState(extended._store, replica_id, examples)
                    with tracing_step(state):
                        with tf.control_dependencies([state.read_version]):
                            outputs = fn(*args, **kwargs)
                        outputs = state.finish(outputs)
                    # Claims this replica has made in all (read after this
                    # step's records): a claim inside a branch may not run.
                    claims = extended._store.claims_of(replica_id)
                    graph = tf.compat.v1.get_default_graph()
                    _tf_internal.place_scalars_beside_reads(graph, device)
                    _tf_internal.pack_crossings(graph)
                result.setdefault("trains", state.claimed)
                return outputs, claims

            return step_on_device

        def trace():
            try:
                install_summary_state()
                keras.config.set_dtype_policy(dtype_policy)
                with strategy.scope():
                    for device in dict.fromkeys(extended.compute_devices):
                        function = tf.function(make_replica_step(device), autograph=False)
                        self.concretes[device] = function.get_concrete_function(
                            tf.TensorSpec([], tf.int32), *self.specs
                        )
                        if not result["trains"]:
                            break  # A synchronous step runs on the first device only.
                if result["trains"]:
                    # Made outside the strategy's scope: not store variables.
                    self._make_feed()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                result["error"] = error

        self.concretes: dict[str, Any] = {}
        thread = threading.Thread(target=trace, name="tf_diffmap-trace")
        thread.start()
        thread.join()
        if "error" in result:
            error = result["error"]
            if isinstance(error, RuntimeError) and "Mixing different tf.distribute" in str(error):
                raise RuntimeError(
                    f"{error} -- an object used in the step (usually the "
                    "optimizer) was created outside `strategy.scope()`. Create "
                    "it inside the scope, for example `with strategy.scope(): "
                    "model.compile(optimizer=keras.optimizers.SGD(...), ...)`."
                ) from error
            raise error
        self.concrete = self.concretes[extended.compute_devices[0]]
        self.trains = result["trains"]
        if self.trains:
            self.loops = ReplicaLoops(
                self,
                len(extended.replica_devices),
                on_error=extended._replica_failed,
                name="tf_diffmap",
                steps_per_loop=extended.steps_per_loop,
                max_staleness=extended.max_staleness,
                worker_timeout=extended.worker_timeout,
                hangs=extended,
            )

    def _output_specs(self):
        outputs, _ = self.concretes[self.extended.compute_devices[0]].structured_outputs
        out_leaves = tf.nest.flatten(outputs)
        positions = [i for i, o in enumerate(out_leaves) if isinstance(o, tf.Tensor)]
        return outputs, out_leaves, positions

    def _flat_outputs(self, outputs) -> list[tf.Tensor]:
        flat = tf.nest.flatten(outputs)
        return [flat[i] for i in self._output_specs()[2]]

    def _pack_outputs(self, tensors):
        structure, leaves, positions = self._output_specs()
        leaves = [None if isinstance(o, tf.Tensor) else o for o in leaves]
        for i, tensor in zip(positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(structure, leaves)

    def _make_feed(self) -> None:
        """The queue, the loop functions and the variables they share."""
        extended = self.extended
        host = extended.client_host
        name = f"tf_diffmap_{len(extended._programs)}"
        self.worker_input = extended.worker_input_for(self.specs)
        self.channel = ShardChannel(
            self.specs,
            extended.queue_size,
            host,
            name,
            replicas=len(extended.replica_devices),
        )
        _, leaves, positions = self._output_specs()
        with tf.init_scope(), tf.device(host):
            self.fresh = tf.Variable(False, trainable=False, name=f"{name}_fresh")
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
        self._trace_loops()
        with tf.device(host):
            self.drop_concrete = tf.function(
                drop_function(self.channel), autograph=False
            ).get_concrete_function(tf.TensorSpec([], tf.int32))

            def mark_if_settled(excused):
                settled = self.channel.settled(excused)

                def mark():
                    with tf.control_dependencies([self.fresh.assign(False, read_value=False)]):
                        return tf.identity(settled)

                return tf.cond(settled, mark, lambda: tf.identity(settled))

            self._mark_if_settled = tf.function(
                mark_if_settled, autograph=False
            ).get_concrete_function(tf.TensorSpec([], tf.int64))

    def _trace_loops(self) -> None:
        """The replicas' loop functions, for the input they read now."""
        extended = self.extended
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
        devices = extended.compute_devices
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
                self.channel, apply_shard, self._skip, self._loop_start, self._stamp, fetch
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
            # here, once, rather than in a replica's first loop call.
            if self.loops is None or self.loops.states()[replica] is not ReplicaState.LOST:
                concrete(*named, tf.constant(0, tf.int32), *self._sources(replica))

    def follow_input(self) -> None:
        """Reads the latest distributed dataset's pipelines on the workers.

        Each `fit` distributes its dataset anew (new pipelines on the
        workers), while Keras keeps the traced step, and with it this
        program: before its loops start, the program moves to the pipelines
        of the dataset the chief now iterates tokens of (tracing its loop
        functions again if their elements differ).
        """
        if self.worker_input is None:
            return
        current = self.extended.worker_input_for(self.specs)
        if current is None or current is self.worker_input:
            return
        traced = self.worker_input.element_spec
        self.worker_input = current
        if current.element_spec != traced:
            if self.extended.lost_tasks():
                # Dropped now, they would be removed from the lost worker too.
                self.extended._kept_functions.extend(self.loop_concretes.values())
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
        extended = self.extended
        store = extended._store
        if before is None:
            before = store.claims_of(replica_id)
        with tf.control_dependencies([before]):
            if device is not None:
                outputs, claims = self.concretes[device](replica_id, *shard)
            else:
                outputs, claims = self._call_step(replica_id, shard)
        flat = self._flat_outputs(outputs)
        with tf.control_dependencies([claims, *flat]):
            counted = store.complete(replica_id, claims - before)
            with tf.device(extended.client_host):
                latest = [
                    v.assign(o, read_value=False) for v, o in zip(self.output_variables, flat)
                ]
        done = tf.group([counted, *latest])
        with tf.control_dependencies([done]):
            return outputs, done, tf.identity(claims)

    def _loop_start(self, replica_id):
        return self.extended._store.claims_of(replica_id), self.extended.failed.read_value()

    def _stamp(self, replica_id):
        # Beside the queue, where the stamp is written: no round trip.
        with tf.device(self.extended.client_host):
            return tf.gather(self.extended._store.steps(), replica_id) + 1

    def _call_step(self, replica_id, shard):
        devices = list(dict.fromkeys(self.extended.compute_devices))
        if len(devices) == 1:
            return self.concretes[devices[0]](replica_id, *shard)
        device_of = tf.constant([devices.index(d) for d in self.extended.compute_devices], tf.int32)
        branches = [
            functools.partial(lambda c: c(replica_id, *shard), self.concretes[d]) for d in devices
        ]
        return tf.switch_case(tf.gather(device_of, replica_id), branches)

    def _skip(self, item, failed) -> tf.Tensor:
        if self.worker_input is not None:
            return failed  # A token stands for a shard of the worker's input.
        examples = batch_size(item)
        empty = tf.constant(False) if examples is None else tf.equal(examples, 0)
        return tf.logical_or(empty, failed)

    # -- in Keras' graph --------------------------------------------------

    def call_in_graph(self, args, kwargs):
        """A synchronous step: drain, then run on the first replica device."""
        leaves = tf.nest.flatten((args, kwargs))
        tensors = [leaves[i] for i in self.tensor_positions]
        drained = tf.py_function(self._drain, [], tf.bool, name="tf_diffmap_drain")
        with tf.control_dependencies([drained]):
            outputs, _ = self.concrete(tf.constant(0, tf.int32), *tensors)
        return outputs

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
        drain. No op here waits for a replica (a full queue
        holds the enqueue back without holding a thread).

        With a single inter-op thread, the call that applies the first shard
        would wait for the thread its own op holds: the first step then
        applies its first shard in Keras' graph (`_first_step_call`).
        """
        leaves = tf.nest.flatten((args, kwargs))
        tensors = [tf.convert_to_tensor(leaves[i]) for i in self.tensor_positions]
        fresh = self.fresh.read_value()
        if self.worker_input is not None:
            started = tf.cond(fresh, lambda: tf.constant(True), self._start_in_graph)
            with tf.control_dependencies([started]):
                flat = self._dispatch_in_graph(tensors)
        elif self.extended.graph_may_wait():
            with tf.control_dependencies([fresh]):
                queued = self._put_batch(tensors)
            with tf.control_dependencies([queued]):
                started = tf.cond(
                    fresh, lambda: tf.constant(True), lambda: self._start_in_graph(first=True)
                )
            with tf.control_dependencies([started]):
                flat = self._latest_outputs()
        else:
            flat = tf.cond(
                fresh,
                lambda: self._dispatch_in_graph(tensors),
                lambda: self._first_step_call(
                    split_in_graph(tensors, len(self.extended.replica_devices))
                ),
            )
        # Both ways end with a flag, so that a step without tensor outputs
        # still runs them; a counter snapshot, when one is due, follows.
        recorded = self.extended.snapshots.record_in_graph(flat)
        with tf.control_dependencies([recorded]):
            flat = [tf.identity(t) for t in flat[:-1]]
        return self._one_replica_outputs(flat)

    def _one_replica_outputs(self, flat):
        """One replica step's outputs, marked as such for `strategy.reduce`."""
        return mark_one_replica(self._pack_outputs(flat), len(self.extended.replica_devices))

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
        extended = self.extended
        steps = extended._store.steps()
        pick = tf.argmin if extended.max_staleness is not None else tf.argmax
        replica_id = tf.cast(pick(steps), tf.int32)
        outputs, done, _ = self._run_replica_step(replica_id, shards[0])
        with tf.control_dependencies([done]):
            marked = self.fresh.assign(True, read_value=False)
        with tf.control_dependencies([marked]):
            started = tf.py_function(self._start_loops, [], tf.bool, name="tf_diffmap_start_loops")
        with tf.control_dependencies([started]):
            queued = self.channel.put(shards[1:])
        flat = self._flat_outputs(outputs)
        with tf.control_dependencies([queued]):
            return [*(tf.identity(t) for t in flat), tf.constant(True)]

    def _put_batch(self, tensors) -> tf.Operation:
        """Queues a batch as one shard per replica, a run of equal shards
        per op (`stack_in_graph`): one run where the batch's size is known
        to divide evenly (a static batch size that is a multiple of the
        replicas), two otherwise. One replica, or a batch that cannot be
        stacked (a token: no examples), is queued shard by shard."""
        replicas = len(self.extended.replica_devices)
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
        with tf.control_dependencies([self.fresh.assign(True, read_value=False)]):
            started = tf.py_function(start, [], tf.bool, name="tf_diffmap_start_loops")
        started.set_shape([])
        return started

    def _dispatch_in_graph(self, tensors):
        queued = self._put_batch(tensors)
        with tf.control_dependencies([queued]):
            return self._latest_outputs()

    def _latest_outputs(self):
        """The most recently finished replica step's outputs, and a flag."""
        return [*(v.read_value() for v in self.output_variables), tf.constant(True)]

    # -- from Python ----------------------------------------------------------

    def _drain(self):
        self.extended._drain_from_graph()
        return True

    def _start_loops(self, first: bool = False):
        """Starts the loops (from Keras' graph, at the first step after a
        drain); with `first`, one queued shard is applied before, in this
        thread (see `dispatch_in_graph`)."""
        self.follow_input()
        self.extended.faults.resume()
        self.loops.start(on_idle=self.mark_idle, first=first)
        return True

    def mark_idle(self) -> bool:
        """After the loops stopped for want of shards: the next step is a
        first step again, unless shards arrived while they stopped.

        Called from the loops' idle monitor while a step may be running. A
        step that read the loops as running puts its shards after their
        STOP items; were the program then marked drained, steps after it
        would fill the queue with nobody to take from it. The check and the
        mark are one function: at most the step in flight (it read the mark
        before it was set) puts shards after them, which the next step, a
        first step, starts the loops for (the queue holds a step's shards).

        Returns:
            Whether it marked the program drained; False: the loops go on.
        """
        if self.fresh is None:
            return True
        if not bool(self._mark_if_settled(tf.constant(self.loops.excused(), tf.int64))):
            return False
        self.extended.faults.pause()
        return True

    def mark_drained(self) -> None:
        """Nothing in flight: the next step is a first step again."""
        if self.fresh is not None:
            self.fresh.assign(False)
        self.extended.faults.pause()

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

    def in_flight(self) -> int:
        """Shards queued or being applied, but for those hung calls hold,
        which nobody waits for."""
        excused = self.loops.excused() if self.loops is not None else 0
        return self.channel.pending(excused)

    def resync(self) -> None:
        """With no loop running: nothing in flight but what hung calls hold."""
        self.channel.resync(self.loops.excused() if self.loops is not None else 0)

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
        store = self.extended._store
        may_requeue = requeue and self.worker_input is not None

        def marked() -> bool:
            if not requeue:
                # A failed replica's shard is not run again either way; its
                # claim, if any, is settled as the error is raised (the ps
                # may be gone).
                return False
            try:
                return store.cut_after_mark(replica_id)
            except tf.errors.OpError:
                return True  # Unknown: not run again, rather than twice.

        fate = held_shard(store.steps_per_replica()[replica_id] >= stamp, marked, may_requeue)
        self.channel.release(replica_id, requeue=fate is HeldShard.REQUEUED)
        return True

    def replica_steps(self) -> list[int]:
        return self.extended.replica_steps()
