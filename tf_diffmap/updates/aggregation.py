"""Asynchronous mini-batching: an optimizer's steps from K pushed shard gradients.

Where the strategy aggregates (`Strategy(gradients_per_step=...)`, by
default K = the number of replicas, the shards of one batch), a replica's
call of its optimizer's `apply` does not update the variables: it pushes
the shard's gradient to the store (`tf_diffmap.store.accumulators`), and the push
that completes a window of K applies the window's gradient (its accepted
gradients summed, scaled to K of them) as **one step of the optimizer, with its own
hyperparameters**: its learning rate and schedule, momentum, moments, weight
decay, clipping and `iterations` see one step per K shards, as in
synchronous training on the whole batch. No replica waits for another: the
others push and go on, and a slow replica's share is taken by the rest.

A gradient computed on parameters more than `max_step_staleness` optimizer
steps old is not accepted: it still counts in its window, with no weight,
and the statistics count it dropped (the field's "discard gradients
computed at old points", as in Rennala SGD, Tyurin and Richtarik 2023, and
Ringmaster ASGD, Maranjyan, Tyurin and Richtarik 2025).

With `max_step_staleness=0` the windows are *fresh*
(`tf_diffmap.store.gate`): window v takes only gradients whose read saw v
steps applied, decided under the accumulators' mutex; a gradient that did
not takes no slot (it is dropped and counted, its examples counted as
skipped); a window is full once its accepted examples make a global batch,
and its step is the optimizer's step on their examples-weighted mean, the
step of synchronous training. (The weighting reads each replica's gradient
as its shard's mean over N, as Keras' compiled losses make it; a custom
loop that scales its loss by the global batch gets the same step wherever
a window's shards are of one size.) A replica that pushed into an open window
waits for it to close before it takes another shard, so that replicas that
keep pace stay in step, and the window timer (`tf_diffmap.engine.windows`)
closes short or fills a window that waits on a slow replica past its
patience (backup replicas: Chen, Pan, Monga, Bengio and Jozefowicz 2016,
"Revisiting Distributed Synchronous SGD"). Half an optimizer step of
staleness is enough to shrink momentum SGD's stable learning rates many
times over; fresh windows have none.

How it reaches the optimizer: while the strategy traces a replica step,
the `apply` of every optimizer the step can reach (`optimizers_of`: the
model's, and those the step function names) is replaced by
`Aggregation.apply` on that optimizer alone (`_tf_internal.apply_replaced`).
Wrappers run per push, outside it: `keras.optimizers.LossScaleOptimizer`
unscales and checks each shard's gradient, and `AsyncOptimizer`'s `"drop"`
rule decides per push; the innermost optimizer takes the steps.

At every drain (the end of an epoch, `evaluate`, `save`, a callback that
reads the model), a window that is not full is applied as it is
(`flush`), so that what is read is what was trained.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Sequence

import keras
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.store.accumulators import Accumulators, FreshPush, Window, locked
from tf_diffmap.store.gate import Gate
from tf_diffmap.store.parameter_store import ParameterStore
from tf_diffmap.updates.optimizer import optimizer_chain
from tf_diffmap.updates.penalties import add_penalty_gradients
from tf_diffmap.updates.step import StepState, current_step, step_reach, tracing_step

__all__ = ["Aggregation", "aggregating", "innermost", "optimizers_of", "warn_if_not_aggregated"]


def innermost(optimizer):
    """The optimizer that `optimizer` is or wraps, through every wrapper."""
    last = optimizer
    for last in optimizer_chain(optimizer):  # noqa: B007 - the last one
        pass
    return last


def _optimizers_in(value, depth: int = 1) -> Iterable:
    if isinstance(value, keras.optimizers.Optimizer):
        yield value
    elif isinstance(value, keras.Model) and depth > 0:
        optimizer = getattr(value, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.Optimizer):
            yield optimizer
        for attribute in vars(value).values():
            if isinstance(attribute, keras.optimizers.Optimizer):
                yield attribute


def optimizers_of(fn) -> list:
    """The Keras optimizers a step function can reach, outermost first.

    Those of the object a bound method belongs to (a Keras model's
    `optimizer`, and any optimizer among its attributes, as a GAN's
    `train_step` uses two), then those the function's code names as free
    variables or globals, and the optimizers of models it names.
    """
    owner, named = step_reach(fn)
    found: list = []
    if owner is not None:
        found.extend(_optimizers_in(owner))
        if not isinstance(owner, keras.Model):
            for attribute in vars(owner).values() if hasattr(owner, "__dict__") else ():
                found.extend(_optimizers_in(attribute, depth=0))
    for value in named:
        found.extend(_optimizers_in(value))
    return list({id(o): o for o in found}.values())


class Aggregation:
    """One optimizer's steps, each from a window of pushed shard gradients.

    Args:
        optimizer: the innermost optimizer (no wrapper): its `apply` is
            replaced while replica steps are traced.
        store: the parameter store (the accumulators' placement, the
            optimizer-step count).
        gradients_per_step: K.
        max_step_staleness: the most optimizer steps a gradient's
            parameters may be behind and be accepted; None accepts all; 0
            makes the windows fresh (with `gate`).
        replicas: N, the replicas a replica's gradient is made to be summed
            over (`tf.distribute.ReplicaContext.num_replicas_in_sync`).
        gate: the waits and counts of the windows (`tf_diffmap.store.gate`),
            made outside the strategy's scope; with `max_step_staleness=0`
            replicas wait at it, else it only counts.
    """

    def __init__(
        self,
        optimizer,
        store: ParameterStore,
        gradients_per_step: int,
        max_step_staleness: int | None,
        replicas: int,
        gate: Gate,
    ):
        self.optimizer = optimizer
        self.replicas = replicas
        self.store = store
        self.gradients_per_step = gradients_per_step
        self.max_step_staleness = max_step_staleness
        self.fresh = max_step_staleness == 0
        self.gate = gate
        self.accumulators: Accumulators | None = None
        self.variables: list | None = None
        # Variable index -> regularizer: the penalties whose gradient the
        # step adds (`tf_diffmap.updates.penalties`), set by the first trace.
        self.penalties: dict | None = None
        self._flush_concrete = None
        self._close_concrete = None
        self._settle_cut_off_concrete = None

    def _original_apply(self, grads, variables):
        """The optimizer's own `apply`, whatever replaces it on the instance."""
        return type(self.optimizer).apply(self.optimizer, grads, variables)

    # -- in a replica step ---------------------------------------------------

    def wait_before_take(self, replica_id: tf.Tensor) -> tf.Operation | None:
        """Where windows are fresh: waits, before a replica takes its next
        shard, until the window it last pushed into is closed and its step
        applied (in a graph); None where replicas do not wait. Waiting
        before the take, it holds no shard that another replica could
        push into the open window."""
        if not self.fresh:
            return None
        gate = self.gate
        must = locked(gate.mutex, gate.host, lambda: (gate.register(replica_id), []))
        return gate.block(replica_id, must)

    def apply(self, grads, trainable_variables=None):
        """Pushes a replica step's gradients; the push that completes a
        window applies the window's mean (replaces the optimizer's `apply`
        while a replica step is traced)."""
        state = current_step()
        if state is None or not state.aggregating:
            return self._original_apply(grads, trainable_variables)
        optimizer = self.optimizer
        if trainable_variables is None:
            variables = _tf_internal.optimizer_trainable_variables(optimizer)
        else:
            variables = list(trainable_variables)
        if not optimizer.built:
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True
        self._adopt(variables)
        self._adopt_penalties(state, variables)
        grads = list(grads)
        claim = state.claim(after=grads, record=False)
        with tf.device(self.store.host):
            # The push's bookkeeping runs where the store is: a value made on
            # the replica's device would travel to the store one by one.
            self._push(state, claim, grads)

    def _push(self, state: StepState, claim, grads: list) -> None:
        """The push of `apply` once claimed, and the step if it completes
        a window (on the store's host)."""
        accepted = tf.constant(True) if claim.keep is None else claim.keep
        if self.fresh:
            read_closed = state.window_reads[id(self.gate)]
            read = FreshPush(state.replica_id, read_closed, state.read_time)
            with tf.control_dependencies([claim.staleness]):
                window = self.accumulators.push(grads, accepted, state.examples, read)
            # In steps, a push is as stale as the windows taken since its
            # read: 0 where accepted.
            claim.step_staleness = tf.maximum(window.number - read_closed, 0)
            state.record(claim, window.accepted, None)
            with tf.control_dependencies([window.accepted]):
                self.gate.timed(state.replica_id, state.read_time)
        else:
            if self.max_step_staleness is not None:
                accepted = tf.logical_and(
                    accepted,
                    claim.step_staleness <= tf.constant(self.max_step_staleness, tf.int64),
                )
            state.record(claim, accepted, None)
            # Asynchronous windows weight each accepted push alike: a full
            # window's step is the sum of its K gradients, tf.distribute's
            # contract (a custom loop's loss scaled by the global batch sums
            # to the batch's mean, a partial last batch included).
            with tf.control_dependencies([claim.staleness]):
                window = self.accumulators.push(grads, accepted)
        state.pushed = True
        self._step_if_taken(window)

    def _adopt(self, variables: Sequence) -> None:
        if self.variables is None:
            self.variables = list(variables)
            self.accumulators = Accumulators(
                self.store, self.variables, self.gradients_per_step, self.gate
            )
            self.store.aggregates = True
            return
        if [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError(
                f"{type(self.optimizer).__name__} was applied to "
                f"{len(variables)} variables after {len(self.variables)} other ones. "
                "Under tf_diffmap's aggregation an optimizer takes steps for one set "
                "of variables; use one optimizer per set (as a GAN does), or "
                "Strategy(gradients_per_step=1)."
            )

    def _adopt_penalties(self, state: StepState, variables: Sequence) -> None:
        """Takes the penalties of these variables that the step's loss
        left to the store (`tf_diffmap.updates.penalties`)."""
        penalties = {
            i: state.penalized[id(v)][1]
            for i, v in enumerate(variables)
            if id(v) in state.penalized
        }
        state.penalties_taken.update(id(variables[i]) for i in penalties)
        if self.penalties is None:
            self.penalties = penalties
            return
        if {i: id(r) for i, r in penalties.items()} != {
            i: id(r) for i, r in self.penalties.items()
        }:
            raise ValueError(
                f"A training step of {type(self.optimizer).__name__} left the "
                f"regularizers of {len(penalties)} variables to the store after "
                f"another left those of {len(self.penalties)}. tf_diffmap adds a "
                "regularizer's gradient on the store in every step of an optimizer "
                "or in none: keep the model's regularizers as they were when it "
                "first trained under this strategy, or compile a new optimizer."
            )

    def _step_if_taken(self, window: Window) -> tf.Tensor:
        """One step of the optimizer on the window's mean, if a window with
        an accepted gradient was taken, and the store's count of it; then
        the replicas blocked on the window are let go (in a graph).

        The conditional and the count run on the store's host, with the
        step's updates: once the window is taken nothing waits for the
        replica's device, so a worker lost mid-step cannot leave a step
        applied but not counted (or the other way round).
        """

        def step():
            gradients = window.gradients(self.replicas)
            if self.penalties:
                gradients = add_penalty_gradients(
                    gradients, self.variables, self.penalties, self.optimizer
                )
            self._original_apply(gradients, self.variables)
            return tf.constant(True)

        gate = self.gate
        with tf.device(self.store.host):
            # The conditional's output comes once every update of its
            # branch has run; the count waits for it.
            stepped = tf.cond(
                tf.logical_and(window.taken, window.weight > 0),
                step,
                lambda: tf.constant(False),
            )
            counted = self.store.optimizer_steps.assign_add(
                tf.cast(stepped, tf.int64), read_value=False
            )
            # Once applied, the window is closed, and the replicas that
            # wait for it are let go.
            with tf.control_dependencies([counted]):
                return tf.cond(
                    window.taken,
                    lambda: _after(
                        locked(gate.mutex, gate.host, lambda: (gate.settle(window.number), []))
                    ),
                    lambda: tf.constant(False),
                )

    # -- at a drain, and from the window timer ---------------------------------

    def trace_flush(self, strategy) -> None:
        """Traces the functions that apply a partial window at a drain, and
        that close or fill a window open past its patience (call once the
        accumulators exist, in a clean thread, inside the strategy's scope).
        They run where the store is: the client only calls them."""
        if self.accumulators is None or self._flush_concrete is not None:
            return

        def outside_replicas(take):
            with (
                tf.device(self.store.host),
                tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0),
            ):
                state = StepState(self.store, tf.constant(0, tf.int32))
                with tracing_step(state, reads_as_rows=False):
                    state.claim_outside_replicas()
                    window = take()
                    counted = self._step_if_taken(window)
            released = window.tokens if window.tokens is not None else tf.constant(0, tf.int64)
            with tf.control_dependencies([counted]):
                return tf.identity(window.pushes), tf.identity(released)

        def flush():
            return outside_replicas(self.accumulators.flush)[0]

        def close(number, fill):
            return outside_replicas(lambda: self.accumulators.close_if_open(number, fill))

        def settle_cut_off(replica_id):
            gate = self.gate
            return locked(gate.mutex, gate.host, lambda: (gate.settle_cut_off(replica_id), []))

        self._flush_concrete = tf.function(flush, autograph=False).get_concrete_function()
        if self.fresh:
            self._close_concrete = tf.function(close, autograph=False).get_concrete_function(
                tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.bool)
            )
            with tf.device(self.store.host):
                self._settle_cut_off_concrete = tf.function(
                    settle_cut_off, autograph=False
                ).get_concrete_function(tf.TensorSpec([], tf.int64))

    def pending(self) -> int:
        """Pushes in the window not yet applied (a read from Python)."""
        if self.accumulators is None:
            return 0
        return int(self.accumulators.pending.numpy())

    def flush(self) -> int:
        """Applies a partial window now (no replica may be running).

        Returns:
            The pushes it held (0: nothing to apply).
        """
        if self._flush_concrete is None or not self.pending():
            return 0
        return int(self._flush_concrete())

    def settle_cut_off(self, replica_id: int) -> bool:
        """A replica's call was cut off (its task was lost, or another
        task's loss ended the call), and has ended: if it had taken the
        window taken last and not settled it, settles it, so that the
        replicas waiting for it go on (the window's step is lost with the
        call, as a window taken by a lost worker is under asynchronous
        windows).

        Returns:
            Whether a window was settled.
        """
        if self._settle_cut_off_concrete is None:
            return False
        return bool(self._settle_cut_off_concrete(tf.constant(replica_id, tf.int64)))

    def prepare(self) -> None:
        """Runs the window timer's functions and reads once, with no effect,
        while every task serves (a function's first call registers it on
        every task, a lost worker's included)."""
        if self._close_concrete is None:
            return
        self.close_late(-1, False)
        self.settle_cut_off(-2)
        self.gate.statistics()

    def close_late(self, number: int, fill: bool) -> tuple[int, int]:
        """The window timer's call: window `number`, open past its patience,
        is closed short or (with `fill`, if replicas wait) filled.

        Returns:
            The pushes of the window closed (0: none was), and the replicas
            let go.
        """
        if self._close_concrete is None:
            return 0, 0
        pushes, tokens = self._close_concrete(
            tf.constant(number, tf.int64), tf.constant(bool(fill))
        )
        return int(pushes), int(tokens)


