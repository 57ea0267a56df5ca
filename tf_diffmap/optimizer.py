"""`tf_diffmap.AsyncOptimizer`: staleness-aware updates for any Keras optimizer.

It wraps an inner Keras optimizer by composition, as
`keras.optimizers.LossScaleOptimizer` does: the learning rate, its schedule,
weight decay, clipping and `iterations` are the inner optimizer's. For each
update it learns the replica's staleness from the strategy's step and applies
one rule:

- `"none"`: the plain asynchronous update (Hogwild!, Downpour);
- `"inverse"`: learning rate divided by max(1, staleness) (Zhang et al. 2016);
- `"dc"`: delay compensation, DC-ASGD-a (Zheng et al. 2017), which corrects
  the gradient with the parameters the replica read;
- `"drop"`: updates staler than `drop_above` are not applied, and counted;
- a callable `rule(staleness) -> learning-rate factor`, for research.

`drop_above` also combines with `"inverse"`, `"dc"` and callables.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from tf_diffmap import staleness as rules
from tf_diffmap.step import current_step

__all__ = ["AsyncOptimizer"]

RULES = ("none", "inverse", "dc", "drop")

_BASE_ARGUMENTS = (
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
    "learning_rate",
)


@keras.saving.register_keras_serializable(package="tf_diffmap")
class AsyncOptimizer(keras.optimizers.Optimizer):
    """Applies an inner optimizer's updates with a staleness-aware rule.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` instance to wrap.
        staleness: `"none"`, `"inverse"`, `"dc"`, `"drop"`, or a callable
            taking the staleness (int64 scalar tensor) and returning the
            factor (float scalar tensor) the learning rate is multiplied by.
        drop_above: updates with a larger staleness are not applied. Needed by
            `"drop"`; optional with the other rules.
        dc_lambda: lambda_0 of DC-ASGD-a.
        dc_momentum: momentum of DC-ASGD-a's mean square of gradients.
        name: the optimizer's name.
        **kwargs: base optimizer arguments are refused: set them on the inner
            optimizer.

    Raises:
        ValueError: an unknown rule, `"drop"` without `drop_above`, a bad
            value, or an argument that belongs on the inner optimizer.

    Example:
        >>> import keras, tf_diffmap
        >>> strategy = tf_diffmap.Strategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     optimizer = tf_diffmap.AsyncOptimizer(
        ...         keras.optimizers.Adam(1e-3), staleness="inverse")
        ...     model.compile(optimizer=optimizer, loss="mse")
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        staleness: str | Callable = "none",
        drop_above: int | None = None,
        dc_lambda: float = 0.04,
        dc_momentum: float = 0.95,
        name: str | None = None,
        **kwargs,
    ):
        refused = [k for k in kwargs if k in _BASE_ARGUMENTS]
        unknown = [k for k in kwargs if k not in _BASE_ARGUMENTS]
        if refused:
            raise ValueError(
                f"AsyncOptimizer does not take `{'`, `'.join(refused)}`: set "
                "them on the inner optimizer, e.g. AsyncOptimizer("
                "keras.optimizers.Adam(1e-3, weight_decay=1e-4))."
            )
        if unknown:
            raise ValueError(
                f"AsyncOptimizer does not support arguments: `{'`, `'.join(unknown)}`."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "AsyncOptimizer wraps a keras.optimizers.Optimizer instance, "
                f"received {inner_optimizer!r}. Pass e.g. keras.optimizers.Adam(1e-3)."
            )
        if isinstance(inner_optimizer, AsyncOptimizer):
            raise ValueError("AsyncOptimizer cannot wrap another AsyncOptimizer.")
        if not callable(staleness) and staleness not in RULES:
            raise ValueError(
                f"staleness must be one of {RULES} or a callable, received {staleness!r}."
            )
        if staleness == "drop" and drop_above is None:
            raise ValueError(
                'staleness="drop" needs drop_above, the largest staleness of an '
                "update that is still applied (for example drop_above=8)."
            )
        if drop_above is not None and (
            isinstance(drop_above, bool) or not isinstance(drop_above, int) or drop_above < 0
        ):
            raise ValueError(f"drop_above must be an int >= 0, received {drop_above!r}.")
        if not dc_lambda > 0:
            raise ValueError(f"dc_lambda must be > 0, received {dc_lambda!r}.")
        if not 0 <= dc_momentum < 1:
            raise ValueError(f"dc_momentum must be in [0, 1), received {dc_momentum!r}.")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.staleness = staleness
        self.drop_above = drop_above
        self.dc_lambda = float(dc_lambda)
        self.dc_momentum = float(dc_momentum)

    # -- state ------------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        if self.staleness == "dc":
            self._mean_squares = {
                id(v): self.add_variable_from_reference(v, name="dc_mean_square") for v in var_list
            }
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the update -------------------------------------------------------

    def _lr_scale(self, staleness):
        if callable(self.staleness):
            return tf.cast(self.staleness(staleness), tf.float32)
        if self.staleness == "inverse":
            return rules.inverse_lr_scale(staleness)
        return None

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else list(self._trainable_variables)
        )
        grads = list(grads)
        state = current_step()
        if state is None:
            # Outside tf_diffmap.Strategy every update has staleness 0.
            self.inner_optimizer.apply(grads, variables)
            return
        claim = state.claim(after=grads, record=False)
        lr_scale = self._lr_scale(claim.staleness)
        keep = (
            rules.keep_update(claim.staleness, self.drop_above)
            if self.drop_above is not None
            else tf.constant(True)
        )
        state.record(claim, keep, lr_scale)
        if self.staleness == "dc":
            grads = self._compensate(grads, variables, state, claim)

        def apply_inner():
            self.inner_optimizer.apply(grads, variables)
            return tf.constant(True)

        if self.drop_above is None:
            apply_inner()
        else:
            tf.cond(keep, apply_inner, lambda: tf.constant(False))

    def _compensate(self, grads, variables, state, claim):
        compensated = []
        with tf.control_dependencies([claim.staleness]):
            for gradient, variable in zip(grads, variables):
                if gradient is None:
                    compensated.append(None)
                    continue
                tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
                mean_square = self._mean_squares[id(variable)]
                gradient = tf.convert_to_tensor(gradient)
                ms_now = tf.cast(mean_square.value.read_value(), gradient.dtype)
                mean_square.value.assign_add(
                    tf.cast(
                        rules.mean_square_step(ms_now, gradient, self.dc_momentum),
                        mean_square.dtype,
                    )
                )
                params_read = tf.cast(state.read_value_of(tf_variable), gradient.dtype)
                params_now = tf.cast(tf_variable.read_value(), gradient.dtype)
                compensated.append(
                    rules.delay_compensated_gradient(
                        gradient, params_now, params_read, ms_now, self.dc_lambda
                    )
                )
        return compensated

    # -- serialization ---------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        staleness = self.staleness
        if callable(staleness):
            staleness = keras.saving.serialize_keras_object(staleness)
        config.update(
            {
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "staleness": staleness,
                "drop_above": self.drop_above,
                "dc_lambda": self.dc_lambda,
                "dc_momentum": self.dc_momentum,
            }
        )
        for key in _BASE_ARGUMENTS:
            config.pop(key, None)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        staleness = config.pop("staleness")
        if isinstance(staleness, dict):
            staleness = keras.saving.deserialize_keras_object(
                staleness, custom_objects=custom_objects
            )
        known = ("drop_above", "dc_lambda", "dc_momentum", "name")
        kwargs = {k: config[k] for k in known if k in config}
        return cls(inner, staleness=staleness, **kwargs)
