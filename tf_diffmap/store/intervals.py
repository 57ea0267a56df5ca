"""The counts between snapshots of a store's counters: what one point of
`tf_diffmap.StalenessTensorBoard` covers.

`StalenessStats.since` differences two snapshots of one run. A point also
meets `Strategy.reset_statistics()` between its snapshots (the counters went
back) and the first point of a run (no snapshot before it), and the
callback's reader takes many snapshots at once: `differences` takes K of
them in one pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tf_diffmap.store.staleness import StalenessStats

__all__ = ["difference", "differences"]

_COUNTS = (
    "updates",
    "dropped",
    "staleness_sum",
    "histogram",
    "examples",
    "lr_scale_sum",
    "step_staleness_sum",
    "step_histogram",
    "steps",
)
# Counts that `Strategy.reset_statistics()` zeroes (the store's optimizer
# steps go on counting).
_RESET = tuple(name for name in _COUNTS if name != "steps")


def differences(now: StalenessStats, before: StalenessStats | None) -> StalenessStats:
    """The counts between consecutive snapshots.

    Args:
        now: K snapshots, every counter array with a leading dimension of K.
        before: the snapshot before the first, or None (zeros).

    Returns:
        The K intervals' counts (arrays `[K, ...]`); an interval whose
        counters went back (`Strategy.reset_statistics()` was called in
        between) counts all of its snapshot's. `steps` is None unless `now`
        counts optimizer steps; a `before` that did not (its store was not
        aggregating yet) had applied none.
    """
    diffs = {}
    for name in _COUNTS:
        later = getattr(now, name)
        earlier = None if before is None else getattr(before, name)
        if later is None or (before is not None and earlier is None and name != "steps"):
            diffs[name] = None
            continue
        later = np.asarray(later)
        first = np.zeros_like(later[0]) if earlier is None else np.asarray(earlier)
        diffs[name] = np.diff(np.concatenate([first[None], later]), axis=0)
    went_back = (diffs["updates"] < 0).any(axis=1) | (diffs["dropped"] < 0).any(axis=1)
    went_back |= (diffs["histogram"] < 0).any(axis=(1, 2))
    if went_back.any():
        for name in _RESET:
            if diffs[name] is not None:
                diffs[name][went_back] = getattr(now, name)[went_back]
    return StalenessStats(
        version=0,
        staleness_max=now.staleness_max,
        step_staleness_max=now.step_staleness_max,
        **diffs,
    )


def difference(now: StalenessStats, before: StalenessStats | None) -> StalenessStats:
    """The counts between two snapshots (`differences` of one)."""
    stacked = dataclasses.replace(
        now,
        **{
            n: None if getattr(now, n) is None else np.asarray(getattr(now, n))[None]
            for n in _COUNTS
        },
    )
    one = differences(stacked, before)
    return dataclasses.replace(
        one,
        version=now.version - (0 if before is None else before.version),
        **{n: None if getattr(one, n) is None else getattr(one, n)[0] for n in _COUNTS},
    )
