"""`tf_diffmap.AsyncOptimizer`: staleness-aware updates for any Keras optimizer.

It wraps an inner Keras optimizer by composition, as
`keras.optimizers.LossScaleOptimizer` does: the learning rate, its schedule,
weight decay, clipping and `iterations` are the inner optimizer's.

By default the strategy aggregates shard gradients into steps of the inner
optimizer (`Strategy(gradients_per_step="auto")`, `tf_diffmap.updates.aggregation`):
there the wrapper decides, per pushed gradient, whether it is accepted
(`"drop"`, `drop_above`), and `"auto"` is the plain step (`"none"`); a rule
that changes each shard's update is refused with a `ValueError` that says
so. With `Strategy(gradients_per_step=1)` every shard's gradient is an
update of its own: for each update the wrapper learns the replica's
staleness from the strategy's step and applies one rule:

- `"none"`: the plain asynchronous update (Hogwild!, Downpour);
- `"linear"`: learning rate divided by the number of replicas N, the
  synchronous step per example for an update computed on 1/N of the batch
  (Zhang et al. 2016's lr / (1 + s) at the mean staleness N - 1 that N
  overlapping replicas see);
- `"inverse"`: learning rate divided by max(1, staleness) (Zhang et al. 2016);
- `"dc"`: delay compensation, DC-ASGD-a (Zheng et al. 2017), which corrects
  the gradient with the parameters the replica read;
- `"drop"`: updates staler than `drop_above` are not applied, and counted;
- `"gap"`: Gap-Aware (Barkai et al. 2020): each element of the gradient is
  divided by 1 + how far its parameter moved since the read, in typical
  steps of that parameter;
- `"momentum"`: for SGD with momentum, the explicit momentum lowered by the
  momentum that asynchrony adds (Mitliagkas et al. 2016), and the learning
  rate divided by 1 + s (Zhang et al. 2016 at the mean staleness), both
  from s, a moving average of the measured staleness;
- `"auto"` (the default): where gradients are aggregated, `"none"`; where
  every shard's gradient is an update, `"linear"` for
  `keras.optimizers.SGD` with momentum, `"gap"` for SGD without, and
  `"none"` for every other optimizer (adaptive ones such as Adam normalize
  their step, and held without a rule where SGD collapsed);
- a callable `rule(staleness) -> learning-rate factor`, for research.

`drop_above` also combines with every other rule and with callables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import keras
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.store.parameter_store import optimizer_outside_scope_message
from tf_diffmap.updates import rules, sparse
from tf_diffmap.updates.step import current_step

__all__ = ["AsyncOptimizer", "heavy_ball_momentum"]

RULES = ("auto", "none", "linear", "inverse", "dc", "drop", "momentum", "gap")

# The rules that hold where the strategy aggregates gradients into steps: the
# others change each shard's update, which aggregation no longer applies.
AGGREGATED_RULES = ("none", "drop")

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


def optimizer_chain(optimizer):
    """Yields `optimizer`, then each optimizer it wraps (`inner_optimizer`)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        yield optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "inner_optimizer", None)


def find_in_chain(optimizer, kind: type):
    """The first optimizer of `kind` that `optimizer` is or wraps, or None."""
    return next((o for o in optimizer_chain(optimizer) if isinstance(o, kind)), None)


def _aggregates(strategy) -> bool:
    """Whether `strategy` (an optimizer's) aggregates gradients into steps."""
    return getattr(strategy, "gradients_per_step", 1) > 1


def heavy_ball_momentum(optimizer) -> float:
    """The momentum of the `keras.optimizers.SGD` that `optimizer` is or wraps.

    Args:
        optimizer: any Keras optimizer (wrappers are looked through).

    Returns:
        Its momentum, or 0.0 when it is not SGD or has none.
    """
    sgd = find_in_chain(optimizer, keras.optimizers.SGD)
    return 0.0 if sgd is None else float(sgd.momentum)


