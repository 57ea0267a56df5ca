"""What tf_diffmap reads and changes of Keras' private state.

* Which strategy an optimizer was created under, where it keeps each
  variable's slots, and which optimizer an update handed to the strategy
  belongs to (`optimizer_strategy`, `optimizer_slots`, `optimizer_of_update`).
* SGD's momentum for the length of one traced update (`momentum_of_update`).
* An optimizer's `apply` for the length of a trace (`apply_replaced`), and
  the variables it was built for (`optimizer_trainable_variables`).
* Whether Keras' `evaluate` or `predict` asks for a distributed dataset,
  rather than `fit` (`for_keras_inference`).
* A check at the start of every `keras.Model.fit` (`watch_fit`), and the
  model whose `fit` runs (`fitting_model`).
* Keras' build of a model, its compiled loss and metrics from a batch's
  structure (`build_from_spec`).

Keras 3 offers no public way to do any of these; `checks` says when a Keras
release moves what they rely on, and tests/test_tf_internal.py exercises
each through Keras itself.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable

import keras
import tensorflow as tf


def optimizer_strategy(optimizer: object) -> tf.distribute.Strategy | None:
    """The strategy a Keras optimizer was created under, or None if it keeps none.

    A Keras optimizer remembers the strategy current when it was created and
    creates its variables (momentum, moments) under it.
    """
    return getattr(optimizer, "_distribution_strategy", None)


# Where Keras' optimizers keep their slots: per row-update kind, the slot's
# name in `sparse` and the list attribute of the optimizer that holds it, in
# the order of the optimizer's variables (`_get_variable_index`).
OPTIMIZER_SLOTS: dict[type, dict[str, str]] = {
    keras.optimizers.SGD: {"momentum": "momentums"},
    keras.optimizers.Adam: {
        "momentum": "_momentums",
        "velocity": "_velocities",
        "velocity_hat": "_velocity_hats",
    },
    keras.optimizers.Adagrad: {"accumulator": "_accumulators"},
    keras.optimizers.Ftrl: {"accumulator": "_accumulators", "linear": "_linears"},
}


def optimizer_slots(optimizer, variable) -> dict[str, tf.Variable]:
    """The slot variables that `optimizer` keeps for `variable`, by name.

    Uses Keras' private `_get_variable_index` and slot lists (see
    `OPTIMIZER_SLOTS`), the way each optimizer's own `update_step` does.
    """
    index = optimizer._get_variable_index(variable)  # noqa: SLF001
    for cls, names in OPTIMIZER_SLOTS.items():
        if isinstance(optimizer, cls):
            slots = {}
            for name, attribute in names.items():
                held = getattr(optimizer, attribute, None)
                if held:
                    slot = held[index]
                    slots[name] = slot.value if isinstance(slot, keras.Variable) else slot
            return slots
    return {}


def optimizer_of_update(fn) -> object | None:
    """The Keras optimizer whose update `fn` applies, or None.

    Keras' TensorFlow backend hands each variable's update to the strategy
    (`extended.update(var, fn, args=(gradient, learning_rate))`) as a
    function nested in the optimizer's `_distributed_tf_update_step`, which
    calls `self.update_step`: the optimizer is that function's `self`.
    """
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return None
    for name, cell in zip(code.co_freevars, fn.__closure__, strict=False):
        if name == "self":
            try:
                candidate = cell.cell_contents
            except ValueError:
                return None
            if isinstance(candidate, keras.optimizers.Optimizer):
                return candidate
    return None


class TracedMomentum:
    """Stands in for SGD's `momentum` while one of its updates is traced.

    Keras' SGD tests `self.momentum != 0` in Python, then converts it to a
    tensor (`ops.cast`): this compares as the configured momentum and
    converts to `tensor`, the momentum chosen for this update, through
    TensorFlow's conversion protocol (`__tf_tensor__`), so nothing is
    registered globally.
    """

    def __init__(self, nominal: float, tensor: tf.Tensor):
        self.nominal = nominal
        self.tensor = tensor

    def __tf_tensor__(self, dtype=None, name=None):
        del name
        return self.tensor if dtype is None else tf.cast(self.tensor, dtype)

    def __eq__(self, other):
        return self.nominal == other

    def __ne__(self, other):
        return self.nominal != other

    def __gt__(self, other):
        return self.nominal > other

    def __float__(self):
        return float(self.nominal)

    def __hash__(self):
        return hash(self.nominal)


@contextlib.contextmanager
def momentum_of_update(sgd: keras.optimizers.SGD, momentum: tf.Tensor):
    """Within, `sgd`'s updates use `momentum` (a tensor) as their momentum.

    Keras' SGD takes its momentum from the Python attribute `momentum` at
    each update it traces, and has no argument for it: the attribute is
    swapped for a `TracedMomentum` for the length of the block. Replica
    steps are traced one at a time (see `replica_step.ReplicaStep`), so this races with
    nothing.
    """
    nominal = sgd.momentum
    sgd.momentum = TracedMomentum(nominal, momentum)
    try:
        yield
    finally:
        sgd.momentum = nominal


@contextlib.contextmanager
def apply_replaced(optimizer, apply):
    """Within, calls of `optimizer.apply` (and of its `apply_gradients`,
    which Keras routes through `self.apply`) call `apply` instead.

    Set on the instance, past Keras' attribute tracking, and removed after:
    the class's `apply` is what `apply` itself calls. Replica steps are
    traced one at a time, so this races with nothing.
    """
    object.__setattr__(optimizer, "apply", apply)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "apply")


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a built Keras optimizer updates when `apply` is given
    gradients alone (Keras' private `_trainable_variables`)."""
    return list(optimizer._trainable_variables)  # noqa: SLF001


