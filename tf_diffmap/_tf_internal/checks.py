"""Whether the TensorFlow and Keras found have the internals tf_diffmap uses.

`check_compatibility` runs when a `Strategy` is built: it looks up every
private hook, member and module the package relies on, and their
parameters, and fails naming each one that moved. It cannot tell whether
TensorFlow still calls a hook where it did: tests/test_tf_internal.py runs
each through TensorFlow and Keras for that.
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.eager import context, record
from tensorflow.python.ops import control_flow_util, resource_variable_ops, summary_ops_v2
from tensorflow.python.trackable import base as trackable_base

from tf_diffmap._tf_internal.distribute import ExtendedBase
from tf_diffmap._tf_internal.graphs import OPERATION_MEMBERS
from tf_diffmap._tf_internal.keras_internals import OPTIMIZER_SLOTS
from tf_diffmap._tf_internal.remote_functions import STREAMING
from tf_diffmap._tf_internal.variables import ResourceVariable

# The TensorFlow releases whose internals the package was tested with.
TESTED_TENSORFLOW = ("2.21", "2.22")

# Private hooks of `StrategyExtended` that `extended.AsyncExtended`
# overrides, with the parameters TensorFlow calls them with (None: a
# property). A change in any of them means the strategy may no longer be
# called the way it was written for.
EXTENDED_HOOKS: dict[str, tuple[str, ...] | None] = {
    "_create_variable": ("self", "next_creator"),
    "_validate_colocate_with_variable": ("self", "colocate_with_variable"),
    "_call_for_each_replica": ("self", "fn", "args", "kwargs"),
    "_experimental_distribute_dataset": ("self", "dataset", "options"),
    "_distribute_datasets_from_function": ("self", "dataset_fn", "options"),
    "_experimental_distribute_values_from_function": ("self", "value_fn"),
    "_reduce_to": ("self", "reduce_op", "value", "destinations", "options"),
    "_batch_reduce_to": ("self", "reduce_op", "value_destination_pairs", "options"),
    "_broadcast_to": ("self", "tensor", "destinations"),
    "_gather_to_implementation": ("self", "value", "destinations", "axis", "options"),
    "_replica_ctx_all_reduce": ("self", "reduce_op", "value", "options"),
    "_replica_ctx_update": ("self", "var", "fn", "args", "kwargs", "group"),
    "_update": ("self", "var", "fn", "args", "kwargs", "group"),
    "_update_non_slot": ("self", "colocate_with", "fn", "args", "kwargs", "group"),
    "_local_results": ("self", "val"),
    "_use_merge_call": ("self",),
    "_in_multi_worker_mode": ("self",),
    "_num_replicas_in_sync": None,
}

# Private hooks that the base class does not define but TensorFlow's own
# strategies do, with the parameters they take (None: a property).
BUILT_IN_HOOKS: dict[str, tuple[str, ...] | None] = {
    "_get_local_replica_id": ("self", "replica_id_in_sync_group"),
    "_global_batch_size": None,
}

# Of those, the ones TensorFlow calls, and a caller that must still name them.
CALLED_HOOKS: dict[str, object] = {
    "_get_local_replica_id": tf.distribute.ReplicaContext.__init__,
}

# Private members of `StrategyExtended` that the strategy calls.
CALLED_MEMBERS = ("_container_strategy",)

# Public members of `StrategyExtended` that `extended.AsyncExtended` overrides: they
# need no check here, and tests/test_tf_internal.py exercises them with the
# private ones.
PUBLIC_OVERRIDES = (
    "colocate_vars_with",
    "variable_created_in_scope",
    "read_var",
    "value_container",
    "non_slot_devices",
    "worker_devices",
    "parameter_devices",
    "experimental_between_graph",
    "experimental_should_init",
    "should_checkpoint",
    "should_save_summary",
)

# Private methods of ResourceVariable that `StoreVariable` overrides.
VARIABLE_HOOKS: dict[str, tuple[str, ...]] = {
    "_read_variable_op": ("self", "no_copy"),
}

# Private methods of a variable that `partitioned.PartitionedVariable`
# overrides (besides `_read_variable_op`), and to which Keras' variables hand
# over.
SPLIT_VARIABLE_HOOKS = (
    "_serialize_to_tensors",
    "_restore_from_tensors",
    "_export_to_saved_model_graph",
)


def _parameter_names(obj: object) -> tuple[str, ...]:
    return tuple(inspect.signature(obj).parameters)


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _hook_problem(owner: str, name: str, member, params) -> str | None:
    if member is None:
        return f"{owner} has no `{name}`"
    if params is None:
        if not isinstance(member, property):
            return f"{owner}.{name} is no longer a property"
        return None
    if _parameter_names(member)[: len(params)] != params:
        return f"{owner}.{name} takes {_parameter_names(member)}, expected {params}"
    return None


def _built_in_extended_classes() -> list[type]:
    """TensorFlow's own subclasses of `StrategyExtended` (loaded with tf.distribute)."""
    found, stack = [], [ExtendedBase]
    while stack:
        for cls in stack.pop().__subclasses__():
            stack.append(cls)
            if cls.__module__.startswith("tensorflow."):
                found.append(cls)
    return found


