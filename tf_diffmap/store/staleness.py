"""Staleness statistics as plain data.

The strategy counts, per replica, the updates it applied and how stale they
were; `StalenessStats` turns those counters into the figures a user reads.
Nothing here touches a variable. The update rules are in `tf_diffmap.updates.rules`;
`implicit_momentum` is here, since the statistics report it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["StalenessStats", "implicit_momentum"]


def implicit_momentum(mean_staleness):
    """The momentum that asynchrony adds: s / (1 + s) at mean staleness s.

    Mitliagkas, Zhang, Hadjis and Ré ("Asynchrony begets momentum", 2016)
    show that when the staleness of updates is geometrically distributed,
    asynchronous SGD behaves in expectation like momentum SGD with momentum
    `mu` where `mu / (1 - mu)` is the mean staleness; with `M` workers queued
    on one store that is `1 - 1/M`. Solved for `mu`: `s / (1 + s)`.

    Args:
        mean_staleness: s >= 0 (a float, an array or a tensor).

    Returns:
        s / (1 + s), in [0, 1), of the same kind as `mean_staleness`.
    """
    return mean_staleness / (1.0 + mean_staleness)


@dataclasses.dataclass(frozen=True)
class StalenessStats:
    """Counters of the parameter store at one moment.

    `Strategy.statistics()` returns one; `str()` of it is a summary per
    replica, and `since` takes the counts between two of them.

    Attributes:
        version: updates the store has applied in all.
        updates: per replica, updates applied.
        dropped: per replica, updates computed but not applied.
        staleness_sum: per replica, the sum of the staleness of applied updates.
        staleness_max: per replica, the largest staleness of an applied update.
        histogram: per replica, how many updates had staleness 0, 1, 2, ...;
            the last bin counts that staleness and everything above it.
            Dropped updates are counted here too.
        lr_scale_sum: per replica, the sum over applied updates of the factor
            a staleness rule applied to the learning rate; None where no rule
            scales it (the factor is then 1, and not printed).
        examples: per replica, the examples its updates (applied or dropped)
            were computed on.
        abandoned: claimed versions whose step never completed (interrupted
            by a lost worker, or by an error); version = completed updates
            + abandoned, once nothing is in flight.
        steps: optimizer steps the store applied, where shard gradients are
            aggregated K to a step (`Strategy(gradients_per_step=...)`);
            None where every update is a step of its own, so that the
            staleness in steps is the staleness in versions.
        step_staleness_sum: per replica, the sum of the staleness of applied
            updates in optimizer steps: the steps applied between the read
            of the parameters a gradient was computed on and its push.
        step_staleness_max: per replica, the largest of those.
        step_histogram: per replica, how many updates had a staleness of
            0, 1, 2, ... optimizer steps (dropped ones included).

    Examples:
        >>> import numpy as np, tf_diffmap
        >>> stats = tf_diffmap.StalenessStats(
        ...     version=6,
        ...     updates=np.array([4, 2]),
        ...     dropped=np.array([0, 0]),
        ...     staleness_sum=np.array([2, 4]),
        ...     staleness_max=np.array([1, 3]),
        ...     histogram=np.array([[2, 2, 0, 0], [0, 1, 0, 1]]),
        ... )
        >>> stats.mean_staleness
        array([0.5, 2. ])
        >>> stats.overall_mean_staleness
        1.0
        >>> print(stats)
        store version 6; mean staleness 1.00, max 3; momentum added by asynchrony 0.50
          replica 0: 4 updates (66.7%), mean staleness 0.50, max 1
          replica 1: 2 updates (33.3%), mean staleness 2.00, max 3
    """

    version: int
    updates: np.ndarray
    dropped: np.ndarray
    staleness_sum: np.ndarray
    staleness_max: np.ndarray
    histogram: np.ndarray
    lr_scale_sum: np.ndarray | None = None
    examples: np.ndarray | None = None
    abandoned: int = 0
    steps: int | None = None
    step_staleness_sum: np.ndarray | None = None
    step_staleness_max: np.ndarray | None = None
    step_histogram: np.ndarray | None = None

    @property
    def num_replicas(self) -> int:
        """The number of replicas counted."""
        return len(self.updates)

    @property
    def mean_staleness(self) -> np.ndarray:
        """Per replica, the mean staleness of its applied updates (0 if none)."""
        updates = np.asarray(self.updates, dtype=np.float64)
        sums = np.asarray(self.staleness_sum, dtype=np.float64)
        return np.divide(sums, updates, out=np.zeros_like(sums), where=updates > 0)

    @property
    def overall_mean_staleness(self) -> float:
        """The mean staleness of every applied update, all replicas together (0 if none)."""
        total = int(np.sum(self.updates))
        return float(np.sum(self.staleness_sum)) / total if total else 0.0

    @property
    def overall_max_staleness(self) -> int:
        """The largest staleness of an applied update, all replicas together."""
        return int(np.max(self.staleness_max)) if len(self.staleness_max) else 0

    @property
    def aggregated(self) -> bool:
        """Whether shard gradients were aggregated into optimizer steps."""
        return self.steps is not None

    @property
    def mean_step_staleness(self) -> np.ndarray:
        """Per replica, the mean staleness of its applied updates in
        optimizer steps (the staleness in versions when every update is a
        step of its own)."""
        if not self.aggregated or self.step_staleness_sum is None:
            return self.mean_staleness
        updates = np.asarray(self.updates, dtype=np.float64)
        sums = np.asarray(self.step_staleness_sum, dtype=np.float64)
        return np.divide(sums, updates, out=np.zeros_like(sums), where=updates > 0)

    @property
    def overall_mean_step_staleness(self) -> float:
        """The mean staleness in optimizer steps of every applied update."""
        if not self.aggregated or self.step_staleness_sum is None:
            return self.overall_mean_staleness
        total = int(np.sum(self.updates))
        return float(np.sum(self.step_staleness_sum)) / total if total else 0.0

    @property
    def overall_max_step_staleness(self) -> int:
        """The largest staleness in optimizer steps of an applied update."""
        if not self.aggregated or self.step_staleness_max is None:
            return self.overall_max_staleness
        return int(np.max(self.step_staleness_max)) if len(self.step_staleness_max) else 0

    @property
    def gradients_per_step(self) -> float:
        """Shard gradients (applied or dropped) per optimizer step: 1 where
        every update is a step of its own."""
        if not self.aggregated:
            return 1.0
        pushed = int(np.sum(self.updates) + np.sum(self.dropped))
        return pushed / self.steps if self.steps else 0.0

    @property
    def implicit_momentum(self) -> float:
        """The momentum that asynchrony adds at this mean staleness, s / (1 + s).

        s is the mean staleness in optimizer steps (in versions where every
        update is a step). See `implicit_momentum` (the function): with an
        optimizer whose own momentum is `mu`, the total is about
        `mu + stats.implicit_momentum`, and a total of 1 or more tends to
        diverge.
        """
        return float(implicit_momentum(self.overall_mean_step_staleness))

    @property
    def mean_lr_scale(self) -> np.ndarray:
        """Per replica, the mean learning-rate factor of its applied updates."""
        updates = np.asarray(self.updates, dtype=np.float64)
        if self.lr_scale_sum is None:
            return np.where(updates > 0, 1.0, 0.0)
        sums = np.asarray(self.lr_scale_sum, dtype=np.float64)
        return np.divide(sums, updates, out=np.zeros_like(sums), where=updates > 0)

    @property
    def work_share(self) -> np.ndarray:
        """Per replica, its fraction of the work.

        The work of a replica is the updates it computed, whether applied or
        dropped by a staleness rule.
        """
        work = np.asarray(self.updates, dtype=np.float64) + np.asarray(
            self.dropped, dtype=np.float64
        )
        total = work.sum()
        return work / total if total else np.zeros_like(work)

    def since(self, earlier: StalenessStats) -> StalenessStats:
        """The counts between `earlier` and this snapshot.

        `staleness_max` cannot be differenced, so it stays the running maximum
        (`interval_max_staleness` is the interval's own).

        Args:
            earlier: a snapshot of the same store, taken before this one.

        Returns:
            The difference, as `StalenessStats`.
        """
        return StalenessStats(
            version=self.version - earlier.version,
            updates=self.updates - earlier.updates,
            dropped=self.dropped - earlier.dropped,
            staleness_sum=self.staleness_sum - earlier.staleness_sum,
            staleness_max=self.staleness_max,
            histogram=self.histogram - earlier.histogram,
            lr_scale_sum=None
            if self.lr_scale_sum is None or earlier.lr_scale_sum is None
            else self.lr_scale_sum - earlier.lr_scale_sum,
            examples=None
            if self.examples is None or earlier.examples is None
            else self.examples - earlier.examples,
            abandoned=self.abandoned - earlier.abandoned,
            # An earlier snapshot without steps was taken before the store
            # began to aggregate (its first traced step): it had applied none.
            steps=None if self.steps is None else self.steps - (earlier.steps or 0),
            step_staleness_sum=_difference(self.step_staleness_sum, earlier.step_staleness_sum),
            step_staleness_max=self.step_staleness_max,
            step_histogram=_difference(self.step_histogram, earlier.step_histogram),
        )

    @property
    def interval_max_staleness(self) -> np.ndarray:
        """Per replica, the largest staleness in `histogram`.

        The last bin stands for itself and above. Unlike `staleness_max`, this
        is exact for a difference of snapshots (`since`); dropped updates
        count too.
        """
        hist = np.asarray(self.histogram)
        out = np.zeros(hist.shape[0], dtype=np.int64)
        for r, row in enumerate(hist):
            nonzero = np.flatnonzero(row)
            out[r] = nonzero[-1] if len(nonzero) else 0
        return out

    def as_dict(self) -> dict:
        """Plain Python values, for logs and JSON."""
        figures = {
            "version": self.version,
            "updates": [int(u) for u in self.updates],
            "dropped": [int(d) for d in self.dropped],
            "mean_staleness": [float(m) for m in self.mean_staleness],
            "max_staleness": [int(m) for m in self.staleness_max],
            "overall_mean_staleness": self.overall_mean_staleness,
            "overall_max_staleness": self.overall_max_staleness,
        }
        if self.aggregated:
            figures.update(
                steps=self.steps,
                gradients_per_step=self.gradients_per_step,
                mean_step_staleness=[float(m) for m in self.mean_step_staleness],
                overall_mean_step_staleness=self.overall_mean_step_staleness,
                overall_max_step_staleness=self.overall_max_step_staleness,
            )
        return figures

    def __str__(self) -> str:
        if self.aggregated:
            return self._aggregated_summary()
        rows = [
            f"store version {self.version}; mean staleness "
            f"{self.overall_mean_staleness:.2f}, max {self.overall_max_staleness}; "
            f"momentum added by asynchrony {self.implicit_momentum:.2f}"
        ]
        for r in range(self.num_replicas):
            rows.append(
                f"  replica {r}: {int(self.updates[r])} updates "
                f"({100 * self.work_share[r]:.1f}%), mean staleness "
                f"{self.mean_staleness[r]:.2f}, max {int(self.staleness_max[r])}"
                + (f", dropped {int(self.dropped[r])}" if self.dropped[r] else "")
                + (
                    f", learning-rate factor {self.mean_lr_scale[r]:.2f}"
                    if self.lr_scale_sum is not None and self.updates[r]
                    else ""
                )
            )
        return "\n".join(rows)

    def _aggregated_summary(self) -> str:
        step_max = self.step_staleness_max
        rows = [
            f"store version {self.version}, {self.steps} optimizer steps "
            f"({self.gradients_per_step:.1f} gradients each); mean staleness "
            f"{self.overall_mean_staleness:.2f} versions (max {self.overall_max_staleness}), "
            f"{self.overall_mean_step_staleness:.2f} steps (max "
            f"{self.overall_max_step_staleness}); momentum added by asynchrony "
            f"{self.implicit_momentum:.2f}"
        ]
        for r in range(self.num_replicas):
            rows.append(
                f"  replica {r}: {int(self.updates[r])} gradients "
                f"({100 * self.work_share[r]:.1f}%), mean staleness "
                f"{self.mean_staleness[r]:.2f} versions (max {int(self.staleness_max[r])}), "
                f"{self.mean_step_staleness[r]:.2f} steps (max "
                f"{int(step_max[r]) if step_max is not None else 0})"
                + (f", dropped {int(self.dropped[r])}" if self.dropped[r] else "")
            )
        return "\n".join(rows)


def _difference(now, earlier):
    if now is None or earlier is None:
        return None
    return now - earlier
