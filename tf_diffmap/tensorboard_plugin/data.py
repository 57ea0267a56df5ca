"""What the Staleness dashboard shows, read through TensorBoard's data provider.

Plain functions from a `tensorboard.data.provider.DataProvider` to JSON-ready
dicts, so they are tested without a server. They read what
`tf_diffmap.StalenessTensorBoard` writes (`metadata.py`): the scalars and
histograms of the run, and the plugin's own `staleness/totals` tensor, whose
last point gives exact whole-run totals however the other series are
downsampled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensorboard import errors
from tensorboard.data import provider
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata

from tf_diffmap.tensorboard_plugin import metadata

__all__ = ["list_runs", "run_series", "heatmap"]

# Series a line chart can show, in the order the dashboard offers them.
SCALAR_SERIES = (
    metadata.MEAN,
    metadata.MAX,
    metadata.UPDATES,
    metadata.SHARE,
    metadata.EXAMPLES_PER_SECOND,
    metadata.LOST,
    metadata.DROPPED,
    metadata.LR_SCALE,
)


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
    }


def _totals(data_provider, ctx, experiment_id: str, run: str) -> dict[str, Any] | None:
    data = data_provider.read_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=metadata.PLUGIN_NAME,
        downsample=1,  # the most recent point is always kept
        run_tag_filter=provider.RunTagFilter(runs=[run], tags=[metadata.TOTALS]),
    )
    points = data.get(run, {}).get(metadata.TOTALS)
    if not points:
        return None
    last = points[-1]
    table = np.asarray(last.numpy, dtype=np.float64).reshape(-1, len(metadata.TOTALS_COLUMNS))
    totals = {name: table[:, i].tolist() for i, name in enumerate(metadata.TOTALS_COLUMNS)}
    totals["step"] = int(last.step)
    totals["wall_time"] = float(last.wall_time)
    return totals


def run_series(data_provider, ctx, experiment_id: str, run: str, downsample: int) -> dict[str, Any]:
    """Everything but the heat maps for one run.

    Returns:
        `{"run", "info", "totals", "version", "series"}`: `series[name][key]`
        is a list of `[step, value]` with `key` a replica id (as a string) or
        `"all"`; `version` is the store version's `[step, value]` list;
        `totals` the running totals at the last point (per-replica lists).

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
    version = []
    for tag, points in scalars.items():
        values = [[int(p.step), float(p.value)] for p in points]
        if tag == metadata.VERSION:
            version = values
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
        "version": version,
        "series": {name: values for name, values in series.items() if values},
    }


def heatmap(
    data_provider,
    ctx,
    experiment_id: str,
    run: str,
    replica: int | None,
    downsample: int,
) -> dict[str, Any]:
    """The staleness distribution of one replica (or all) over steps.

    Args:
        replica: a replica id, or None for all replicas together.
        downsample: at most this many steps (TensorBoard keeps the latest).

    Returns:
        `{"run", "replica", "steps", "counts", "overflow"}`: `counts[j][s]` is
        how many updates of the interval ending at `steps[j]` had staleness
        `s` (lists are trimmed after their last non-empty bin); staleness
        `overflow` and above share the last bin of the strategy's histogram.

    Raises:
        tensorboard.errors.NotFoundError: the run has no staleness data.
        tensorboard.errors.InvalidArgumentError: a replica the run did not have.
    """
    info = _run_info(data_provider, ctx, experiment_id, run)
    if replica is not None and not 0 <= replica < info.num_replicas:
        raise errors.InvalidArgumentError(
            f"replica must be 'all' or 0 to {info.num_replicas - 1} for run {run!r}, "
            f"received {replica}"
        )
    tag = metadata.tag(metadata.DISTRIBUTION, replica)
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
        "steps": steps,
        "counts": counts,
        "overflow": info.histogram_bins - 1,
    }
