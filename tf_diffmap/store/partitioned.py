"""Large variables split by rows over the parameter devices.

A table larger than one parameter server should hold (an embedding of many
ids) is split into row ranges, one shard per parameter device, the way
`ParameterServerStrategy`'s `variable_partitioner` splits it. The model
still sees one variable (`PartitionedVariable`): it reads as
the table, a lookup gathers on each shard the rows it holds, a row update
goes to the shard that owns each row, and a checkpoint or a `.keras` file
holds it as one table, which loads without tf_diffmap.

This module decides how many shards a variable gets and which rows each
holds, and is the variable (`PartitionedVariable`); what it needs of
TensorFlow's private API is in `_tf_internal`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import task_name

__all__ = [
    "MIN_SHARD_BYTES",
    "PartitionedVariable",
    "RowPartitioner",
    "RowSplit",
    "resolve_partitioner",
    "shards_for",
]

# The default partitioner's smallest shard: a variable is split only in
# shards of at least this many bytes.
MIN_SHARD_BYTES = 256 << 10

Partitioner = Callable[[tf.TensorShape, tf.DType], object]


class RowPartitioner:
    """Splits a variable by rows in shards of at least `min_shard_bytes`.

    The default of a `Strategy` whose parameter devices are on several
    tasks (a cluster with several ps tasks). Like `tf.distribute`'s
    `MinSizePartitioner`: as many shards as the variable holds
    `min_shard_bytes`, at most `max_shards` (and, in the store, at most one
    per parameter device). Called with a variable's shape and dtype, it
    returns that variable's number of shards, as `Strategy`'s
    `variable_partitioner` takes it.

    Args:
        min_shard_bytes: the smallest shard, in bytes (default 256 KiB).
        max_shards: the most shards of one variable; by default one per
            parameter device.

    Raises:
        ValueError: an argument that is not a positive int.

    Examples:
        >>> import tf_diffmap
        >>> tf_diffmap.RowPartitioner()([100_000, 16], "float32")  # 6.4 MB
        24
        >>> tf_diffmap.RowPartitioner(max_shards=4)([100_000, 16], "float32")
        4
        >>> tf_diffmap.RowPartitioner()([1_000, 16], "float32")  # 64 KB: not split
        1
    """

    def __init__(self, min_shard_bytes: int = MIN_SHARD_BYTES, max_shards: int | None = None):
        if not _positive_int(min_shard_bytes):
            raise ValueError(f"min_shard_bytes must be an int >= 1, received {min_shard_bytes!r}.")
        if max_shards is not None and not _positive_int(max_shards):
            raise ValueError(f"max_shards must be None or an int >= 1, received {max_shards!r}.")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def __call__(self, shape, dtype) -> int:
        shape = tf.TensorShape(shape)
        size = shape.num_elements() * tf.as_dtype(dtype).size
        shards = max(1, size // self.min_shard_bytes)
        return shards if self.max_shards is None else min(shards, self.max_shards)

    def __repr__(self) -> str:
        return (
            f"RowPartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"
        )


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def resolve_partitioner(partitioner, parameter_devices: Sequence[str]) -> Partitioner | None:
    """The partitioner a store uses, from a `Strategy`'s `variable_partitioner`.

    Args:
        partitioner: `"auto"` (a `RowPartitioner` when the parameter devices
            are on several tasks, else none), None (no variable is split),
            or a callable taking a variable's shape and dtype and returning
            its number of shards (an int, or per axis a list whose entries
            past the first are 1, as `tf.distribute`'s partitioners do).
        parameter_devices: the store's devices.

    Returns:
        The callable, or None when no variable is split.

    Raises:
        ValueError: anything else, or a callable that cannot be called with
            a shape and a dtype.
    """
    if isinstance(partitioner, str) and partitioner == "auto":
        tasks = {task_name(d) for d in parameter_devices}
        return RowPartitioner() if len(tasks) > 1 else None
    if partitioner is None:
        return None
    if isinstance(partitioner, str) or not callable(partitioner):
        raise ValueError(
            "variable_partitioner must be 'auto', None, or a callable taking a "
            "variable's (shape, dtype) and returning its number of shards, such as "
            "tf_diffmap.RowPartitioner() or tf.distribute.experimental.partitioners."
            f"MinSizePartitioner(max_shards=...); received {partitioner!r}."
        )
    try:
        inspect.signature(partitioner).bind(tf.TensorShape([2, 2]), tf.float32)
    except TypeError as error:
        raise ValueError(
            "variable_partitioner must take a variable's (shape, dtype) and return "
            f"its number of shards; {partitioner!r} cannot be called so: {error}."
        ) from None
    except ValueError:
        pass  # a builtin without a signature: called as it is
    return partitioner


def shards_for(
    partitioner: Partitioner | None, shape: tf.TensorShape, dtype: tf.DType, devices: int, name: str
) -> int:
    """How many row shards a new variable gets.

    At most one per parameter device and one per row; 1 for a variable
    without rows (a scalar) or of unknown shape.

    Raises:
        ValueError: the partitioner returned something other than a number
            of shards >= 1 (or a list splitting an axis other than the first).
    """
    shape = tf.TensorShape(shape)
    if partitioner is None or devices < 2 or shape.rank in (None, 0):
        return 1
    if not shape.is_fully_defined() or shape[0] < 2:
        return 1
    answer = partitioner(shape, tf.as_dtype(dtype))
    shards = answer
    if isinstance(answer, (list, tuple)):
        if len(answer) != shape.rank or any(a != 1 for a in answer[1:]):
            shards = None
        else:
            shards = answer[0]
    if not _positive_int(shards):
        raise ValueError(
            f"The variable_partitioner returned {answer!r} for variable {name!r} "
            f"of shape {shape.as_list()}: it must return a number of shards >= 1, "
            "or a list with one entry per axis, all 1 but the first (variables are "
            "split by rows only)."
        )
    return min(shards, devices, shape[0])


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Which rows each shard of a split variable holds.

    Shard k holds rows `offsets[k]` to `offsets[k + 1]`: the first
    `rows % shards` shards one row more than the others, as `tf.distribute`
    splits a variable.

    Attributes:
        sizes: rows per shard.
    """

    sizes: tuple[int, ...]

    @classmethod
    def even(cls, rows: int, shards: int) -> RowSplit:
        quotient, extra = divmod(rows, shards)
        return cls(tuple(quotient + (1 if k < extra else 0) for k in range(shards)))

    @property
    def shards(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        return tuple(offsets)

    def slices(self, value: tf.Tensor) -> list[tf.Tensor]:
        """`value` (the whole variable's shape) cut into the shards' rows."""
        offsets = self.offsets
        return [value[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def locate(self, ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The shard of each of `ids` (`[k]`) and its row in that shard (int64)."""
        ids = tf.cast(ids, tf.int64)
        offsets = self.offsets
        bounds = tf.constant(offsets[1:-1], tf.int64)
        shard = tf.reduce_sum(tf.cast(ids[:, None] >= bounds[None, :], tf.int32), axis=1)
        local = ids - tf.gather(tf.constant(offsets[:-1], tf.int64), shard)
        return shard, local

    def partition(self, ids: tf.Tensor, values: tf.Tensor | None = None):
        """Splits `ids` (`[k]`) and their rows `values` by the shard that holds them.

        Returns:
            Per shard: the rows in that shard (int64), the matching values
            (None without `values`), and their positions in `ids` (what
            `stitch` puts them back by).
        """
        ids = tf.reshape(ids, [-1])
        shard, local = self.locate(ids)
        n = self.shards
        local_ids = tf.dynamic_partition(local, shard, n)
        positions = tf.dynamic_partition(tf.range(tf.size(ids)), shard, n)
        parts = tf.dynamic_partition(values, shard, n) if values is not None else [None] * n
        return list(zip(local_ids, parts, positions))

    @staticmethod
    def stitch(positions: Sequence[tf.Tensor], rows: Sequence[tf.Tensor]) -> tf.Tensor:
        """The rows read on each shard, back in the order of the ids asked for."""
        return tf.dynamic_stitch(list(positions), list(rows))


def _scatter_method(method: str):
    def scatter(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(method, sparse_delta)

    scatter.__name__ = method
    scatter.__doc__ = f"`{method}` of each row, on the shard that holds it."
    return scatter


def _unsupported(method: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"{method} is not supported on {self.name!r}, a variable split by rows "
            "over the parameter devices; use the scatter_* methods, which take "
            "row ids (tf.IndexedSlices)."
        )

    refuse.__name__ = method
    return refuse


class PartitionedVariable(_tf_internal.InStore, _tf_internal.UninitializedVariable):
    """A store variable split by rows, one shard per parameter device.

    The model sees one variable of the whole shape, whose handle is made but
    never allocated (an uninitialized variable); each shard is a plain
    resource variable on its own device, holding a range of rows
    (`RowSplit`). Every method reaches the shards:

    * a read joins the shards where the reader runs; inside a replica step,
      the step's row gathers read on each shard only its rows (`_tf_internal.InStore`);
    * `sparse_read` (which `tf.gather` calls) splits the ids by shard,
      gathers each part beside its shard and puts the rows back in order;
    * `assign`, `assign_add` and `assign_sub` write each shard its rows, and
      `scatter_*` sends each row to the shard that holds it;
    * a checkpoint holds the whole value under the variable's one name, and
      a restore splits it again: a checkpoint of a split variable restores
      into a plain one, and the other way round.

    Reads are recorded on the tape as reads of the variable's own handle, so
    a gradient reaches the variable as for any other, as `tf.IndexedSlices`
    for the rows a lookup gathered.

    A SavedModel cannot hold it (`_export_to_saved_model_graph` says so):
    a `.keras` file can, and loads with the table whole.

    Built on `_tf_internal`'s uninitialized variable and tape records; it
    overrides the variable hooks `_read_variable_op`, `_serialize_to_tensors`,
    `_restore_from_tensors` and `_export_to_saved_model_graph` (to which
    Keras' variables hand over), which `_tf_internal.compatibility_problems`
    checks.
    """

    @classmethod
    def build(
        cls,
        shards,
        split: RowSplit,
        name: str | None,
        trainable: bool,
        on_host_access: Callable[[], None] | None = None,
        **kwargs,
    ) -> PartitionedVariable:
        """The variable over `shards`, made beside the first one.

        Args:
            shards: a resource variable per shard, in row order.
            split: which rows each shard holds.
            name: the variable's name.
            trainable: whether the variable is trained.
            on_host_access: see `_tf_internal.InStore`.
            **kwargs: `synchronization`, `aggregation` and
                `distribute_strategy`, as the variable's creator got them.
        """
        first = shards[0]
        shape = tf.TensorShape([sum(split.sizes)]).concatenate(first.shape[1:])
        given = {k: v for k, v in kwargs.items() if v is not None}
        with tf.init_scope(), tf.device(first.device):
            variable = cls(shape=shape, dtype=first.dtype, name=name, trainable=trainable, **given)
        variable._shards = tuple(shards)
        variable._split = split
        variable._on_host_access = on_host_access
        variable._read_as_rows = bool(trainable)
        return variable

    @property
    def shards(self) -> tuple:
        """The shards' variables, in row order."""
        return self._shards

    @property
    def row_split(self) -> RowSplit:
        """Which rows each shard holds."""
        return self._split

    def is_initialized(self, name=None):
        return tf.reduce_all([shard.is_initialized() for shard in self._shards])

    # -- reads ----------------------------------------------------------------

    def _read_whole(self) -> tf.Tensor:
        parts = []
        for shard in self._shards:
            with tf.device(shard.device):
                parts.append(tf.raw_ops.ReadVariableOp(resource=shard.handle, dtype=self.dtype))
        return tf.concat(parts, 0)

    def _is_whole_read(self, tensor) -> bool:
        op = tensor.op
        return (
            op.type == "ConcatV2"
            and len(op.inputs) == len(self._shards) + 1
            and all(_tf_internal.is_read_of(t, s.handle) for t, s in zip(op.inputs, self._shards))
        )

    def _gather_where_stored(self, ids: tf.Tensor) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        parts = self._split.partition(ids)
        shard_rows = functools.partial(tf.raw_ops.ResourceGather, validate_indices=True)
        rows = []
        for shard, (local, _, _) in zip(self._shards, parts):
            with tf.device(shard.device):
                rows.append(shard_rows(resource=shard.handle, indices=local, dtype=self.dtype))
        row_shape = self.shape[1:]
        gathered = tf.reshape(
            RowSplit.stitch([positions for _, _, positions in parts], rows),
            tf.concat([tf.shape(ids), tf.constant(row_shape.as_list(), tf.int32)], 0),
        )
        gathered.set_shape(ids.shape.concatenate(row_shape))
        return gathered

    def _read_variable_op(self, no_copy=False):
        """Joins the shards (or stands in for the read inside a replica step)."""
        self._before_eager_access()
        if self._stands_in():
            return _tf_internal.replica_tracing().stand_in(self)
        value = self._read_whole()
        _tf_internal.record_read(self, value)
        return value

    def sparse_read(self, indices, name=None):
        """Rows `indices`, each gathered beside the shard that holds it."""
        self._before_eager_access()
        ids = tf.convert_to_tensor(indices)
        rows = self._gather_where_stored(ids)
        _tf_internal.record_rows_read(self, ids, rows)
        return rows

    def gather_nd(self, indices, name=None):
        return tf.gather_nd(self.value(), indices, name=name)

    # -- writes ---------------------------------------------------------------

    def _written(self, updates: list, read_value: bool):
        if tf.executing_eagerly():
            return self if read_value else None
        done = tf.group(updates)
        if not read_value:
            return done
        with tf.control_dependencies([done]):
            return self._read_whole()

    def _each_shard(self, method: str, value, read_value: bool):
        self._before_eager_access()
        value = tf.convert_to_tensor(value, self.dtype)
        if not value.shape.is_compatible_with(self.shape):
            raise ValueError(
                f"Cannot {method} a value of shape {value.shape} to variable "
                f"{self.name!r} of shape {self.shape}."
            )
        updates = []
        for shard, part in zip(self._shards, self._split.slices(value)):
            with tf.device(shard.device):
                updates.append(getattr(shard, method)(part, read_value=False))
        return self._written(updates, read_value)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        if _tf_internal.replica_tracing().active:
            delta = self._atomic_delta(value)
            if delta is not None:
                return self.assign_add(delta, read_value=read_value)
        return self._each_shard("assign", value, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._each_shard("assign_add", delta, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._each_shard("assign_sub", delta, read_value)

    def _scatter(self, method: str, sparse_delta):
        self._before_eager_access()
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(f"{method} takes tf.IndexedSlices, received {sparse_delta!r}.")
        values = tf.reshape(
            tf.convert_to_tensor(sparse_delta.values, self.dtype), [-1, *self.shape.as_list()[1:]]
        )
        updates = []
        for shard, (local, part, _) in zip(
            self._shards, self._split.partition(sparse_delta.indices, values)
        ):
            with tf.device(shard.device):
                updates.append(getattr(shard, method)(tf.IndexedSlices(part, local)))
        return self._written(updates, read_value=False) if not tf.executing_eagerly() else self

    scatter_add = _scatter_method("scatter_add")
    scatter_sub = _scatter_method("scatter_sub")
    scatter_update = _scatter_method("scatter_update")
    scatter_max = _scatter_method("scatter_max")
    scatter_min = _scatter_method("scatter_min")
    scatter_mul = _scatter_method("scatter_mul")
    scatter_div = _scatter_method("scatter_div")
    batch_scatter_update = _unsupported("batch_scatter_update")
    scatter_nd_add = _unsupported("scatter_nd_add")
    scatter_nd_sub = _unsupported("scatter_nd_sub")
    scatter_nd_update = _unsupported("scatter_nd_update")
    scatter_nd_max = _unsupported("scatter_nd_max")
    scatter_nd_min = _unsupported("scatter_nd_min")

    # -- checkpoints: one whole value -------------------------------------------

    def _serialize_to_tensors(self):
        self._before_eager_access()
        return {_tf_internal.VARIABLE_VALUE_KEY: self._read_whole()}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[_tf_internal.VARIABLE_VALUE_KEY]
        return self._each_shard("assign", value, read_value=False)

    def _export_to_saved_model_graph(self, *args, **kwargs):
        raise NotImplementedError(
            f"Variable {self.name!r} is split by rows over the parameter devices, "
            "which a SavedModel (tf.saved_model.save, model.export) cannot hold. "
            "Save the model with model.save('model.keras'), load it outside the "
            "strategy's scope (keras.models.load_model: the table is whole there) "
            "and export that model."
        )
