"""Staleness-aware update rules: pure functions of tensors.

Each takes the staleness of an update (an integer scalar tensor, or the mean
staleness) and what the rule needs, and returns tensors; none touches a
variable, so each is tested on its own. `AsyncOptimizer` applies them.
"""

from __future__ import annotations

import tensorflow as tf

from tf_diffmap.store.staleness import implicit_momentum

__all__ = [
    "staleness_bound",
    "inverse_lr_scale",
    "keep_update",
    "mean_square_step",
    "delay_compensated_gradient",
    "moving_average_step",
    "implicit_momentum",
    "compensated_momentum",
    "mean_staleness_lr_scale",
    "expected_staleness",
    "gap_penalty",
    "linear_lr_scale",
]


def staleness_bound(num_replicas: int, max_staleness: int) -> int:
    """The largest staleness Stale Synchronous Parallel allows.

    With no replica starting a step while more than `max_staleness` steps
    ahead of the slowest, another replica is at least `max_staleness` steps
    behind a replica when it reads (or it could not have started), and at most
    `max_staleness + 1` steps ahead when it applies (one step in flight). So
    each of the `num_replicas - 1` others lands at most `2 * max_staleness + 1`
    updates in between.

    Args:
        num_replicas: replicas training.
        max_staleness: the bound in steps (0 is lock-step).

    Returns:
        `(num_replicas - 1) * (2 * max_staleness + 1)`.

    Raises:
        ValueError: `num_replicas` below 1 or `max_staleness` below 0.

    Examples:
        >>> import tf_diffmap
        >>> tf_diffmap.staleness_bound(num_replicas=4, max_staleness=0)
        3
        >>> tf_diffmap.staleness_bound(num_replicas=4, max_staleness=2)
        15
    """
    if num_replicas < 1 or max_staleness < 0:
        raise ValueError(
            "staleness_bound needs num_replicas >= 1 and max_staleness >= 0, "
            f"received {num_replicas} and {max_staleness}."
        )
    return (num_replicas - 1) * (2 * max_staleness + 1)


def inverse_lr_scale(staleness):
    """Learning-rate factor 1 / max(1, staleness) (Zhang et al., IJCAI 2016)."""
    staleness = tf.cast(staleness, tf.float32)
    return 1.0 / tf.maximum(staleness, 1.0)


def keep_update(staleness, drop_above: int):
    """True when an update is fresh enough to apply (staleness <= drop_above)."""
    return tf.less_equal(tf.cast(staleness, tf.int64), tf.cast(drop_above, tf.int64))


def mean_square_step(mean_square, gradient, momentum: float):
    """The change that takes a moving mean square of gradients one step on.

    `mean_square + mean_square_step(...)` is
    `momentum * mean_square + (1 - momentum) * gradient**2`; returned as a
    difference so that it can be applied with an atomic add.
    """
    return (1.0 - momentum) * (gradient * gradient - mean_square)


def delay_compensated_gradient(
    gradient, params_now, params_read, mean_square, lambda0: float, epsilon: float = 1e-7
):
    """DC-ASGD-a (Zheng et al., ICML 2017): the gradient, corrected for delay.

    g + lambda * g * g * (w_now - w_read), with the adaptive
    lambda = lambda0 / sqrt(mean_square + epsilon).

    Args:
        gradient: g, computed at the parameters `params_read`.
        params_now: the parameters at the time the update is applied.
        params_read: the parameters the gradient was computed at.
        mean_square: moving mean square of the gradient (same shape),
            this gradient included: the paper's MeanSquare(t) =
            m * MeanSquare(t - 1) + (1 - m) * g**2, which also keeps lambda
            bounded (by lambda0 / (sqrt(1 - m) * |g|)) for a first gradient.
        lambda0: the variance-control parameter lambda_0.
        epsilon: keeps the square root away from zero.
    """
    lam = lambda0 / tf.sqrt(mean_square + epsilon)
    return gradient + lam * gradient * gradient * (params_now - params_read)


def moving_average_step(average, value, decay: float):
    """The change that takes an exponential moving average one step on.

    `average + moving_average_step(...)` is
    `decay * average + (1 - decay) * value`; returned as a difference so that
    it can be applied with an atomic add.
    """
    return (1.0 - decay) * (value - average)


def compensated_momentum(momentum, mean_staleness):
    """The explicit momentum to apply so that the total stays `momentum`.

    The explicit momentum lowered by the momentum asynchrony adds,
    `max(0, momentum - s / (1 + s))`: the first-order correction of
    Mitliagkas et al. 2016 (the total is about the sum of the two), as the
    closed loop of YellowFin (Zhang and Mitliagkas, 2017) does with a
    measured total. It is not made negative (Mitliagkas et al. note that the
    best explicit momentum can be), since Keras' SGD takes momentum in
    [0, 1] and no negative value was measured here.

    Args:
        momentum: the momentum the inner optimizer was configured with, as
            tuned for synchronous training.
        mean_staleness: a recent mean staleness s >= 0 (tensor or float).

    Returns:
        A float32 scalar tensor in [0, momentum].
    """
    mean_staleness = tf.cast(mean_staleness, tf.float32)
    return tf.maximum(tf.constant(momentum, tf.float32) - implicit_momentum(mean_staleness), 0.0)