class _Rows:
    """One gradient as the rules see it: whole, or the rows it touches.

    A dense gradient is read and written whole. A sparse one (an embedding
    lookup's `tf.IndexedSlices`) is summed per distinct id, and the rules
    read and write only those rows of the variable and of their own state:
    the gap and the delay are measured on the touched rows, and an untouched
    row's state does not decay (see `tf_diffmap.updates.sparse`).
    """

    def __init__(self, gradient, variable, state):
        self.variable = variable
        self.state = state
        self.sparse = isinstance(gradient, tf.IndexedSlices)
        if self.sparse:
            self.dense_shape = gradient.dense_shape
            self.ids, self.gradient = sparse.unique_rows(gradient)
        else:
            self.ids, self.gradient = None, tf.convert_to_tensor(gradient)
        self.dtype = self.gradient.dtype

    def of(self, variable) -> _Rows:
        """The same rows of another variable of the same shape (a rule's state)."""
        view = _Rows.__new__(_Rows)
        view.__dict__.update(self.__dict__, variable=variable)
        return view

    def read(self) -> tf.Tensor:
        if self.sparse:
            return self.variable.sparse_read(self.ids)
        return self.variable.read_value()

    def add(self, delta) -> None:
        delta = tf.cast(delta, self.variable.dtype)
        if self.sparse:
            sparse.write_rows(self.variable, "add", self.ids, delta)
        else:
            self.variable.assign_add(delta)

    def params_now(self) -> tf.Tensor:
        return tf.cast(self.read(), self.dtype)

    def params_read(self) -> tf.Tensor:
        """The parameters the gradient was computed at (the step's read)."""
        if self.sparse:
            return tf.cast(self.state.read_rows_of(self.variable, self.ids), self.dtype)
        return tf.cast(self.state.read_value_of(self.variable), self.dtype)

    def gradient_of(self, values):
        """A new gradient, shaped as this one was."""
        if self.sparse:
            return tf.IndexedSlices(values, self.ids, self.dense_shape)
        return values