def for_keras_inference() -> bool:
    """Whether Keras' `evaluate` or `predict` is asking (not `fit`).

    Keras asks the strategy for a distributed dataset from its epoch
    iterator, made in `fit`, `evaluate` or `predict`, and says nothing of
    which: the nearest of these on the caller's stack decides. `fit` makes
    two: its training data's first, then, once its training iterator (its
    local `epoch_iterator`) exists, the validation data's, which `evaluate`
    reads.
    """
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("keras.") and module.endswith("trainer"):
            name = frame.f_code.co_name
            if name in ("evaluate", "predict"):
                return True
            if name == "fit":
                return "epoch_iterator" in frame.f_locals
        frame = frame.f_back
    return False


# The checks `watch_fit` runs, in order, and the mark of its wrapper.
_FIT_CHECKS: list[Callable[[keras.Model], None]] = []
_WATCHED = "_tf_diffmap_watched"
# Per thread, the models whose `fit` runs, innermost last.
_fitting = threading.local()
logger = logging.getLogger("tf_diffmap")


def fitting_model() -> keras.Model | None:
    """The model whose `fit` runs on this thread (the innermost), or None.

    Known once `watch_fit` has wrapped `keras.Model.fit`.
    """
    models = getattr(_fitting, "models", None)
    return models[-1] if models else None


def build_from_spec(model: keras.Model, element_spec) -> None:
    """Builds what Keras builds at the start of `fit` from its first batch
    (the model, its compiled loss and metrics, the optimizer), from the
    batches' structure with an unknown batch size.

    Keras builds them on the first batch it takes from the distributed
    dataset (`_symbolic_build`). Where that batch stands for shards built
    elsewhere and holds no example, its loss is an empty vector, which Keras
    cannot add to a regularizer's penalty. Built here first, they are built
    already when Keras looks. Where this build fails (a model that needs a
    known batch size), Keras' own build runs as before.
    """
    if getattr(model, "_distribute_strategy", None) is None:
        return

    def unknown_batch(spec):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
            return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
        return spec

    batch = tf.nest.map_structure(unknown_batch, element_spec)
    try:
        with model.distribute_strategy.scope():
            model._symbolic_build(data_batch=batch)
    except Exception:  # noqa: BLE001 - Keras' own build runs next, and raises its own error
        logger.debug(
            "Building the model from its batches' structure failed; Keras builds "
            "it from its first batch",
            exc_info=True,
        )


def watch_fit(check: Callable[[keras.Model], None]) -> None:
    """From now on, `check(model)` runs at the start of every `keras.Model.fit`.

    A model built outside every strategy's scope trains under TensorFlow's
    default strategy, and its `fit` calls nothing of the package's; Keras has
    no hook for the start of a `fit`. So `keras.Model.fit` is replaced, once
    per process, by a function that runs the checks and then Keras' own
    `fit` with the same arguments. A check must not raise; it runs for every
    model of the process, so it must be cheap.

    Args:
        check: called with the model whose `fit` starts; added once.
    """
    if check not in _FIT_CHECKS:
        _FIT_CHECKS.append(check)
    if getattr(keras.Model.fit, _WATCHED, False):
        return
    keras_fit = keras.Model.fit

    @functools.wraps(keras_fit)
    def fit(self, *args, **kwargs):
        for each in tuple(_FIT_CHECKS):
            each(self)
        models = _fitting.__dict__.setdefault("models", [])
        models.append(self)
        try:
            return keras_fit(self, *args, **kwargs)
        finally:
            models.pop()

    setattr(fit, _WATCHED, True)
    keras.Model.fit = fit
