"""What the Staleness dashboard shows, read through TensorBoard's data provider.

Plain functions from a `tensorboard.data.provider.DataProvider` to JSON-ready
dicts, so they are tested without a server. They read what
`tf_diffmap.StalenessTensorBoard` writes (`metadata.py`): the scalars and
histograms of the run, and the plugin's own `staleness/totals` tensor, whose
last point gives exact whole-run totals however the other series are
downsampled. A run whose store aggregated gradients into optimizer steps
also has the staleness in steps (and `staleness/step_totals`); one without
them (written before they were, or by a store that takes a step per update)
reads as it always did, in versions only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensorboard import errors
from tensorboard.data import provider
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata

from tf_diffmap.tensorboard_plugin import metadata

__all__ = ["list_runs", "run_series", "heatmap", "UNITS"]

# Series a line chart can show, in the order the dashboard offers them.
SCALAR_SERIES = (
    metadata.MEAN,
    metadata.MAX,
    metadata.STEP_MEAN,
    metadata.STEP_MAX,
    metadata.UPDATES,
    metadata.SHARE,
    metadata.EXAMPLES_PER_SECOND,
    metadata.LOST,
    metadata.DROPPED,
    metadata.LR_SCALE,
)

# Store-level series, each a list of `[step, value]` of its own in `run_series`.
STORE_SERIES = {
    metadata.VERSION: "version",
    metadata.OPTIMIZER_STEPS: "optimizer_steps",
    metadata.GRADIENTS_PER_STEP: "gradients_per_step",
}

UNITS = {"versions": metadata.DISTRIBUTION, "steps": metadata.STEP_DISTRIBUTION}
"""The staleness units `heatmap` reads: versions (every run), and optimizer
steps (runs whose store aggregated gradients into steps)."""


def _run_series(data_provider, ctx, experiment_id: str) -> dict[str, Any]:
    """Each run's `TOTALS` time series (metadata only), by run."""
    listing = data_provider.list_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=metadata.PLUGIN_NAME,
        run_tag_filter=provider.RunTagFilter(tags=[metadata.TOTALS]),
    )
    return {run: tags[metadata.TOTALS] for run, tags in listing.items() if metadata.TOTALS in tags}


def _run_infos(data_provider, ctx, experiment_id: str) -> dict[str, metadata.RunInfo]:
    infos = {}
    for run, series in _run_series(data_provider, ctx, experiment_id).items():
        try:
            infos[run] = metadata.RunInfo.from_bytes(series.plugin_content)
        except ValueError:
            continue  # written by another version: not shown rather than misread
    return infos


def _run_info(data_provider, ctx, experiment_id: str, run: str) -> metadata.RunInfo:
    infos = _run_infos(data_provider, ctx, experiment_id)
    if run not in infos:
        raise errors.NotFoundError(
            f"no staleness data in run {run!r}; runs with staleness data: {sorted(infos)}"
        )
    return infos[run]


def list_runs(data_provider, ctx, experiment_id: str) -> list[dict[str, Any]]:
    """The runs with staleness data, by name: each with its `RunInfo` fields
    and the step and time of its latest point (`last_step`, `last_wall_time`)."""
    runs = []
    for run, series in sorted(_run_series(data_provider, ctx, experiment_id).items()):
        try:
            info = metadata.RunInfo.from_bytes(series.plugin_content)
        except ValueError:
            continue  # written by another version: not shown rather than misread
        runs.append(
            {
                "run": run,
                **_info_json(info),
                "last_step": int(series.max_step),
                "last_wall_time": float(series.max_wall_time),
            }
        )
    return runs


def _info_json(info: metadata.RunInfo) -> dict[str, Any]:
    return {
        "num_replicas": info.num_replicas,
        "devices": list(info.devices),
        "histogram_bins": info.histogram_bins,
        "step_unit": info.step_unit,
        "rule": info.rule,
        "gradients_per_step": info.gradients_per_step,
    }


def _totals(data_provider, ctx, experiment_id: str, run: str) -> dict[str, Any] | None:
    data = data_provider.read_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=metadata.PLUGIN_NAME,
        downsample=1,  # the most recent point is always kept
        run_tag_filter=provider.RunTagFilter(
            runs=[run], tags=[metadata.TOTALS, metadata.STEP_TOTALS]
        ),
    ).get(run, {})
    points = data.get(metadata.TOTALS)
    if not points:
        return None
    last = points[-1]
    totals = _columns(last.numpy, metadata.TOTALS_COLUMNS)
    totals["step"] = int(last.step)
    totals["wall_time"] = float(last.wall_time)
    steps = data.get(metadata.STEP_TOTALS)
    if steps:
        totals.update(_columns(steps[-1].numpy, metadata.STEP_TOTALS_COLUMNS))
    return totals