def compatibility_problems() -> list[str]:
    """Returns what differs from the TensorFlow internals tf_diffmap was built on."""
    problems = []
    for name, params in EXTENDED_HOOKS.items():
        member = inspect.getattr_static(ExtendedBase, name, None)
        problem = _hook_problem("tf.distribute StrategyExtended", name, member, params)
        if problem:
            problems.append(problem)
    built_ins = _built_in_extended_classes()
    for name, params in BUILT_IN_HOOKS.items():
        defined = [cls.__dict__[name] for cls in built_ins if name in cls.__dict__]
        if not defined:
            problems.append(f"no tf.distribute strategy defines `{name}` any more")
            continue
        problem = _hook_problem("tf.distribute's own StrategyExtended", name, defined[0], params)
        if problem:
            problems.append(problem)
    for name, caller in CALLED_HOOKS.items():
        if name not in _source(caller):
            problems.append(f"{caller.__qualname__} no longer calls `{name}`")
    for name in CALLED_MEMBERS:
        if not callable(getattr(ExtendedBase, name, None)):
            problems.append(f"tf.distribute StrategyExtended has no `{name}`")
    for name, params in VARIABLE_HOOKS.items():
        problem = _hook_problem(
            "ResourceVariable", name, getattr(ResourceVariable, name, None), params
        )
        if problem:
            problems.append(problem)
    state = getattr(summary_ops_v2, "_summary_state", None)
    if state is None or not all(hasattr(state, a) for a in ("writer", "step", "is_recording")):
        problems.append("tf.summary keeps its per-thread state elsewhere")
    if not callable(getattr(control_flow_util, "GraphOrParentsInXlaContext", None)):
        problems.append("control_flow_util.GraphOrParentsInXlaContext is gone")
    for name in ("_functions", "_inputs"):
        if not callable(getattr(tf.data.Dataset, name, None)):
            problems.append(f"tf.data.Dataset.{name} is gone")
    if not hasattr(tf.raw_ops, "ResourceCountUpTo"):
        problems.append("tf.raw_ops.ResourceCountUpTo is gone")
    for name in OPERATION_MEMBERS:
        if not hasattr(tf.Operation, name):
            problems.append(f"tf.Operation.{name} is gone")
    problems += _per_replica_problems()
    problems += _remote_function_problems()
    problems += _cluster_problems()
    problems += _variable_problems()
    problems += _optimizer_problems()
    problems += _trainer_problems()
    return problems


def _per_replica_problems() -> list[str]:
    """What `distribute.per_replica` relies on: TensorFlow's `PerReplica`,
    made of a tuple of values, which Keras reduces as a replica's values
    (a `DistributedValues` that is a composite tensor)."""
    per_replica = getattr(distribute_values, "PerReplica", None)
    if per_replica is None:
        return ["tensorflow.python.distribute.values.PerReplica is gone"]
    if not issubclass(per_replica, tf.distribute.DistributedValues) or not issubclass(
        per_replica, tf.__internal__.CompositeTensor
    ):
        return ["PerReplica is no longer a DistributedValues composite tensor"]
    if _parameter_names(per_replica.__init__)[:2] != ("self", "values"):
        return [f"PerReplica takes {_parameter_names(per_replica.__init__)}, expected values first"]
    return []


def _remote_function_problems() -> list[str]:
    """What `remote_functions` relies on: the runtime reads whether remote
    requests stream at each request, as TensorFlow's own `async_scope` does
    when it sets the variable for a block of code."""
    if STREAMING not in _source(getattr(context, "async_scope", None)):
        return [f"TensorFlow's eager context no longer switches {STREAMING} per block"]
    return []


def _cluster_problems() -> list[str]:
    """What `distribute.cluster_addresses`, `reconnect_cluster` and
    `set_cluster_task` rely on: the eager context's server definition, read
    and updated in place."""
    problems = []
    if not callable(getattr(context.Context, "get_server_def", None)):
        problems.append("TensorFlow's eager context has no get_server_def")
    update = getattr(context.Context, "update_server_def", None)
    if not callable(update):
        problems.append("TensorFlow's eager context has no update_server_def")
    elif list(inspect.signature(update).parameters)[:2] != ["self", "server_def"]:
        problems.append("Context.update_server_def no longer takes a server_def first")
    return problems


