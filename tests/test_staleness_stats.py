"""Staleness statistics are plain arithmetic on counters."""

import dataclasses

import numpy as np

from tf_diffmap.store.staleness import StalenessStats


def make(updates, sums, maxes, version=None, dropped=None):
    n = len(updates)
    hist = np.zeros((n, 4), np.int64)
    return StalenessStats(
        version=version if version is not None else int(sum(updates)),
        updates=np.array(updates),
        dropped=np.array(dropped or [0] * n),
        staleness_sum=np.array(sums),
        staleness_max=np.array(maxes),
        histogram=hist,
    )


def test_means_and_shares_by_hand():
    stats = make([4, 0, 6], [2, 0, 12], [1, 0, 5])
    np.testing.assert_allclose(stats.mean_staleness, [0.5, 0.0, 2.0])
    assert stats.overall_mean_staleness == 14 / 10
    assert stats.overall_max_staleness == 5
    np.testing.assert_allclose(stats.work_share, [0.4, 0.0, 0.6])


def test_difference_between_snapshots():
    before = make([1, 1], [0, 1], [0, 1])
    after = make([5, 3], [4, 5], [2, 3], dropped=[1, 0])
    delta = after.since(before)
    assert delta.version == 6
    np.testing.assert_array_equal(delta.updates, [4, 2])
    np.testing.assert_allclose(delta.mean_staleness, [1.0, 2.0])
    np.testing.assert_array_equal(delta.dropped, [1, 0])


def test_text_and_dict_name_every_replica():
    stats = make([3, 1], [3, 0], [2, 0], dropped=[0, 2])
    text = str(stats)
    assert "replica 0: 3 updates (50.0%)" in text and "dropped 2" in text
    assert stats.as_dict()["max_staleness"] == [2, 0]


def test_work_share_counts_dropped_updates_as_work():
    stats = make([2, 6], [0, 0], [0, 0], dropped=[2, 0])
    np.testing.assert_allclose(stats.work_share, [0.4, 0.6])


def test_difference_from_before_the_store_aggregated_counts_its_steps():
    # `Strategy.statistics()` before the first traced step has no steps: the
    # store had applied none, so the difference keeps the unit of steps.
    zeros = np.zeros(2, np.int64)
    before = dataclasses.replace(
        make([0, 0], [0, 0], [0, 0]),
        step_staleness_sum=zeros,
        step_staleness_max=zeros,
        step_histogram=np.zeros((2, 4), np.int64),
    )
    after = dataclasses.replace(
        make([4, 4], [6, 6], [3, 3]),
        steps=2,
        step_staleness_sum=np.array([1, 3]),
        step_staleness_max=np.array([1, 1]),
        step_histogram=np.array([[3, 1, 0, 0], [1, 3, 0, 0]]),
    )
    delta = after.since(before)
    assert delta.aggregated and delta.steps == 2 and delta.gradients_per_step == 4.0
    np.testing.assert_allclose(delta.mean_step_staleness, [0.25, 0.75])
    assert not before.since(before).aggregated
