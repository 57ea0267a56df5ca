"""Names and formats shared by the staleness summaries and the dashboard.

One place says what `tf_diffmap.StalenessTensorBoard` writes and what the
Staleness dashboard reads, so that the two cannot drift apart. Everything is
written into one run (`RUN_NAME`, a subdirectory of the callback's log
directory), with one tag per replica and series:

    staleness/mean/replica_0     staleness/mean/all       (scalars)
    staleness/max/replica_0      staleness/max/all        (scalars)
    staleness/distribution/...                            (histograms)
    work/updates/...  work/share/replica_0  work/examples_per_second/...
    work/lost/...                         (from the first point after a replica was lost)
    store/version
    rule/dropped/...  rule/lr_scale/...   (only when an AsyncOptimizer rule is active;
                                           rule/dropped also where the strategy's
                                           max_step_staleness may drop gradients)
    staleness/totals                      (this plugin's own tensor)

and, where the store aggregates shard gradients into optimizer steps
(`Strategy(gradients_per_step=K)`, K > 1), the staleness in optimizer steps
beside the staleness in versions:

    staleness/steps/mean/...  staleness/steps/max/...     (scalars)
    staleness/steps/distribution/...                      (histograms)
    store/optimizer_steps  store/gradients_per_step       (scalars)
    staleness/step_totals                 (this plugin's own tensor)

`staleness/totals` holds the running totals per replica, so that the last
point of the series gives exact whole-run figures however TensorBoard
downsamples the others; its summary metadata carries the `RunInfo`.
`staleness/step_totals` does the same for the staleness in optimizer steps.
The step series came after the first format: a run without them (written
before, or by a store that takes a step per update) reads as before, and a
reader that does not know them ignores them, so the format version stays.

This module imports nothing from TensorFlow, so TensorBoard and the tests
read it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import re

__all__ = [
    "PLUGIN_NAME",
    "RUN_NAME",
    "FORMAT_VERSION",
    "ALL",
    "MEAN",
    "MAX",
    "DISTRIBUTION",
    "UPDATES",
    "SHARE",
    "EXAMPLES_PER_SECOND",
    "LOST",
    "VERSION",
    "DROPPED",
    "LR_SCALE",
    "TOTALS",
    "TOTALS_COLUMNS",
    "STEP_MEAN",
    "STEP_MAX",
    "STEP_DISTRIBUTION",
    "OPTIMIZER_STEPS",
    "GRADIENTS_PER_STEP",
    "STEP_TOTALS",
    "STEP_TOTALS_COLUMNS",
    "LAYOUT_CATEGORY",
    "RunInfo",
    "tag",
    "parse_tag",
]

PLUGIN_NAME = "staleness"
"""The plugin's name: its route prefix and the `plugin_name` of its own data."""

RUN_NAME = "staleness"
"""The subdirectory of the log directory that the callback writes into."""

FORMAT_VERSION = 1

ALL = "all"
"""Tag suffix of the all-replica series."""

MEAN = "staleness/mean"
MAX = "staleness/max"
DISTRIBUTION = "staleness/distribution"
UPDATES = "work/updates"
SHARE = "work/share"
EXAMPLES_PER_SECOND = "work/examples_per_second"
LOST = "work/lost"
"""Per replica, 1 at a point where the replica was lost (its worker task
unreachable, or rejoining) and 0 otherwise; for all replicas, how many were.
Written from the first point after a replica of the run was lost."""
VERSION = "store/version"
DROPPED = "rule/dropped"
LR_SCALE = "rule/lr_scale"
TOTALS = "staleness/totals"

TOTALS_COLUMNS = ("updates", "dropped", "examples", "staleness_sum", "staleness_max")
"""Columns of the `TOTALS` tensor, one row per replica, since the callback
began: updates applied and dropped, examples, the staleness summed over the
applied updates (as `StalenessStats.staleness_sum`), and the largest staleness
of any update (the `MAX` series' largest value)."""

STEP_MEAN = "staleness/steps/mean"
"""Per replica, the mean staleness of the interval's updates in optimizer
steps: the steps applied between a gradient's read of the parameters and
its push. Written where the store aggregates gradients into steps."""
STEP_MAX = "staleness/steps/max"
STEP_DISTRIBUTION = "staleness/steps/distribution"
OPTIMIZER_STEPS = "store/optimizer_steps"
"""The optimizer steps the store has applied (aggregating K gradients to a step)."""
GRADIENTS_PER_STEP = "store/gradients_per_step"
"""The interval's shard gradients (applied or dropped) per optimizer step
applied in it; no value where the interval applied no step."""
STEP_TOTALS = "staleness/step_totals"

STEP_TOTALS_COLUMNS = ("step_staleness_sum", "step_staleness_max")
"""Columns of the `STEP_TOTALS` tensor, one row per replica, since the
callback began: the staleness in optimizer steps summed over the applied
updates (as `StalenessStats.step_staleness_sum`), and the largest (the
`STEP_MAX` series' largest value)."""

LAYOUT_CATEGORY = "tf_diffmap: staleness"
"""Title of the custom-scalars category that the callback writes."""

_TAG = re.compile(r"^(?P<series>.+)/(?:replica_(?P<replica>\d+)|all)$")


def tag(series: str, replica: int | None) -> str:
    """The tag of one replica's series, or of the all-replica series.

    Args:
        series: one of the series names of this module, e.g. `MEAN`.
        replica: the replica id, or None for the all-replica series.

    Returns:
        For example `"staleness/mean/replica_3"` or `"staleness/mean/all"`.
    """
    return f"{series}/{ALL}" if replica is None else f"{series}/replica_{int(replica)}"


def parse_tag(name: str) -> tuple[str, int | None] | None:
    """The inverse of `tag`: `(series, replica or None)`, or None if not ours."""
    match = _TAG.match(name)
    if match is None:
        return None
    replica = match.group("replica")
    return match.group("series"), (None if replica is None else int(replica))


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What the dashboard needs to know about a run before reading its data.

    Attributes:
        num_replicas: replicas that trained.
        devices: the device of each replica.
        histogram_bins: staleness bins the strategy counts; the last bin
            counts that staleness and everything above it.
        step_unit: `"epoch"` or `"batch"`: what the steps of the run count.
        rule: the AsyncOptimizer rule in use (e.g. `"inverse"`,
            `"drop (drop_above=8)"`), or None when none is active.
        gradients_per_step: K, the shard gradients the store aggregates
            into one optimizer step; None where every update is a step of
            its own (and in runs written before it was recorded).
    """

    num_replicas: int
    devices: tuple[str, ...]
    histogram_bins: int
    step_unit: str
    rule: str | None = None
    gradients_per_step: int | None = None

    def to_bytes(self) -> bytes:
        """The JSON that goes into the `TOTALS` summary's plugin content."""
        payload = dataclasses.asdict(self)
        payload["devices"] = list(self.devices)
        payload["format_version"] = FORMAT_VERSION
        return json.dumps(payload, sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, content: bytes) -> RunInfo:
        """Parses `to_bytes` output.

        Raises:
            ValueError: the content is not a run description this version
                understands (written by a newer tf_diffmap, or not ours).
        """
        try:
            payload = json.loads(bytes(content).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"Not a staleness run description: {content[:80]!r}.") from error
        version = payload.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ValueError(
                f"Staleness data of format version {version!r}; this tf_diffmap reads "
                f"version {FORMAT_VERSION}. Upgrade tf_diffmap where TensorBoard runs."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        payload = {k: v for k, v in payload.items() if k in fields}
        payload["devices"] = tuple(payload.get("devices", ()))
        return cls(**payload)