def mean_staleness_lr_scale(mean_staleness):
    """Learning-rate factor 1 / (1 + s) at a recent mean staleness s.

    The staleness-dependent learning rate of Zhang, Gupta, Lian and Liu
    (IJCAI 2016), alpha_0 / <sigma>, taken at the average staleness rather
    than at each update's: a step whose gradient is s versions old on
    average is taken s + 1 times smaller, the step size that delayed SGD
    stays stable with (it shrinks as 1 / (1 + delay)). Counting the update
    itself (1 + s rather than s) keeps the factor at exactly 1 when nothing
    is stale, so one replica is the inner optimizer. Averaged, one very
    stale update (a straggler's) moves the factor a little instead of
    cutting that one step alone, and fresh updates between two stale ones
    are damped too: the instability a delay starts lasts beyond the
    stale update itself.

    Args:
        mean_staleness: a recent mean staleness s >= 0 (tensor or float).

    Returns:
        A float32 scalar tensor in (0, 1].
    """
    mean_staleness = tf.cast(mean_staleness, tf.float32)
    return 1.0 / (1.0 + tf.maximum(mean_staleness, 0.0))


def expected_staleness(num_replicas: int) -> float:
    """The mean staleness to assume before any is measured: N - 1.

    N replicas that take turns on the store each see the N - 1 others'
    updates land between their read and their update; Mitliagkas et al.
    (2016) model M asynchronous workers the same way, and their implicit
    momentum 1 - 1/M is `implicit_momentum(M - 1)`. It is the staleness
    the `"momentum"` rule starts from, so that its first updates, before
    the store has measured anything, are not taken at full momentum and
    full step: with one replica it is 0 and nothing changes.

    Args:
        num_replicas: N >= 1.

    Returns:
        `float(N - 1)`.
    """
    if num_replicas < 1:
        raise ValueError(f"expected_staleness needs num_replicas >= 1, received {num_replicas}.")
    return float(num_replicas - 1)


def gap_penalty(params_now, params_read, step_mean_square, epsilon: float = 1e-8):
    """Gap-Aware's penalty (Barkai, Hakimi and Schuster, ICLR 2020), per element.

    The gap of an update is how far each parameter moved between the read
    its gradient was computed at and the moment the update is applied,
    measured in typical steps: G = 1 + |w_now - w_read| / C, where C is the
    root mean square of the steps that the parameter's updates took. The
    gradient is divided by G. A parameter that did not move since the read
    (no other update touched it, or they cancelled out) is not penalized at
    all, whatever the staleness; one that moved s typical steps the same
    way is penalized as `"inverse"` would at staleness s + 1.

    Args:
        params_now: the parameters when the update is applied.
        params_read: the parameters the gradient was computed at.
        step_mean_square: per element, the (bias-corrected) moving mean
            square of the parameter's recent steps; C is its square root.
        epsilon: keeps C away from zero for parameters that never moved.

    Returns:
        G >= 1, the shape of the parameters: the gradient is divided by it.
    """
    typical_step = tf.sqrt(step_mean_square) + epsilon
    return 1.0 + tf.abs(params_now - params_read) / typical_step


def linear_lr_scale(num_replicas: int):
    """Learning-rate factor 1 / N for N replicas: the synchronous step per example.

    Each of N replicas applies the gradient of its own 1/N of the global
    batch, so N asynchronous updates stand where one synchronous update of
    the whole batch stood. Dividing the learning rate by N keeps the step
    per example where the synchronous learning rate put it: the linear
    scaling rule (Goyal et al. 2017) applied to the replica's shard. It is
    also the staleness-dependent learning rate of Zhang, Gupta, Lian and Liu
    (IJCAI 2016), alpha_0 / (1 + s), at the mean staleness N - 1 that N
    replicas working at once see (N - 1 updates in flight besides one's
    own), but it does not rise when replicas happen not to overlap: an
    update of 1/N of the batch at the full learning rate is as unstable with
    little staleness as with much.

    Args:
        num_replicas: N >= 1.

    Returns:
        A float32 scalar tensor, 1 / N (exactly 1 for one replica).
    """
    if num_replicas < 1:
        raise ValueError(f"linear_lr_scale needs num_replicas >= 1, received {num_replicas}.")
    return tf.constant(1.0 / num_replicas, tf.float32)
