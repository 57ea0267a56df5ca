"""Staleness-aware update rules, checked against values computed by hand."""

import numpy as np
import pytest
import tensorflow as tf

from tf_diffmap.updates import rules


@pytest.mark.parametrize("staleness, expected", [(0, 1.0), (1, 1.0), (2, 0.5), (8, 0.125)])
def test_inverse_lr_scale(staleness, expected):
    assert float(rules.inverse_lr_scale(tf.constant(staleness, tf.int64))) == expected


@pytest.mark.parametrize("staleness, keep", [(0, True), (3, True), (4, False)])
def test_keep_update(staleness, keep):
    assert bool(rules.keep_update(tf.constant(staleness, tf.int64), 3)) is keep


def test_mean_square_step_is_the_moving_average_difference():
    ms, g = tf.constant([1.0, 4.0]), tf.constant([3.0, 0.0])
    new = ms + rules.mean_square_step(ms, g, 0.9)
    np.testing.assert_allclose(new, [0.9 * 1 + 0.1 * 9, 0.9 * 4 + 0.1 * 0], rtol=1e-6)


def test_delay_compensated_gradient_by_hand():
    g = tf.constant([2.0, -1.0, 0.5])
    now = tf.constant([1.0, 1.0, 1.0])
    read = tf.constant([0.5, 2.0, 1.0])
    ms = tf.constant([4.0, 1.0, 9.0])
    got = rules.delay_compensated_gradient(g, now, read, ms, lambda0=0.5, epsilon=0.0)
    # lambda = 0.5 / sqrt(ms) = [0.25, 0.5, 1/6]
    expected = [2 + 0.25 * 4 * 0.5, -1 + 0.5 * 1 * -1.0, 0.5 + 0.0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("replicas, bound, expected", [(1, 0, 0), (4, 0, 3), (4, 1, 9), (8, 2, 35)])
def test_staleness_bound(replicas, bound, expected):
    assert rules.staleness_bound(replicas, bound) == expected


def test_staleness_bound_rejects_bad_input():
    with pytest.raises(ValueError, match="max_staleness >= 0"):
        rules.staleness_bound(4, -1)


@pytest.mark.parametrize(
    "mean_staleness, expected", [(0.0, 0.0), (1.0, 0.5), (3.0, 0.75), (9.0, 0.9)]
)
def test_implicit_momentum_by_hand(mean_staleness, expected):
    # s / (1 + s): a geometric staleness of mean s is momentum mu with mu / (1 - mu) = s.
    assert rules.implicit_momentum(mean_staleness) == pytest.approx(expected)
    assert float(rules.implicit_momentum(tf.constant(mean_staleness))) == pytest.approx(expected)


@pytest.mark.parametrize(
    "momentum, mean_staleness, expected",
    [(0.9, 0.0, 0.9), (0.9, 1.0, 0.4), (0.9, 0.25, 0.7), (0.9, 9.0, 0.0), (0.5, 3.0, 0.0)],
)
def test_compensated_momentum_by_hand(momentum, mean_staleness, expected):
    # max(0, momentum - s / (1 + s)): 0.9 - 0.5 = 0.4; 0.9 - 0.2 = 0.7; 0.9 - 0.9 = 0.
    got = rules.compensated_momentum(momentum, tf.constant(mean_staleness))
    assert got.dtype == tf.float32
    assert float(got) == pytest.approx(expected, abs=1e-6)


def test_moving_average_step_by_hand():
    # 0.95 * 2 + 0.05 * 12 = 2.5, as the difference 0.5.
    assert float(rules.moving_average_step(tf.constant(2.0), 12.0, 0.95)) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "mean_staleness, expected", [(0.0, 1.0), (0.25, 0.8), (1.0, 0.5), (3.0, 0.25), (9.0, 0.1)]
)
def test_mean_staleness_lr_scale_by_hand(mean_staleness, expected):
    # 1 / (1 + s): 1 / 1.25 = 0.8; exactly 1 when nothing is stale.
    got = rules.mean_staleness_lr_scale(tf.constant(mean_staleness))
    assert got.dtype == tf.float32
    assert float(got) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("replicas, expected", [(1, 0.0), (4, 3.0), (16, 15.0)])
def test_expected_staleness_by_hand(replicas, expected):
    # N replicas taking turns: the N - 1 others land between a read and its update.
    assert rules.expected_staleness(replicas) == expected


def test_expected_staleness_rejects_no_replicas():
    with pytest.raises(ValueError, match="num_replicas >= 1, received 0"):
        rules.expected_staleness(0)


def test_gap_penalty_by_hand():
    now = tf.constant([1.0, 1.0, -2.0, 3.0])
    read = tf.constant([0.5, 1.0, -1.0, 0.0])
    # C = sqrt(mean square): [0.25, 1, 0.5, 1].
    step_mean_square = tf.constant([0.0625, 1.0, 0.25, 1.0])
    got = rules.gap_penalty(now, read, step_mean_square, epsilon=0.0)
    # 1 + |now - read| / C: 1 + 0.5 / 0.25, 1 + 0, 1 + 1 / 0.5, 1 + 3 / 1.
    np.testing.assert_allclose(got, [3.0, 1.0, 3.0, 4.0], rtol=1e-6)


def test_gap_penalty_of_a_parameter_that_never_moved_is_finite():
    got = rules.gap_penalty(tf.constant([2.0]), tf.constant([2.0]), tf.constant([0.0]))
    assert float(got[0]) == 1.0


@pytest.mark.parametrize("replicas, expected", [(1, 1.0), (4, 0.25), (16, 0.0625)])
def test_linear_lr_scale_by_hand(replicas, expected):
    got = rules.linear_lr_scale(replicas)
    assert got.dtype == tf.float32 and float(got) == expected


def test_linear_lr_scale_rejects_no_replicas():
    with pytest.raises(ValueError, match="num_replicas >= 1, received 0"):
        rules.linear_lr_scale(0)
