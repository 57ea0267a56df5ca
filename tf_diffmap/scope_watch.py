"""Says so when `fit` trains a model that no `Strategy` scope built.

A model and its optimizer built outside every `strategy.scope()` train under
TensorFlow's default strategy: as plain Keras, on one device, with no error,
and the strategy's store version stays 0. Nothing of the strategy runs in
such a `fit`, so each `Strategy` registers here, and `check_fit` runs at the
start of every `keras.Model.fit` of the process (`_tf_internal.watch_fit`).
It warns, once per model, when

* the model holds a variable of a strategy's store although the model was
  not built under that strategy: it was compiled inside the scope (its loss
  tracker's variables went to the store) but built outside it; or
* the model was built under no strategy at all while a strategy exists
  under whose scope no variable was ever created.

A model of another `tf.distribute` strategy is left alone, and so is a plain
Keras model trained beside a strategy whose scope did build a model:
comparing the two is a use, not a mistake. A custom training loop calls no
`fit` and is not checked.
"""

from __future__ import annotations

import warnings
import weakref

import tensorflow as tf

from tf_diffmap import _tf_internal

__all__ = ["register", "check_fit", "unscoped_model_message"]

_strategies: weakref.WeakSet = weakref.WeakSet()
_warned: weakref.WeakSet = weakref.WeakSet()


def register(strategy: tf.distribute.Strategy) -> None:
    """Notes a `tf_diffmap.Strategy`, and has `check_fit` run at every `fit`."""
    _strategies.add(strategy)
    _tf_internal.watch_fit(check_fit)


def _tf_variable(variable):
    return getattr(variable, "value", variable)  # a keras.Variable holds a tf.Variable


def _holds_store_variables(model) -> bool:
    """Whether any of the model's variables, its metrics' or its optimizer's,
    is a variable of a strategy's store (every one is a `StoreVariable`)."""
    variables = list(getattr(model, "variables", []))
    variables += list(getattr(model, "metrics_variables", []))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(getattr(optimizer, "variables", []))
    return any(isinstance(_tf_variable(v), _tf_internal.StoreVariable) for v in variables)


def _built_nothing(strategy) -> bool:
    return sum(strategy.extended.runtime.store.bytes_per_device().values()) == 0


def unscoped_model_message(compiled_in_scope: bool) -> str:
    """The warning, for a model compiled inside a scope or entirely outside."""
    where = (
        "was built outside `with strategy.scope():` of a tf_diffmap.Strategy, "
        "though it was compiled inside it"
        if compiled_in_scope
        else "was built outside every tf_diffmap.Strategy's scope, while a "
        "tf_diffmap.Strategy exists under whose scope nothing was built"
    )
    return (
        f"model.fit trains a model that {where}: it trains as plain Keras, on one "
        "device, and nothing runs asynchronously (strategy.version stays 0). "
        "Build the model, create its optimizer and compile it, all inside "
        "`with strategy.scope():`; fit may then run anywhere."
    )


def check_fit(model) -> None:
    """Warns, once per model, when `model`'s `fit` is not the strategy's."""
    if not _strategies or model in _warned:
        return
    strategy = getattr(model, "distribute_strategy", None)
    if strategy in _strategies:
        return
    optimizer = getattr(model, "optimizer", None)
    if _tf_internal.optimizer_strategy(optimizer) in _strategies:
        return  # The strategy refuses such an optimizer itself, with an error.
    compiled_in_scope = _holds_store_variables(model)
    unscoped = (
        not tf.distribute.has_strategy()
        and strategy is tf.distribute.get_strategy()
        and any(_built_nothing(s) for s in list(_strategies))
    )
    if compiled_in_scope or unscoped:
        _warned.add(model)
        warnings.warn(
            unscoped_model_message(compiled_in_scope),
            UserWarning,
            stacklevel=_tf_internal.user_stacklevel(),
        )
