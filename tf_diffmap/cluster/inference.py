"""A step that applies no update on a cluster, split over the workers present.

Keras' `evaluate`, `predict` and the validation inside `fit` call
`strategy.run` with a step that claims no version. On a cluster that step
runs as on one host (`tf_diffmap.engine.inference`): after a drain, each
batch is cut into one shard per replica slot (the training's unit,
`shards.split_in_graph`), and the shards run at the same time on the
replicas of every worker present, lost and absent ones left out. Unlike
one host, a replica may be lost mid-batch, so:

- the step is traced with its writes held as outputs
  (`ReplicaStep(defer_writes=True)`): a metric's `v.assign(v + d)` returns
  `d` rather than writing it;
- the shards are handed to the live replicas by a `shard_run.ShardRun`
  from a `tf.py_function` of Keras' graph: a shard whose replica is lost
  or hung runs again on another, and each shard's result is kept once;
- the graph then applies every shard's held writes, summed, once: a
  metric's state is the sum of every shard's contribution, each counted
  once, as Keras merges `MirroredStrategy`'s replicas.

`strategy.run` returns one value per shard (`_tf_internal.per_replica`), in
shard order, which Keras reduces as it reduces `MirroredStrategy`'s: the
mean of the test step's results, the concatenation of the predictions (in
input order). The metrics a step returns are read before its batch's writes
are applied (a read inside the step does not see them); what `evaluate`
returns is read after the last batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.cluster.shard_run import ShardRun
from tf_diffmap.devices import task_name
from tf_diffmap.engine.shards import split_in_graph
from tf_diffmap.engine.threads import in_clean_thread

if TYPE_CHECKING:
    from tf_diffmap.engine.replica_step import ReplicaStep
    from tf_diffmap.engine.runtime import Runtime

__all__ = ["ClusterInference"]


class ClusterInference:
    """A step that applies no update, its shards run on a cluster's live workers.

    Each batch is cut into one piece per replica slot; the pieces of one
    worker slot are that slot's shard, and a live worker runs a shard in
    one call: every piece at once, each on one of its own replicas' compute
    devices, and the results copied to this host inside the call. A worker
    runs its own slot's shard, and a lost or absent slot's shard goes to
    whichever live worker takes it first (`shard_run.ShardRun`).

    Args:
        step: the replica step, traced for every compute device with its
            writes held (`ReplicaStep(defer_writes=True)`), which does not
            train.
        runtime: the strategy's runtime (devices, record, drain).
        split: whether a batch is cut into one piece per replica slot; else
            it runs whole, as one piece (a step that assigns a variable
            other than by adding to it: `inference.splits_over_replicas`).

    Attributes:
        pieces: how many pieces each batch is cut into.
        shards_run: per replica, the pieces whose result it gave (each
            counted once, on the replica whose call was kept).
        shards_run_again: the shards run again on another worker, their
            first worker lost or hung.
    """

    def __init__(self, step: ReplicaStep, runtime: Runtime, split: bool):
        if step.deferred is None:
            raise ValueError("ClusterInference runs a step traced with defer_writes=True.")
        self.step = step
        self.runtime = runtime
        devices = runtime.replica_devices
        tasks: dict[str, list[int]] = {}
        for replica, device in enumerate(devices):
            tasks.setdefault(task_name(device), []).append(replica)
        # Per worker slot, its replicas; the pieces of a batch, per slot.
        self._tasks = list(tasks.values())
        self.pieces = len(devices) if split else 1
        self._shares = self._tasks if split else [[0]]
        outputs = step.concrete.structured_outputs[0]
        leaves = tf.nest.flatten(outputs)
        self._output_specs = [leaves[i] for i in step.output_specs()[2]]
        self._written = [variable for variable, _ in step.deferred]
        self.shards_run = [0] * len(devices)
        self.shards_run_again = 0
        # Per (worker slot, pieces in a shard), that worker's call.
        self._calls = in_clean_thread(self._trace_calls)

    # -- Keras' graph ---------------------------------------------------------

    def call_in_graph(self, args, kwargs):
        """Runs the batch's shards (after a drain); the outputs are per piece,
        and the pieces' held writes are applied once."""
        tensors = self.step.tensors_of(args, kwargs)
        out_types = [spec.dtype for spec in self._output_specs] * self.pieces
        out_types += [variable.dtype for variable in self._written]
        # And a flag, so that the call has an output even where the step has
        # none to give.
        with tf.device(self.runtime.client_host):
            flat = tf.py_function(
                self._run, tensors, [*out_types, tf.bool], name="tf_diffmap_inference"
            )[:-1]
        count = len(self._output_specs)
        for k, tensor in enumerate(flat[: count * self.pieces]):
            tensor.set_shape(self._output_specs[k % count].shape)
        writes = []
        for (variable, plain), value in zip(self.step.deferred, flat[count * self.pieces :]):
            value.set_shape(variable.shape)
            write = variable.assign if plain else variable.assign_add
            writes.append(write(value, read_value=False))
        with tf.control_dependencies(writes):
            per_output = [
                _tf_internal.per_replica(
                    tf.identity(flat[k * count + i]) for k in range(self.pieces)
                )
                for i in range(count)
            ]
        return self.step.pack_outputs(per_output)

    # -- this host, in the graph's `tf.py_function` -------------------------------

    def _run(self, *tensors):
        """The batch's shards, run once each; per piece its outputs, then
        the writes."""
        self.runtime.drain_from_graph()
        with tf.device(self.runtime.client_host):
            pieces = split_in_graph(list(tensors), self.pieces)
        shards = [[pieces[r] for r in share] for share in self._shares]
        gone = self.runtime.record.lost() | self.runtime.record.absent()
        runners = [r for replicas in self._tasks for r in replicas[:1] if r not in gone]
        run = ShardRun(self.runtime, self._call, list(enumerate(shards)), runners)
        results = run.run()
        for runner, (index, _) in zip(run.holders(), enumerate(shards)):
            worker = self._tasks[self._slot_of(runner)]
            for k in range(len(self._shares[index])):
                self.shards_run[worker[k % len(worker)]] += 1
        self.shards_run_again += run.run_again()
        count, written = len(self._output_specs), len(self._written)
        outputs, held = [None] * self.pieces, []
        for share, result in zip(self._shares, results):
            for k, piece in enumerate(share):
                outputs[piece] = result[k * count : (k + 1) * count]
            held.extend(result[len(share) * count : len(share) * (count + written)])
        flat = [tensor for piece in outputs for tensor in piece]
        for k, (_, plain) in enumerate(self.step.deferred):
            values = held[k::written]
            # Whole (an assignment): its one value; else the additions.
            flat.append(values[0] if plain else tf.add_n(values))
        return [*flat, True]

    def _slot_of(self, replica: int) -> int:
        return next(w for w, replicas in enumerate(self._tasks) if replica in replicas)

    def _call(self, runner: int, shard):
        """A live worker's call of a shard: per piece, its outputs, then
        every piece's held writes, on this host (a lost worker fails it)."""
        _, pieces = shard
        call = self._calls[(self._slot_of(runner), len(pieces))]
        return call(*[t for piece in pieces for t in piece])

    def _trace_calls(self) -> dict:
        """Per worker slot and shard size, `(*pieces' tensors) -> per piece
        its outputs, then per piece its held writes, then per piece its
        claims`: every piece at once, each on one of the slot's replicas,
        the results copied to this host. Traced without automatic control
        dependencies (`wrap_function`): the pieces' calls would be run one
        after another. A wrapped function keeps only what its outputs need:
        the claims keep a piece whose step gives nothing else."""
        sizes = sorted({len(share) for share in self._shares})
        specs = list(self.step.specs)
        calls = {}
        for slot, replicas in enumerate(self._tasks):
            for size in sizes:

                def call(*tensors, replicas=replicas, size=size):
                    outputs, held, claims = [], [], []
                    for k in range(size):
                        replica = replicas[k % len(replicas)]
                        device = self.runtime.compute_devices[replica]
                        piece = tensors[k * len(specs) : (k + 1) * len(specs)]
                        results = self.step.concretes[device](
                            tf.constant(replica, tf.int32), *piece
                        )
                        outputs.extend(self.step.flat_outputs(results[0]))
                        claims.append(results[1])
                        held.extend(results[2])
                    with tf.device(self.runtime.client_host):
                        return [tf.identity(t) for t in outputs + held + claims]

                calls[(slot, size)] = tf.compat.v1.wrap_function(call, specs * size)
        return calls