def _columns(value, columns: tuple[str, ...]) -> dict[str, list[float]]:
    """A totals tensor (one row per replica) as per-replica lists by column."""
    table = np.asarray(value, dtype=np.float64).reshape(-1, len(columns))
    return {name: table[:, i].tolist() for i, name in enumerate(columns)}


def run_series(data_provider, ctx, experiment_id: str, run: str, downsample: int) -> dict[str, Any]:
    """Everything but the heat maps for one run.

    Returns:
        `{"run", "info", "totals", "version", "optimizer_steps",
        "gradients_per_step", "series"}`: `series[name][key]` is a list of
        `[step, value]` with `key` a replica id (as a string) or `"all"`;
        `version`, `optimizer_steps` and `gradients_per_step` are the store's
        `[step, value]` lists (the last two empty where the store took a
        step per update); `totals` the running totals at the last point
        (per-replica lists, with `step_staleness_sum` and
        `step_staleness_max` where the run has the staleness in steps).

    Raises:
        tensorboard.errors.NotFoundError: the run has no staleness data.
    """
    info = _run_info(data_provider, ctx, experiment_id, run)
    scalars = data_provider.read_scalars(
        ctx,
        experiment_id=experiment_id,
        plugin_name=scalar_metadata.PLUGIN_NAME,
        downsample=downsample,
        run_tag_filter=provider.RunTagFilter(runs=[run]),
    ).get(run, {})
    series: dict[str, dict[str, list]] = {name: {} for name in SCALAR_SERIES}
    store: dict[str, list] = {key: [] for key in STORE_SERIES.values()}
    for tag, points in scalars.items():
        values = [[int(p.step), float(p.value)] for p in points]
        if tag in STORE_SERIES:
            store[STORE_SERIES[tag]] = values
            continue
        parsed = metadata.parse_tag(tag)
        if parsed is None or parsed[0] not in series:
            continue
        name, replica = parsed
        series[name][metadata.ALL if replica is None else str(replica)] = values
    return {
        "run": run,
        "info": _info_json(info),
        "totals": _totals(data_provider, ctx, experiment_id, run),
        **store,
        "series": {name: values for name, values in series.items() if values},
    }


def heatmap(
    data_provider,
    ctx,
    experiment_id: str,
    run: str,
    replica: int | None,
    downsample: int,
    unit: str = "versions",
) -> dict[str, Any]:
    """The staleness distribution of one replica (or all) over steps.

    Args:
        replica: a replica id, or None for all replicas together.
        downsample: at most this many steps (TensorBoard keeps the latest).
        unit: `"versions"`, or `"steps"` for the staleness in optimizer
            steps (no columns where the run has none).

    Returns:
        `{"run", "replica", "unit", "steps", "counts", "overflow"}`:
        `counts[j][s]` is how many updates of the interval ending at
        `steps[j]` had staleness `s` (lists are trimmed after their last
        non-empty bin); staleness `overflow` and above share the last bin of
        the strategy's histogram.

    Raises:
        tensorboard.errors.NotFoundError: the run has no staleness data.
        tensorboard.errors.InvalidArgumentError: a replica the run did not
            have, or a unit not in `UNITS`.
    """
    if unit not in UNITS:
        raise errors.InvalidArgumentError(
            f"unit must be one of {', '.join(map(repr, UNITS))}, received {unit!r}"
        )
    info = _run_info(data_provider, ctx, experiment_id, run)
    if replica is not None and not 0 <= replica < info.num_replicas:
        raise errors.InvalidArgumentError(
            f"replica must be 'all' or 0 to {info.num_replicas - 1} for run {run!r}, "
            f"received {replica}"
        )
    tag = metadata.tag(UNITS[unit], replica)
    data = data_provider.read_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=histogram_metadata.PLUGIN_NAME,
        downsample=downsample,
        run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
    )
    steps, counts = [], []
    for point in data.get(run, {}).get(tag, []):
        buckets = np.asarray(point.numpy, dtype=np.float64).reshape(-1, 3)
        # Bucket s is centred on staleness s (see summary.histogram_buckets).
        staleness = np.rint((buckets[:, 0] + buckets[:, 1]) / 2).astype(np.int64)
        keep = staleness >= 0
        row = np.zeros(int(staleness.max(initial=0)) + 1, dtype=np.int64)
        np.add.at(row, staleness[keep], np.rint(buckets[keep, 2]).astype(np.int64))
        nonzero = np.flatnonzero(row)
        steps.append(int(point.step))
        counts.append(row[: nonzero[-1] + 1 if len(nonzero) else 0].tolist())
    return {
        "run": run,
        "replica": metadata.ALL if replica is None else replica,
        "unit": unit,
        "steps": steps,
        "counts": counts,
        "overflow": info.histogram_bins - 1,
    }