@keras.saving.register_keras_serializable(package="tf_diffmap")
class AsyncOptimizer(keras.optimizers.Optimizer):
    """Applies an inner optimizer's updates with a staleness-aware rule.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` instance to wrap.
        staleness: `"auto"` (default: `"none"` where the strategy aggregates
            gradients into steps; else `"linear"` for `keras.optimizers.SGD`
            with momentum, `"gap"` for SGD without, else `"none"`), `"none"`,
            `"linear"`, `"inverse"`, `"dc"`, `"drop"`, `"momentum"`, `"gap"`,
            or a callable taking the
            staleness (int64 scalar tensor) and returning the factor (float
            scalar tensor) the learning rate is multiplied by.
        drop_above: updates with a larger staleness are not applied. Needed by
            `"drop"`; optional with the other rules.
        dc_lambda: lambda_0 of DC-ASGD-a.
        dc_momentum: momentum of DC-ASGD-a's mean square of gradients.
        staleness_decay: decay of the moving average of staleness s that
            `"momentum"` takes its momentum, max(0, mu - s / (1 + s)), and
            its learning-rate factor, 1 / (1 + s), from; it starts from
            N - 1 for N replicas (`rules.expected_staleness`).
        gap_decay: decay of `"gap"`'s moving mean square of each
            parameter's steps, whose root is the typical step C the gap
            is measured in.
        sparse_updates: how a sparse gradient (an embedding lookup's
            `tf.IndexedSlices`) is applied. `"lazy"` (the default, also for
            optimizers used without this wrapper) updates only the rows it
            touches, and their slots, for SGD, Adagrad, Adam, AdamW and
            Ftrl: exact for SGD without momentum and Adagrad, while with
            momentum, Adam's moments and Ftrl an untouched row keeps its
            slots and value (TF-Addons' `LazyAdam`). `"dense"` applies Keras'
            own update, which touches every row. See `tf_diffmap.updates.sparse`.
        name: the optimizer's name.
        **kwargs: base optimizer arguments are refused: set them on the inner
            optimizer.

    Raises:
        ValueError: an unknown rule, `"drop"` without `drop_above`, a bad
            value, or an argument that belongs on the inner optimizer.

    Examples:
        >>> import keras, tf_diffmap
        >>> strategy = tf_diffmap.Strategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     optimizer = tf_diffmap.AsyncOptimizer(
        ...         keras.optimizers.Adam(1e-3), staleness="inverse")
        ...     model.compile(optimizer=optimizer, loss="mse")
        >>> optimizer.rule
        'inverse'
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        staleness: str | Callable = "auto",
        drop_above: int | None = None,
        dc_lambda: float = 0.04,
        dc_momentum: float = 0.95,
        staleness_decay: float = 0.95,
        gap_decay: float = 0.99,
        sparse_updates: str = "lazy",
        name: str | None = None,
        **kwargs,
    ):
        refused = [k for k in kwargs if k in _BASE_ARGUMENTS]
        unknown = [k for k in kwargs if k not in _BASE_ARGUMENTS]
        if refused:
            it = "them" if len(refused) > 1 else "it"
            raise ValueError(
                f"AsyncOptimizer does not take `{'`, `'.join(refused)}`: set "
                f"{it} on the inner optimizer, e.g. AsyncOptimizer("
                "keras.optimizers.Adam(1e-3, weight_decay=1e-4))."
            )
        if unknown:
            noun = "arguments" if len(unknown) > 1 else "argument"
            raise ValueError(
                f"AsyncOptimizer does not support the {noun} `{'`, `'.join(unknown)}`; "
                "see help(tf_diffmap.AsyncOptimizer) for the arguments it takes."
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
        if not 0 <= staleness_decay < 1:
            raise ValueError(f"staleness_decay must be in [0, 1), received {staleness_decay!r}.")
        if not 0 <= gap_decay < 1:
            raise ValueError(f"gap_decay must be in [0, 1), received {gap_decay!r}.")
        if sparse_updates not in sparse.SEMANTICS:
            raise ValueError(
                f"sparse_updates must be one of {sparse.SEMANTICS}, received {sparse_updates!r}."
            )
        if staleness == "momentum" and heavy_ball_momentum(inner_optimizer) <= 0:
            raise ValueError(
                'staleness="momentum" lowers the momentum of a keras.optimizers.SGD '
                f"with momentum > 0; received {type(inner_optimizer).__name__} with momentum "
                f"{heavy_ball_momentum(inner_optimizer)}. Use "
                'AsyncOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), staleness="momentum"), '
                'or staleness="auto", which picks a rule for any optimizer.'
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.staleness = staleness
        self.drop_above = drop_above
        self.dc_lambda = float(dc_lambda)
        self.dc_momentum = float(dc_momentum)
        self.staleness_decay = float(staleness_decay)
        self.gap_decay = float(gap_decay)
        self.sparse_updates = sparse_updates

    @property
    def rule(self) -> str | Callable:
        """The rule that applies: `staleness`, with `"auto"` resolved for the
        strategy the optimizer was created under.

        Examples:
            >>> import keras, tf_diffmap
            >>> with tf_diffmap.Strategy().scope():  # aggregates gradients into steps
            ...     tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)).rule
            'none'
            >>> with tf_diffmap.Strategy(gradients_per_step=1).scope():
            ...     tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)).rule
            'linear'
            >>> tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1)).rule
            'gap'
            >>> tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(1e-3)).rule
            'none'
        """
        if self.staleness != "auto":
            return self.staleness
        if _aggregates(_tf_internal.optimizer_strategy(self)):
            # The optimizer takes one step per window of shard gradients.
            return "none"
        if find_in_chain(self.inner_optimizer, keras.optimizers.SGD) is None:
            return "none"
        return "linear" if heavy_ball_momentum(self.inner_optimizer) > 0 else "gap"

    # -- state ------------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        for optimizer in (self, self.inner_optimizer):
            created_under = _tf_internal.optimizer_strategy(optimizer)
            if created_under is not None and created_under is not strategy:
                raise ValueError(optimizer_outside_scope_message(optimizer))
        self._num_replicas = strategy.num_replicas_in_sync
        if self.rule == "dc":
            self._mean_squares = {
                id(v): self.add_variable_from_reference(v, name="dc_mean_square") for v in var_list
            }
        if self.rule == "gap":
            self._step_squares = {
                id(v): self.add_variable_from_reference(v, name="gap_step_square") for v in var_list
            }
            # The moving average's weight, for its bias correction (0 until
            # a step was measured).
            self._step_weight = self.add_variable((), initializer="zeros", name="gap_step_weight")
        if self.rule == "momentum":
            # A moving average: sum of weighted staleness, and the sum of the
            # weights. Before any staleness is measured it holds the staleness
            # that N replicas taking turns would see, N - 1, with weight 1;
            # the measurements replace it as they come (with one replica it
            # is 0 with weight 0: bias-corrected from the first update, as
            # Adam's moments are).
            prior = rules.expected_staleness(self._num_replicas)
            self._staleness_average = self.add_variable(
                (), initializer=keras.initializers.Constant(prior), name="staleness_average"
            )
            self._staleness_weight = self.add_variable(
                (),
                initializer=keras.initializers.Constant(1.0 if prior else 0.0),
                name="staleness_weight",
            )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        """This optimizer's variables (its rule's state), then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (or schedule); setting it sets the inner one's."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """The inner optimizer's count of the updates it applied."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the update -------------------------------------------------------

    def _lr_scale(self, staleness, mean_staleness=None):
        if callable(self.staleness):
            return tf.cast(self.staleness(staleness), tf.float32)
        if self.rule == "linear":
            return rules.linear_lr_scale(self._num_replicas)
        if self.rule == "inverse":
            return rules.inverse_lr_scale(staleness)
        if self.rule == "momentum":
            return rules.mean_staleness_lr_scale(mean_staleness)
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
        state.sparse_updates = self.sparse_updates
        if state.aggregating:
            self._push(grads, variables, state)
            return
        claim = state.claim(after=grads, record=False)
        rule = self.rule
        # "momentum" takes both its momentum and its learning-rate factor
        # from the smoothed staleness, so that one rare stale update (a
        # straggler's) moves them a little rather than swinging them.
        mean_staleness = self._mean_staleness(claim.staleness) if rule == "momentum" else None
        lr_scale = self._lr_scale(claim.staleness, mean_staleness)
        keep = (
            rules.keep_update(claim.staleness, self.drop_above)
            if self.drop_above is not None
            else tf.constant(True)
        )
        state.record(claim, keep, lr_scale)
        if rule == "dc":
            grads = self._compensate(grads, variables, state, claim)
        measure_steps = None
        if rule == "gap":
            grads, measure_steps = self._gap_aware(grads, variables, state, claim)
        traced_momentum = contextlib.nullcontext()
        if rule == "momentum":
            traced_momentum = _tf_internal.momentum_of_update(
                find_in_chain(self.inner_optimizer, keras.optimizers.SGD),
                rules.compensated_momentum(
                    heavy_ball_momentum(self.inner_optimizer), mean_staleness
                ),
            )

        def apply_inner():
            with traced_momentum:
                self.inner_optimizer.apply(grads, variables)
            if measure_steps is not None:
                measure_steps()
            return tf.constant(True)

        if self.drop_above is None:
            apply_inner()
        else:
            tf.cond(keep, apply_inner, lambda: tf.constant(False))

    def _push(self, grads, variables, state) -> None:
        """Where the strategy aggregates gradients into steps: the inner
        optimizer's `apply` pushes (`tf_diffmap.updates.aggregation`), and `"drop"`
        decides, per push, whether its gradient is accepted."""
        rule = self.rule
        if callable(rule) or rule not in AGGREGATED_RULES:
            raise ValueError(
                f"AsyncOptimizer(staleness={rule!r}) changes each shard's update, "
                "and this tf_diffmap.Strategy aggregates the shards' gradients into "
                f"steps of the optimizer (gradients_per_step="
                f"{_tf_internal.optimizer_strategy(self).gradients_per_step}), which "
                f"only {' and '.join(repr(r) for r in AGGREGATED_RULES)} apply to. "
                'Keep staleness="auto", or build the strategy with '
                "tf_diffmap.Strategy(gradients_per_step=1) to apply per shard."
            )
        if self.drop_above is not None:
            claim = state.claim(after=grads, record=False)
            claim.keep = rules.keep_update(claim.staleness, self.drop_above)
        self.inner_optimizer.apply(grads, variables)

    def _mean_staleness(self, staleness) -> tf.Tensor:
        """A moving average of the staleness of recent updates, this one included.

        Bias-corrected as Adam's moments are (the weights start at 0), so the
        first update's average is its own staleness. Dropped updates count:
        they are as stale as the store's recent updates were.
        """
        decay = self.staleness_decay
        with tf.control_dependencies([staleness]):
            value = tf.cast(staleness, tf.float32)
            average = self._staleness_average.value
            weight = self._staleness_weight.value
            average_now = tf.cast(average.read_value(), tf.float32)
            weight_now = tf.cast(weight.read_value(), tf.float32)
            average_step = rules.moving_average_step(average_now, value, decay)
            weight_step = rules.moving_average_step(weight_now, 1.0, decay)
            average.assign_add(tf.cast(average_step, average.dtype))
            weight.assign_add(tf.cast(weight_step, weight.dtype))
            return (average_now + average_step) / (weight_now + weight_step)

    def _compensate(self, grads, variables, state, claim):
        compensated = []
        with tf.control_dependencies([claim.staleness]):
            for gradient, variable in zip(grads, variables):
                if gradient is None:
                    compensated.append(None)
                    continue
                tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
                rows = _Rows(gradient, tf_variable, state)
                mean_square = rows.of(self._mean_squares[id(variable)].value)
                ms_before = tf.cast(mean_square.read(), rows.dtype)
                step = rules.mean_square_step(ms_before, rows.gradient, self.dc_momentum)
                mean_square.add(step)
                # DC-ASGD-a's lambda uses MeanSquare(t), this gradient included.
                compensated.append(
                    rows.gradient_of(
                        rules.delay_compensated_gradient(
                            rows.gradient,
                            rows.params_now(),
                            rows.params_read(),
                            ms_before + step,
                            self.dc_lambda,
                        )
                    )
                )
        return compensated

    def _gap_aware(self, grads, variables, state, claim):
        """Gap-Aware: each gradient divided by its parameters' gap.

        Returns the penalized gradients and a function to call once the
        update is applied: it folds the step each parameter just took into
        the moving mean square of its steps, the C of `rules.gap_penalty`.
        Until a first step is measured nothing is penalized.
        """
        penalized, measured = [], []
        with tf.control_dependencies([claim.staleness]):
            weight = self._step_weight.value
            weight_now = tf.cast(weight.read_value(), tf.float32)
            for gradient, variable in zip(grads, variables):
                if gradient is None:
                    penalized.append(None)
                    continue
                tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
                rows = _Rows(gradient, tf_variable, state)
                square = rows.of(self._step_squares[id(variable)].value)
                square_now = tf.cast(square.read(), rows.dtype)
                params_now = rows.params_now()
                corrected = square_now / tf.cast(tf.maximum(weight_now, 1e-12), rows.dtype)
                penalty = tf.where(
                    weight_now > 0,
                    rules.gap_penalty(params_now, rows.params_read(), corrected),
                    tf.ones_like(rows.gradient),
                )
                penalized.append(rows.gradient_of(rows.gradient / penalty))
                measured.append((rows, square, square_now, params_now))
        decay = self.gap_decay

        def measure_steps():
            for rows, square, square_now, params_before in measured:
                # Read after this update was applied (the step's automatic
                # control dependencies order it after the variable's update).
                step = rows.params_now() - params_before
                square.add(rules.mean_square_step(square_now, step, decay))
            weight.assign_add(
                tf.cast(rules.moving_average_step(weight_now, 1.0, decay), weight.dtype)
            )

        return penalized, measure_steps

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
                "staleness_decay": self.staleness_decay,
                "gap_decay": self.gap_decay,
                "sparse_updates": self.sparse_updates,
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
        known = (
            "drop_above",
            "dc_lambda",
            "dc_momentum",
            "staleness_decay",
            "gap_decay",
            "sparse_updates",
            "name",
        )
        kwargs = {k: config[k] for k in known if k in config}
        return cls(inner, staleness=staleness, **kwargs)
