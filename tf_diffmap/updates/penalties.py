"""Weight regularizers: their gradient once per optimizer step, on the store.

A penalty that a layer's `kernel_regularizer`, `bias_regularizer` or
`embeddings_regularizer` puts on a variable depends on the parameters
alone: at a given version every replica computes the same gradient for it.
Where the strategy aggregates shard gradients into steps
(`tf_diffmap.updates.aggregation`), a replica pushes the gradient of its
data only, and the step adds the penalty's gradient once, on the store, at
the parameters it steps. An embedding table's push is then the rows its
lookups touched (`tf.IndexedSlices`), where the penalty's gradient would
have made it dense, the whole table pushed by every replica and added into
its accumulator K times a step.

How: while the strategy traces a replica step, each regularized variable
of the models the step can reach (`models_of`) has its `regularizer`
replaced by a `SplitPenalty`. Its value is the regularizer's, computed
beside the variable (so the loss Keras reports is unchanged, and on a
cluster only a scalar leaves the parameter server); its gradient is None,
and computing it records the variable on the step (`StepState.penalized`):
the penalty reached the loss the step differentiates. The aggregation that
pushes the variable's gradient takes the record and adds
`penalty_gradients` to the window's gradient before its optimizer's step.

The window's step is synchronous training's: Keras scales each replica's
regularization loss by 1 / N, and a window's gradient is its replicas'
gradients summed, scaled to N of them, so the penalty's share of a window
was the penalty's gradient once. It is now that gradient at the parameters
the step updates: with fresh windows (the default) the parameters its
gradients were computed at, as plain Keras' step; with asynchronous
windows the newest ones, where the pushed share was a mean over the
pushes' reads.

What is left as it was: `activity_regularizer` and other `add_loss` terms
(they depend on the inputs, or on what the package cannot see), a penalty
a custom `train_step` or `compute_loss` adds of its own (say so:
`warn_unsplit`), and `Strategy(gradients_per_step=1)`, where every push
is a step of its own and its penalty already is computed once a step.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterable, Sequence

import keras
import tensorflow as tf

from tf_diffmap.store.partitioned import PartitionedVariable
from tf_diffmap.updates.step import current_step, step_reach

__all__ = [
    "SplitPenalty",
    "add_penalty_gradients",
    "models_of",
    "regularized_variables",
    "split_penalties",
    "warn_unsplit",
]


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def device_of(variable) -> str:
    """Where a variable lives (its first shard's device, if split by rows)."""
    variable = _tf_variable(variable)
    if isinstance(variable, PartitionedVariable):
        return variable.shards[0].device
    return variable.device


class SplitPenalty:
    """A variable's regularizer while a replica step is traced.

    Outside an aggregated replica step it is the regularizer. Inside one,
    its value is the regularizer's, computed beside the variable, and has
    no gradient; computing its gradient records on the step that the
    penalty is part of the loss the step differentiates.

    Args:
        variable: the Keras variable.
        regularizer: its regularizer (any callable of its value).
    """

    def __init__(self, variable, regularizer):
        self.variable = variable
        self.regularizer = regularizer

    def __call__(self, value):
        state = current_step()
        if state is None or not state.splits_penalties:
            return self.regularizer(value)
        variable, regularizer = self.variable, self.regularizer

        @tf.custom_gradient
        def penalty(read):
            def gradient(upstream):
                del upstream
                state.penalized[id(variable)] = (variable, regularizer)
                return None

            return tf.convert_to_tensor(regularizer(read)), gradient

        with tf.device(device_of(variable)):
            return penalty(tf.convert_to_tensor(value))

    def get_config(self):
        return self.regularizer.get_config()


def _layers_in(value, depth: int = 1) -> Iterable:
    if isinstance(value, keras.layers.Layer):
        yield value
    elif depth > 0 and hasattr(value, "__dict__") and not inspect.ismodule(value):
        for attribute in vars(value).values():
            if isinstance(attribute, keras.layers.Layer):
                yield attribute


def models_of(fn) -> list:
    """The Keras layers and models a step function can reach: the object a
    bound method belongs to, and those its code names as free variables or
    globals (as `aggregation.optimizers_of` finds optimizers)."""
    owner, named = step_reach(fn)
    found: list = []
    if owner is not None:
        found.extend(_layers_in(owner))
    for value in named:
        found.extend(_layers_in(value, depth=0))
    return list({id(m): m for m in found}.values())


def regularized_variables(models: Sequence) -> list:
    """The trainable Keras variables of `models` that carry a regularizer."""
    found = {}
    for model in models:
        for variable in model.trainable_weights:
            if getattr(variable, "regularizer", None) is not None:
                found[id(variable)] = variable
    return list(found.values())


@contextlib.contextmanager
def split_penalties(variables: Sequence):
    """Within, each variable's regularizer is a `SplitPenalty` of it."""
    swapped = []
    try:
        for variable in variables:
            regularizer = variable.regularizer
            if regularizer is None or isinstance(regularizer, SplitPenalty):
                continue
            variable.regularizer = SplitPenalty(variable, regularizer)
            swapped.append((variable, regularizer))
        yield
    finally:
        for variable, regularizer in swapped:
            variable.regularizer = regularizer


def _penalty_gradient(variable, regularizer) -> tf.Tensor | None:
    """The gradient of `regularizer` at the variable's value now (in a graph)."""
    with tf.device(device_of(variable)):
        value = _tf_variable(variable).read_value()
        with tf.GradientTape() as tape:
            tape.watch(value)
            penalty = tf.convert_to_tensor(regularizer(value))
        return tape.gradient(penalty, value)


def add_penalty_gradients(gradients: Sequence, variables: Sequence, penalties: dict, optimizer):
    """A window's gradients with each penalty's gradient added, once.

    Args:
        gradients: per variable, the window's gradient (a tensor,
            `tf.IndexedSlices` of distinct ids, or None).
        variables: the optimizer's variables.
        penalties: variable index -> its regularizer.
        optimizer: the optimizer that takes the step: a gradient it
            divides by its `loss_scale_factor` (the loss was scaled by it)
            gets the penalty's gradient scaled alike.

    Returns:
        The gradients, a penalized variable's dense.
    """
    out = list(gradients)
    scale = getattr(optimizer, "loss_scale_factor", None)
    for index, regularizer in sorted(penalties.items()):
        variable = variables[index]
        penalty = _penalty_gradient(variable, regularizer)
        if penalty is None:
            continue
        with tf.device(device_of(variable)):
            if scale is not None:
                penalty = penalty * tf.cast(scale, penalty.dtype)
            data = out[index]
            if data is None:
                out[index] = penalty
            elif isinstance(data, tf.IndexedSlices):
                out[index] = tf.tensor_scatter_nd_add(
                    tf.cast(penalty, data.values.dtype),
                    tf.expand_dims(tf.cast(data.indices, tf.int64), 1),
                    data.values,
                )
            else:
                out[index] = data + tf.cast(penalty, data.dtype)
    return out


_warned: set[str] = set()


def warn_unsplit(step_name: str, names: Sequence[str], taken: bool) -> None:
    """Says once per process what happens to penalties that stay per replica.

    Args:
        step_name: the training step.
        names: the regularized variables concerned.
        taken: whether their penalties reached the step's loss through
            `model.losses` but no aggregated optimizer took their gradient
            (else the step's loss did not take them from `model.losses`).
    """
    reason = "untaken" if taken else "unseen"
    if reason in _warned:
        return
    _warned.add(reason)
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if taken:
        what = (
            f"the gradients of {shown} are not applied through an optimizer that "
            "tf_diffmap aggregates (a step that updates them itself?), so their "
            "regularizers' gradients stay in each replica's gradient, as the step "
            "computes them"
        )
    else:
        what = (
            f"the loss it differentiates did not take the regularizers of {shown} "
            "from `model.losses` (a custom `train_step` or `compute_loss`?). "
            "Any penalty the step adds of its own is computed by every replica "
            "and pushed with its gradient (a regularized table's gradient is "
            "then dense, and added K times a step)"
        )
    warnings.warn(
        "tf_diffmap.Strategy adds the gradient of weight regularizers "
        "(kernel_regularizer, bias_regularizer, embeddings_regularizer) once per "
        "optimizer step, on the parameter store, and replicas push the gradient "
        f"of their data only. In the training step {step_name!r} {what}. Take "
        "the penalties from `model.losses` (as `Model.compute_loss` does) to "
        "have them computed once per step.",
        UserWarning,
        stacklevel=3,
    )