def _variable_problems() -> list[str]:
    """What `StoreVariable` and `PartitionedVariable` rely on."""
    problems = []
    uninitialized = getattr(resource_variable_ops, "UninitializedVariable", None)
    if uninitialized is None:
        problems.append("resource_variable_ops.UninitializedVariable is gone")
    else:
        wanted = {"shape", "dtype", "name", "trainable", "synchronization", "aggregation"}
        missing = wanted - set(_parameter_names(uninitialized.__init__))
        if missing:
            problems.append(f"UninitializedVariable no longer takes {sorted(missing)}")
    if not callable(getattr(record, "record_operation", None)):
        problems.append("tensorflow.python.eager.record.record_operation is gone")
    if not callable(getattr(resource_variable_ops, "variable_accessed", None)):
        problems.append("resource_variable_ops.variable_accessed is gone")
    if getattr(trackable_base, "VARIABLE_VALUE_KEY", None) is None:
        problems.append("Trackable's VARIABLE_VALUE_KEY is gone")
    for name in SPLIT_VARIABLE_HOOKS:
        if not callable(getattr(ResourceVariable, name, None)):
            problems.append(f"ResourceVariable.{name} is gone")
        elif f"self.value.{name}" not in _source(getattr(keras.Variable, name, None)):
            problems.append(f"keras.Variable.{name} no longer hands over to its tf.Variable")
    return problems


def _optimizer_problems() -> list[str]:
    """What `keras_internals` reads of Keras' optimizers."""
    problems = []
    optimizer_classes = keras.optimizers.Optimizer.__mro__
    if not any("_distribution_strategy" in _source(c.__init__) for c in optimizer_classes):
        problems.append("Keras optimizers no longer have `_distribution_strategy`")
    update = None
    for cls in optimizer_classes:
        update = cls.__dict__.get("_distributed_tf_update_step", update)
    if update is None or "self.update_step" not in _source(update):
        problems.append(
            "Keras optimizers no longer hand each update to the strategy as a "
            "function calling `self.update_step`"
        )
    if not callable(getattr(keras.optimizers.Optimizer, "_get_variable_index", None)):
        problems.append("Keras optimizers have no `_get_variable_index`")
    for cls, names in OPTIMIZER_SLOTS.items():
        source = "".join(_source(c) for c in cls.__mro__ if c.__module__.startswith("keras"))
        for attribute in names.values():
            if f"self.{attribute}" not in source:
                problems.append(f"keras.optimizers.{cls.__name__} has no `{attribute}`")
    if "self.apply(" not in _source(keras.optimizers.Optimizer.apply_gradients):
        problems.append(
            "keras optimizers' apply_gradients no longer calls `self.apply` "
            "(tf_diffmap's aggregation replaces `apply` while a step is traced)"
        )
    if "self._trainable_variables" not in _source(keras.optimizers.Optimizer.apply):
        problems.append("Keras optimizers no longer keep `_trainable_variables`")
    sgd_update = _source(keras.optimizers.SGD.update_step)
    if "self.momentum != 0" not in sgd_update or "ops.cast(self.momentum" not in sgd_update:
        problems.append(
            "keras.optimizers.SGD.update_step no longer reads `self.momentum` as a "
            "number it compares with 0, then casts"
        )
    return problems


def _trainer_problems() -> list[str]:
    """What `keras_internals.for_keras_inference` looks for on the stack."""
    problems = []
    for name in ("fit", "evaluate", "predict"):
        method = getattr(keras.Model, name, None)
        module = getattr(method, "__module__", "") or ""
        if not (module.startswith("keras.") and module.endswith("trainer")):
            problems.append(f"keras.Model.{name} is no longer defined in Keras' trainer module")
    if "epoch_iterator = " not in _source(keras.Model.fit):
        problems.append("keras.Model.fit no longer keeps its iterator in `epoch_iterator`")
    # `watch_fit` wraps `keras.Model.fit`: a Sequential model must use it.
    if "fit" in vars(keras.Sequential):
        problems.append("keras.Sequential defines its own `fit`, which `watch_fit` does not see")
    # `build_from_spec` calls Keras' build from a batch's structure.
    build = getattr(keras.Model, "_symbolic_build", None)
    if build is None or "data_batch" not in inspect.signature(build).parameters:
        problems.append("keras.Model._symbolic_build(data_batch=...) is gone")
    return problems


def check_compatibility() -> None:
    """Raises `RuntimeError` if TensorFlow's internals moved.

    Raises:
        RuntimeError: naming every hook that changed, the TensorFlow version
            found and the versions tf_diffmap was tested with.
    """
    problems = compatibility_problems()
    if problems:
        raise RuntimeError(
            f"tf_diffmap was built against TensorFlow {', '.join(TESTED_TENSORFLOW)}"
            f" and found TensorFlow {tf.__version__}, whose internals differ: "
            + "; ".join(problems)
            + ". Install a TensorFlow version that tf_diffmap supports "
            "(see its pyproject.toml)."
        )
