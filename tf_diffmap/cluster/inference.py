"""A step that applies no update on a cluster, split over the workers present.

Keras' `evaluate`, `predict` and the validation inside `fit` call
`strategy.run` with a step that claims no version. On a cluster that step
runs as on one host (`tf_diffmap.engine.inference`): after a drain, each
batch is cut into one piece per replica slot (the training's unit,
`shards.split_in_graph`), and the pieces run at the same time on the
replicas of every worker present, lost and absent ones left out. Unlike
one host, a worker may be lost mid-batch, so:

- the step is traced with its writes held as outputs
  (`ReplicaStep(defer_writes=True)`): a metric's `v.assign(v + d)` returns
  `d` rather than writing it;
- from a `tf.py_function` of Keras' graph, while every worker serves, one
  call runs every worker slot's shard (its pieces) on its own worker; if
  that call fails or is slow, or a worker is lost, each slot's shard is
  handed to a live worker by a `shard_run.ShardRun`, and a shard whose
  worker is lost or hung runs again on another; each shard's result is
  kept once;
- the graph then applies every piece's held writes, summed, once: a
  metric's state is the sum of every piece's contribution, each counted
  once, as Keras merges `MirroredStrategy`'s replicas.

`strategy.run` returns one value per piece (`_tf_internal.per_replica`), in
the batch's order, which Keras reduces as it reduces `MirroredStrategy`'s: the
mean of the test step's results, the concatenation of the predictions (in
input order). The metrics a step returns are read before its batch's writes
are applied (a read inside the step does not see them); what `evaluate`
returns is read after the last batch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.cluster.shard_run import ShardRun
from tf_diffmap.devices import task_name
from tf_diffmap.engine.replicas import short_message
from tf_diffmap.engine.shards import split_in_graph
from tf_diffmap.engine.threads import in_clean_thread

if TYPE_CHECKING:
    from tf_diffmap.engine.replica_step import ReplicaStep
    from tf_diffmap.engine.runtime import Runtime

__all__ = ["ClusterInference"]

logger = logging.getLogger("tf_diffmap")

# The least a call of every worker at once is waited for, in seconds.
PATIENCE = 1.0


class ClusterInference:
    """A step that applies no update, its shards run on a cluster's live workers.

    Each batch is cut into one piece per replica slot; the pieces of one
    worker slot are that slot's shard, and a worker runs a shard in one
    call: every piece at once, each on one of its own replicas' compute
    devices, and the results copied to this host inside the call. While
    every slot's worker serves, one call runs every slot's shard on its own
    worker (`_at_once`); otherwise, or when that call fails or is slow,
    each worker runs its own slot's shard and a lost or absent slot's shard
    goes to whichever live worker takes it first (`shard_run.ShardRun`).

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
        # The latest calls of every worker at once: their seconds.
        self._seconds: collections.deque[float] = collections.deque(maxlen=20)
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
        results, waited = None, 0.0
        if None in self._calls and len(runners) == len(self._tasks):
            results, waited = self._at_once(shards)
        if results is None:
            run = ShardRun(self.runtime, self._call, list(enumerate(shards)), runners, waited)
            results = run.run()
            holders = run.holders()
            self.shards_run_again += run.run_again()
        else:
            holders = [replicas[0] for replicas in self._tasks]
        for runner, share in zip(holders, self._shares):
            worker = self._tasks[self._slot_of(runner)]
            for k in range(len(share)):
                self.shards_run[worker[k % len(worker)]] += 1
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

    def _at_once(self, shards) -> tuple[list | None, float]:
        """Every worker slot's own shard in one call, while every worker
        serves: one round trip from this host rather than one per worker.

        Returns:
            Per shard its results, or None where the call failed or did not
            answer within its patience (at most half of `worker_timeout`):
            the shards then run per worker (`ShardRun`), which meets what
            failed again and judges it, and takes a call for hung once the
            batch has waited `worker_timeout` in all. And the seconds waited.
        """
        flat = [t for shard in shards for piece in shard for t in piece]
        box: dict = {}
        done = threading.Event()

        def call():
            try:
                box["results"] = self._calls[None](*flat)
            except Exception as error:  # noqa: BLE001 -- met again per worker, then judged
                box["error"] = error
            finally:
                done.set()

        start = time.monotonic()
        threading.Thread(target=call, name="tf_diffmap-inference-all", daemon=True).start()
        answered = done.wait(self._patience())
        waited = time.monotonic() - start
        if not answered or "error" in box:
            logger.info(
                "An evaluation batch's call of every worker %s; its shards run per worker.",
                f"failed ({short_message(box['error'])})"
                if answered
                else f"did not answer in {waited:.1f} s",
            )
            return None, waited
        self._seconds.append(waited)
        per_shard = [
            len(share) * (len(self._output_specs) + len(self._written) + 1)
            for share in self._shares
        ]
        results, start = [], 0
        for size in per_shard:
            results.append(box["results"][start : start + size])
            start += size
        return results, waited

    def _patience(self) -> float:
        """How long a call of every worker is waited for: ten times the
        median of the latest, at least `PATIENCE` seconds, at most half of
        `worker_timeout`."""
        recent = sorted(self._seconds)
        patience = max(PATIENCE, 10 * recent[len(recent) // 2]) if recent else PATIENCE
        if self.runtime.worker_timeout is not None:
            patience = min(patience, self.runtime.worker_timeout / 2)
        return patience

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
        the results copied to this host; and under the key None, every
        slot's own shard at once, their results one after the other.
        Traced without automatic control dependencies (`wrap_function`):
        the pieces' calls would be run one after another. A wrapped function
        keeps only what its outputs need: the claims keep a piece whose
        step gives nothing else."""
        sizes = sorted({len(share) for share in self._shares})
        specs = list(self.step.specs)
        calls = {}
        for slot in range(len(self._tasks)):
            for size in sizes:

                def call(*tensors, slot=slot, size=size):
                    return self._slot_call(slot, size, tensors)

                calls[(slot, size)] = tf.compat.v1.wrap_function(call, specs * size)
        if len(self._shares) == len(self._tasks):

            def every_slot(*tensors):
                results, start = [], 0
                for slot, share in enumerate(self._shares):
                    end = start + len(share) * len(specs)
                    results.extend(self._slot_call(slot, len(share), tensors[start:end]))
                    start = end
                return results

            calls[None] = tf.compat.v1.wrap_function(every_slot, specs * self.pieces)
        return calls

    def _slot_call(self, slot: int, size: int, tensors) -> list[tf.Tensor]:
        """A slot's call of `size` pieces, traced (see `_trace_calls`)."""
        replicas = self._tasks[slot]
        specs = self.step.specs
        outputs, held, claims = [], [], []
        for k in range(size):
            replica = replicas[k % len(replicas)]
            device = self.runtime.compute_devices[replica]
            piece = tensors[k * len(specs) : (k + 1) * len(specs)]
            results = self.step.concretes[device](tf.constant(replica, tf.int32), *piece)
            outputs.extend(self.step.flat_outputs(results[0]))
            claims.append(results[1])
            held.extend(results[2])
        with tf.device(self.runtime.client_host):
            return [tf.identity(t) for t in outputs + held + claims]
