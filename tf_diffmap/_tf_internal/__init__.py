"""Everything tf_diffmap relies on beyond TensorFlow's and Keras' public APIs.

No other module of the package imports `tensorflow.python` or `keras.src`,
walks the stack or rewrites a graph: they use the names below, so that a
TensorFlow or Keras upgrade touches this package alone. Two classes outside
it must define private hooks as methods of their own: the strategy's
`extended.AsyncExtended` (which also calls the `_container_strategy` it inherits)
and `partitioned.PartitionedVariable`; `checks` lists each of their hooks.
`check_compatibility` (run when a `Strategy` is built) fails naming what
moved; tests/test_tf_internal.py runs every hook and rewrite through
TensorFlow and Keras.

Modules, by job:

* `checks`: the hooks and members relied on, and `check_compatibility`.
* `distribute`: the strategy's base classes, per-replica values, XLA, `tf.summary` state, the
  functions a dataset holds, the eager context's cluster (read, renewed, a
  task added or removed), whether the runtime has started.
* `variables`: the parameter store's variables (`StoreVariable`, the
  class a store variable is switched to) and the tape records of reads.
* `row_reads`: reads of large tables by rows inside a replica step.
* `graphs`: rewrites of a traced step's graph (placement, packing of the
  values crossing between tasks, `tf.function`'s control dependencies).
* `frames`: the stack walk that points a warning at the user's line.
* `remote_functions`: remote requests (function registration and removal)
  that do not wait for a task that does not answer.
* `profiles`: the events of a profile that TensorFlow's profiler wrote.
* `keras_internals`: Keras optimizers' strategy, slots and updates, SGD's
  momentum per update, an optimizer's `apply` while a step is traced,
  whether `fit` or `evaluate`/`predict` asks, and a check at the start of
  every `fit`.
"""

from tf_diffmap._tf_internal.checks import (
    BUILT_IN_HOOKS,
    CALLED_HOOKS,
    CALLED_MEMBERS,
    EXTENDED_HOOKS,
    PUBLIC_OVERRIDES,
    SPLIT_VARIABLE_HOOKS,
    TESTED_TENSORFLOW,
    VARIABLE_HOOKS,
    check_compatibility,
    compatibility_problems,
)
from tf_diffmap._tf_internal.distribute import (
    ExtendedBase,
    StrategyBase,
    capture_summary_state,
    cluster_addresses,
    dataset_functions,
    in_xla_context,
    is_mixed_strategy_error,
    per_replica,
    reconnect_cluster,
    replica_values,
    runtime_started,
    set_cluster_task,
)
from tf_diffmap._tf_internal.frames import user_stacklevel
from tf_diffmap._tf_internal.graphs import (
    PACK_MAX_BYTES,
    PACKED_SCOPE,
    nested_graphs,
    pack_crossings,
    place_scalars_beside_reads,
)
from tf_diffmap._tf_internal.keras_internals import (
    OPTIMIZER_SLOTS,
    TracedMomentum,
    apply_replaced,
    build_from_spec,
    fitting_model,
    for_keras_inference,
    momentum_of_update,
    optimizer_of_update,
    optimizer_slots,
    optimizer_strategy,
    optimizer_trainable_variables,
    watch_fit,
)
from tf_diffmap._tf_internal.profiles import ProfileEvent, profile_events
from tf_diffmap._tf_internal.remote_functions import quiet_tasks, settle
from tf_diffmap._tf_internal.row_reads import RowReads, resolve_row_reads, rewire_late_uses
from tf_diffmap._tf_internal.variables import (
    ROWS_READ_BYTES,
    VARIABLE_VALUE_KEY,
    DeferredWrites,
    InStore,
    ResourceVariable,
    StoreVariable,
    UninitializedVariable,
    deferring_writes,
    is_read_of,
    record_read,
    record_rows_read,
    replica_tracing,
)

__all__ = [
    "BUILT_IN_HOOKS",
    "CALLED_HOOKS",
    "CALLED_MEMBERS",
    "EXTENDED_HOOKS",
    "OPTIMIZER_SLOTS",
    "PACK_MAX_BYTES",
    "PACKED_SCOPE",
    "PUBLIC_OVERRIDES",
    "ROWS_READ_BYTES",
    "SPLIT_VARIABLE_HOOKS",
    "TESTED_TENSORFLOW",
    "VARIABLE_HOOKS",
    "VARIABLE_VALUE_KEY",
    "DeferredWrites",
    "ExtendedBase",
    "InStore",
    "ProfileEvent",
    "ResourceVariable",
    "RowReads",
    "StoreVariable",
    "StrategyBase",
    "TracedMomentum",
    "UninitializedVariable",
    "apply_replaced",
    "capture_summary_state",
    "check_compatibility",
    "cluster_addresses",
    "compatibility_problems",
    "dataset_functions",
    "deferring_writes",
    "for_keras_inference",
    "in_xla_context",
    "is_mixed_strategy_error",
    "is_read_of",
    "nested_graphs",
    "momentum_of_update",
    "optimizer_of_update",
    "optimizer_slots",
    "optimizer_strategy",
    "optimizer_trainable_variables",
    "profile_events",
    "pack_crossings",
    "per_replica",
    "place_scalars_beside_reads",
    "quiet_tasks",
    "reconnect_cluster",
    "record_read",
    "record_rows_read",
    "replica_tracing",
    "replica_values",
    "runtime_started",
    "resolve_row_reads",
    "rewire_late_uses",
    "set_cluster_task",
    "settle",
    "user_stacklevel",
    "watch_fit",
    "build_from_spec",
    "fitting_model",
]