def _after(op) -> tf.Tensor:
    with tf.control_dependencies([op]):
        return tf.constant(True)


@contextlib.contextmanager
def aggregating(optimizers: Sequence, aggregation_for):
    """Within, each optimizer's innermost `apply` is its aggregation's.

    Args:
        optimizers: the optimizers a step can reach (`optimizers_of`).
        aggregation_for: `innermost optimizer -> Aggregation`.
    """
    with contextlib.ExitStack() as stack:
        seen = set()
        for optimizer in optimizers:
            inner = innermost(optimizer)
            if id(inner) in seen:
                continue
            seen.add(id(inner))
            stack.enter_context(_tf_internal.apply_replaced(inner, aggregation_for(inner).apply))
        yield


_warned_custom = False


def warn_if_not_aggregated(step_name: str) -> None:
    """Says once that a training step's optimizer was not found to aggregate."""
    global _warned_custom
    if _warned_custom:
        return
    _warned_custom = True
    warnings.warn(
        f"tf_diffmap.Strategy aggregates shard gradients into optimizer steps, but "
        f"found no Keras optimizer that the training step {step_name!r} applies: "
        "it looks for the model's optimizer, optimizers among the step's object's "
        "attributes, and those its code names. This step's updates are applied "
        "per shard instead. Name the optimizer in the step function (a global or "
        "a variable of the enclosing function), or pass "
        "Strategy(gradients_per_step=1) to apply per shard knowingly.",
        UserWarning,
        stacklevel=3,
    )
