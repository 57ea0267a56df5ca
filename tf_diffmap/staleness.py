"""Staleness statistics as plain data.

The strategy counts, per replica, the updates it applied and how stale they
were; this module turns those counters into the figures a user reads. It holds
no TensorFlow state, so it is tested on its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["StalenessStats"]


@dataclasses.dataclass(frozen=True)
class StalenessStats:
    """Counters of the parameter store at one moment.

    Attributes:
        version: updates the store has applied in all.
        updates: per replica, updates applied.
        dropped: per replica, updates computed but not applied.
        staleness_sum: per replica, the sum of the staleness of applied updates.
        staleness_max: per replica, the largest staleness of an applied update.
        histogram: per replica, how many updates had staleness 0, 1, 2, ...;
            the last bin counts that staleness and everything above it.
    """

    version: int
    updates: np.ndarray
    dropped: np.ndarray
    staleness_sum: np.ndarray
    staleness_max: np.ndarray
    histogram: np.ndarray

    @property
    def num_replicas(self) -> int:
        return len(self.updates)

    @property
    def mean_staleness(self) -> np.ndarray:
        """Per replica, the mean staleness of its applied updates (0 if none)."""
        updates = np.asarray(self.updates, dtype=np.float64)
        sums = np.asarray(self.staleness_sum, dtype=np.float64)
        return np.divide(sums, updates, out=np.zeros_like(sums), where=updates > 0)

    @property
    def overall_mean_staleness(self) -> float:
        total = int(np.sum(self.updates))
        return float(np.sum(self.staleness_sum)) / total if total else 0.0

    @property
    def overall_max_staleness(self) -> int:
        return int(np.max(self.staleness_max)) if len(self.staleness_max) else 0

    @property
    def work_share(self) -> np.ndarray:
        """Per replica, its fraction of all applied updates."""
        updates = np.asarray(self.updates, dtype=np.float64)
        total = updates.sum()
        return updates / total if total else np.zeros_like(updates)

    def since(self, earlier: StalenessStats) -> StalenessStats:
        """The counts between `earlier` and this snapshot.

        `staleness_max` cannot be differenced, so it stays the running maximum.
        """
        return StalenessStats(
            version=self.version - earlier.version,
            updates=self.updates - earlier.updates,
            dropped=self.dropped - earlier.dropped,
            staleness_sum=self.staleness_sum - earlier.staleness_sum,
            staleness_max=self.staleness_max,
            histogram=self.histogram - earlier.histogram,
        )

    def as_dict(self) -> dict:
        """Plain Python values, for logs and JSON."""
        return {
            "version": self.version,
            "updates": [int(u) for u in self.updates],
            "dropped": [int(d) for d in self.dropped],
            "mean_staleness": [float(m) for m in self.mean_staleness],
            "max_staleness": [int(m) for m in self.staleness_max],
            "overall_mean_staleness": self.overall_mean_staleness,
            "overall_max_staleness": self.overall_max_staleness,
        }

    def __str__(self) -> str:
        rows = [
            f"store version {self.version}; mean staleness "
            f"{self.overall_mean_staleness:.2f}, max {self.overall_max_staleness}"
        ]
        for r in range(self.num_replicas):
            rows.append(
                f"  replica {r}: {int(self.updates[r])} updates "
                f"({100 * self.work_share[r]:.1f}%), mean staleness "
                f"{self.mean_staleness[r]:.2f}, max {int(self.staleness_max[r])}"
                + (f", dropped {int(self.dropped[r])}" if self.dropped[r] else "")
            )
        return "\n".join(rows)
