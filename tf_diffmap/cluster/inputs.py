"""Input built on the workers: on a cluster, batches do not cross the chief.

`WorkerInput` builds one pipeline per worker task, from the user's dataset
(serialized on the chief and rebuilt on each worker) or dataset function;
what crosses from the chief is a token per shard (see `WorkerInput`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import task_name
from tf_diffmap.engine.inputs import check_dataset, host_dataset

__all__ = ["WorkerInput"]


class WorkerInput:
    """Input built where the replicas are: one pipeline per worker task.

    On a cluster, batches must not cross the chief. Each worker task builds
    its own pipeline and keeps its own iterator; a replica loop reads its
    shards from its worker's iterator, and what crosses from the chief is a
    token per shard (an empty shard on the strategy's queue), which keeps
    the shared queue's load balancing and its count of what is in flight.

    From a `tf.data.Dataset` of global batches: the dataset's graph is
    serialized on the chief once (`DatasetToGraphV2`; a dataset made from
    NumPy arrays carries them in its graph, so they cross once per `fit`,
    not once per batch) and rebuilt on each worker, which keeps every W-th
    batch (`shard`) and splits each into per-replica batches of
    ceil(B / N) examples (`rebatch`). From a dataset function: the function
    runs on each worker with an `InputContext` (W pipelines, this worker's
    index, N replicas) and makes per-replica batches itself. Either way the
    pipeline repeats, so that a fast worker never runs dry; the epoch is
    counted on the chief, in tokens.

    A worker task that is lost when the input is made gets no pipeline: its
    replicas are not running, and building one there would fail. Its
    pipeline is built when it rejoins (`rebuild`). With a dataset function,
    a lost worker's share of the steps is taken to be the mean of the live
    workers' shares.

    The data is split over the worker tasks *present*: those of the
    cluster, lost ones included (they are expected back), but not the slots
    of a growing cluster that no worker holds (`absent`). When a worker
    joins or leaves, the data is split anew over the workers present then
    (`reshard`): each one's pipeline is rebuilt for its new part, from its
    beginning.

    Args:
        worker_hosts: per replica, the CPU device of its worker task.
        dataset: a dataset of global batches, or None with `dataset_fn`.
        dataset_fn: `InputContext -> tf.data.Dataset` of per-replica batches.
        failed: the strategy's failure flag (ends the chief's tokens).
        lost: the worker tasks (`/job:worker/replica:0/task:<N>`) lost now.
        absent: the worker tasks of slots no worker holds now.
    """

    def __init__(
        self,
        worker_hosts: Sequence[str],
        failed: tf.Variable,
        dataset: tf.data.Dataset | None = None,
        dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset] | None = None,
        lost: Collection[str] = (),
        absent: Collection[str] = (),
    ):
        self.worker_hosts = list(worker_hosts)
        self.workers = list(dict.fromkeys(self.worker_hosts))
        num_replicas = len(self.worker_hosts)
        num_workers = len(self.workers)
        # The workers that read the data (its parts, in this order).
        self.members = [i for i, host in enumerate(self.workers) if task_name(host) not in absent]
        live = [i for i in self.members if task_name(self.workers[i]) not in lost]
        # Iterators replaced while loop calls may still read them.
        self._retired: list = []
        self._dataset_fn = dataset_fn
        self._graph = None
        # The functions of the dataset given, which is rebuilt from its graph
        # and not kept (see `functions`).
        self._source_functions = []
        if dataset is not None:
            check_dataset(dataset)
            self._source_functions = _tf_internal.dataset_functions(dataset)
            element_spec = dataset.element_spec
            self._source_spec = element_spec
            self._per_replica = -(-_global_batch(dataset) // num_replicas)
            try:
                self._graph = tf.raw_ops.DatasetToGraphV2(
                    input_dataset=tf.data.experimental.to_variant(dataset),
                    external_state_policy=_FAIL_ON_EXTERNAL_STATE,
                    strip_device_assignment=True,
                )
            except tf.errors.OpError as error:
                raise ValueError(
                    "On a cluster every worker task builds the input pipeline "
                    "itself, and this dataset cannot be rebuilt on another task: "
                    f"{_first_line(error.message)} Build it from a function "
                    "instead, on each worker: "
                    "strategy.distribute_datasets_from_function(lambda context: ...) "
                    "(see 'Where the input is built' in docs/cluster.md)."
                ) from error
            self.datasets = [self._pipeline(i) if i in live else None for i in range(num_workers)]
            cardinality = int(dataset.cardinality())
            if cardinality == tf.data.UNKNOWN_CARDINALITY:
                # Counted once, on the chief (one pass over the pipeline).
                cardinality = int(dataset.reduce(0, lambda count, _: count + 1))
            steps = None if cardinality == tf.data.INFINITE_CARDINALITY else cardinality
        else:
            self.datasets = [None] * num_workers
            cardinalities = []
            for index in live:
                self.datasets[index], cardinality = self._made_by_function(index)
                cardinalities.append(cardinality)
            element_spec = self.datasets[live[0]].element_spec
            steps = None
            if min(cardinalities) >= 0:
                steps_total = sum(cardinalities) * len(self.members) / len(live)
                steps = -(-round(steps_total) // num_replicas)
        # What the workers' iterators yield (per-replica batches).
        self.element_spec = self.datasets[live[0]].element_spec
        self.iterators = [self._iterator(i) if i in live else None for i in range(num_workers)]
        # Made, not only sent, before a loop reads them (a worker is lost).
        _tf_internal.settle(task_name(self.workers[i]) for i in live)
        self._iterator_of = [self.iterators[self.workers.index(h)] for h in self.worker_hosts]
        token = tf.nest.map_structure(_empty_batch, element_spec)
        ticks = tf.data.Dataset.from_tensors(token)
        ticks = ticks.repeat() if steps is None else ticks.repeat(steps)
        self.tokens = host_dataset(ticks, failed)

    def _pipeline(self, index: int) -> tf.data.Dataset:
        """Worker `index`'s pipeline, rebuilt from the chief's serialized graph."""
        with tf.device(self.workers[index]):
            rebuilt = tf.data.experimental.from_variant(
                tf.raw_ops.DatasetFromGraph(graph_def=self._graph), self._source_spec
            )
            part = rebuilt.shard(len(self.members), self.members.index(index))
            return part.rebatch(self._per_replica).repeat()

    def _made_by_function(self, index: int) -> tuple[tf.data.Dataset, int]:
        context = tf.distribute.InputContext(
            num_input_pipelines=len(self.members),
            input_pipeline_id=self.members.index(index),
            num_replicas_in_sync=len(self.worker_hosts),
        )
        with tf.device(self.workers[index]):
            made = self._dataset_fn(context)
            check_dataset(made)
            return made.repeat(), int(made.cardinality())

    def _iterator(self, index: int):
        with tf.device(self.workers[index]):
            return iter(self.datasets[index].prefetch(2))

    def rebuild(self, task: str, restarted: bool = True) -> None:
        """A fresh pipeline and iterator on a worker task that restarted.

        What the task held (its pipeline, its iterator's position) went down
        with it; the new pipeline starts from the beginning of its shard.

        Args:
            task: the worker task, `/job:worker/replica:0/task:<N>`.
            restarted: False for a task that hung and answers again: only a
                pipeline not built while it hung is built; one it has keeps
                its position.
        """
        for index, host in enumerate(self.workers):
            if index not in self.members:
                continue
            if task_name(host) == task and (restarted or self.datasets[index] is None):
                self._build(index)
                _tf_internal.settle([task])
        self._iterator_of = [self.iterators[self.workers.index(h)] for h in self.worker_hosts]

    def _build(self, index: int) -> None:
        """Worker `index`'s pipeline and iterator, for its part now."""
        if self._graph is not None:
            self.datasets[index] = self._pipeline(index)
        else:
            self.datasets[index] = self._made_by_function(index)[0]
        self.iterators[index] = self._iterator(index)

    def reshard(self, lost: Collection[str], absent: Collection[str]) -> None:
        """Splits the data anew over the workers present now: a worker
        joined or left.

        Every present worker that serves gets a pipeline for its new part,
        from its beginning; a lost one gets its own when it rejoins. The
        iterators replaced on workers that stay are kept until this input
        is dropped, since a loop call may still be reading one; those of
        workers that left are let go now, while they still serve.

        Args:
            lost: the worker tasks lost now.
            absent: the worker tasks of slots no worker holds now.
        """
        members = [i for i, host in enumerate(self.workers) if task_name(host) not in absent]
        if members == self.members:
            return
        self.members = members
        built = []
        for index, host in enumerate(self.workers):
            if self.iterators[index] is not None and index in members:
                self._retired.append((self.datasets[index], self.iterators[index]))
            self.datasets[index] = None
            self.iterators[index] = None
            if index in members and task_name(host) not in lost:
                self._build(index)
                built.append(task_name(host))
        _tf_internal.settle(built)
        self._iterator_of = [self.iterators[self.workers.index(h)] for h in self.worker_hosts]

    def functions(self) -> list:
        """The traced functions this input holds, the given dataset's included.

        While they are held, the eager context does not remove them from
        the remote tasks (`_tf_internal.dataset_functions`).
        """
        found = list(self._source_functions)
        retired = [dataset for dataset, _ in self._retired]
        for dataset in [*self.datasets, *retired, self.tokens]:
            if dataset is not None:
                found.extend(_tf_internal.dataset_functions(dataset))
        return found

    def iterator_for(self, replica_id: int):
        """The iterator of the replica's worker task."""
        return self._iterator_of[replica_id]


# `DatasetToGraphV2`: refuse a dataset whose functions hold state outside it
# (a variable, a py_function), which cannot be rebuilt on another task.
_FAIL_ON_EXTERNAL_STATE = 2


def _first_line(message: str) -> str:
    """A runtime error's own sentence, without its op and function names."""
    line = re.sub(r"\{\{[^}]*\}\}\s*", "", message.splitlines()[0])
    return re.sub(r"\s*\[Op:.*$", "", line).strip()


def _global_batch(dataset: tf.data.Dataset) -> int:
    """The batch size B of a dataset of batches (its static size, else its first)."""
    for spec in tf.nest.flatten(dataset.element_spec):
        if spec.shape.rank:
            if spec.shape[0] is not None:
                return int(spec.shape[0])
            break
    first = next(iter(dataset.take(1)))
    for tensor in tf.nest.flatten(first):
        if tensor.shape.rank:
            return int(tensor.shape[0])
    raise ValueError(
        "tf_diffmap.Strategy on a cluster splits batches between replicas, and "
        f"this dataset's elements have no batch dimension ({dataset.element_spec}). "
        "Batch the dataset (`dataset.batch(n)`)."
    )


def _empty_batch(spec: tf.TensorSpec) -> tf.Tensor:
    """An element of `spec`'s structure with no examples: a token."""
    if not spec.shape.rank:
        return tf.zeros([], spec.dtype)
    return tf.zeros([0, *(d or 0 for d in spec.shape.as_list()[1:])], spec.dtype)
