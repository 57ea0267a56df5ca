"""Says so when asynchrony's momentum and an optimizer's own add up past 1.

Asynchronous updates behave like momentum SGD whose momentum grows with the
staleness, s / (1 + s) at mean staleness s (`rules.implicit_momentum`).
An optimizer that brings its own momentum, tuned for synchronous training,
then runs with a total of about the sum, and from a total of 1 the momentum
no longer decays: on digits, SGD(0.2, momentum=0.9) fell to chance with 16
replicas and lost half its accuracy with 4. `AsyncOptimizer`'s default for
SGD, the `"linear"` rule, divides the learning rate by the number of
replicas, which keeps each update's step at the synchronous step per
example and keeps such a model training (as does the `"momentum"` rule at
high staleness); `MomentumWatch` warns, once, when a model trains with
neither.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from tf_diffmap import _tf_internal
from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.updates.optimizer import AsyncOptimizer, find_in_chain, heavy_ball_momentum
from tf_diffmap.updates.rules import implicit_momentum

__all__ = ["MomentumWatch", "momentum_warning", "CORRECTING_RULES"]

# `AsyncOptimizer` rules under which SGD with momentum was measured to keep
# training at high staleness (the benchmarks' convergence table).
CORRECTING_RULES = ("linear", "momentum")


def _corrects_momentum(optimizer) -> bool:
    wrapper = find_in_chain(optimizer, AsyncOptimizer)
    return wrapper is not None and wrapper.rule in CORRECTING_RULES


def momentum_warning(optimizer, stats: StalenessStats, min_updates: int = 0) -> str | None:
    """The warning for a model's optimizer at these statistics, if one is due.

    Args:
        optimizer: the model's optimizer (wrappers are looked through).
        stats: the strategy's statistics.
        min_updates: say nothing before this many updates were applied.

    Returns:
        A message when every shard's gradient is a step of its own, the
        optimizer is SGD with a momentum that no `AsyncOptimizer` rule
        corrects, and that momentum plus the momentum asynchrony adds at the
        measured mean staleness is 1 or more; else None. Where the store
        aggregates gradients into steps, the optimizer takes the steps of
        synchronous training, and none is due (the collapse guard,
        `tf_diffmap.engine.guard`, says so if training collapses all the same).
    """
    if stats.aggregated:
        return None
    momentum = heavy_ball_momentum(optimizer)
    if momentum <= 0 or _corrects_momentum(optimizer):
        return None
    if int(stats.updates.sum()) < max(min_updates, 1):
        return None
    staleness = stats.overall_mean_staleness
    added = float(implicit_momentum(staleness))
    if momentum + added < 1.0:
        return None
    return (
        f"The optimizer applies momentum {momentum:g} to asynchronous updates "
        f"whose mean staleness is {staleness:.1f} (max "
        f"{stats.overall_max_staleness}) over {stats.num_replicas} replicas. "
        f"Asynchrony adds about {added:.2f} of momentum of its own (s / (1 + s), "
        f"Mitliagkas et al. 2016), a total of {momentum + added:.2f}: from 1 on, "
        "momentum no longer decays and training tends to diverge (SGD with "
        "momentum 0.9 fell to chance on 16 replicas). Wrap the optimizer in "
        "tf_diffmap.AsyncOptimizer(...) and keep its default rule for SGD, "
        'staleness="linear": it divides the learning rate by the number of '
        f"replicas ({stats.num_replicas}), so that each replica's update, computed on "
        "its share of the batch, takes the synchronous step per example. Or leave "
        'the strategy\'s default, gradients_per_step="auto": the store then takes one '
        "step of the optimizer per batch, from all its shards' gradients."
    )


class MomentumWatch:
    """Checks a model's optimizer against the measured staleness, and warns once.

    The strategy calls `watch` with the optimizer of each Keras train
    function it makes and `check` once per stretch of training (when it
    drains, as at each epoch's end); the statistics are read only for SGD
    with an uncorrected momentum, every `check_every` calls, until it has
    warned about that optimizer.

    Args:
        check_every: calls of `check` between two reads of the statistics.
        min_updates: updates to wait for before the mean staleness is trusted.
    """

    def __init__(self, check_every: int = 8, min_updates: int = 64):
        self.check_every = check_every
        self.min_updates = min_updates
        self.warned = False
        self._optimizer = None
        self._batches = 0

    def watch(self, optimizer) -> None:
        """Watches the optimizer of a model that starts training.

        Only an SGD with a momentum that nothing corrects is checked; each
        such optimizer is warned about once.
        """
        if optimizer is self._optimizer:
            return
        uncorrected = heavy_ball_momentum(optimizer) > 0 and not _corrects_momentum(optimizer)
        self._optimizer = optimizer if uncorrected else None
        self.warned = False
        self._batches = 0

    def check(self, statistics: Callable[[], StalenessStats]) -> None:
        """Warns if due; `statistics` is called only when there is a check."""
        if self.warned or self._optimizer is None:
            return
        self._batches += 1
        if self._batches % self.check_every:
            return
        message = momentum_warning(self._optimizer, statistics(), self.min_updates)
        if message is not None:
            self.warned = True
            # Due at an epoch's end, deep inside `fit`: name the user's line.
            warnings.warn(message, UserWarning, stacklevel=_tf_internal.user_stacklevel())
