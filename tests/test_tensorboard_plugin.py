"""The Staleness plugin inside a real `tensorboard` process, through its HTTP API.

One training run and one TensorBoard server serve this module and
`test_dashboard_render.py` (`shared_tensorboard`); the server is stopped when
the test session ends, whatever happens. The tests that start the server are
slow tests (`in_tensorboard`); the rest read the plugin in this process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import keras
import numpy as np
import pytest

import tf_diffmap
from tests.conftest import classification_data, compile_logits
from tf_diffmap.tensorboard_plugin import metadata
from tf_diffmap.tensorboard_plugin.plugin import _STATIC, StalenessPlugin

REPO = Path(__file__).resolve().parents[1]
REPLICAS = 4
STARTUP_SECONDS = 150  # TensorBoard imports TensorFlow and tf_diffmap: slow on a busy host
DATA_SECONDS = 60

# Starts TensorBoard with the plugin passed explicitly, for a checkout that
# is not installed (so no entry point is registered): what the entry point
# does is tested on its own below.
_LAUNCHER = """
import sys
from tensorboard import default, program
from tf_diffmap.tensorboard_plugin.plugin import StalenessPlugin
plugins = default.get_plugins()  # with the entry points' plugins, if any
tb = program.TensorBoard(plugins=plugins + [p for p in [StalenessPlugin] if p not in plugins])
tb.configure(argv=["tensorboard"] + sys.argv[1:])
sys.exit(tb.main())
"""


def entry_point_installed() -> bool:
    return any(
        e.value == "tf_diffmap.tensorboard_plugin.plugin:StalenessPlugin"
        for e in importlib.metadata.entry_points(group="tensorboard_plugins")
    )


class TensorBoardServer:
    """`tensorboard --logdir LOGDIR --host 127.0.0.1 --port 0` in a subprocess.

    Args:
        logdir: the log directory to serve.

    Raises:
        RuntimeError: TensorBoard exited, or printed no URL within
            `STARTUP_SECONDS`; the message holds what it printed.
    """

    def __init__(self, logdir: Path):
        flags = ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
        script = Path(sys.executable).with_name("tensorboard")
        if not entry_point_installed():
            command = [sys.executable, "-c", _LAUNCHER, *flags]
        elif script.exists():
            command = [str(script), *flags]
        else:
            command = [sys.executable, "-m", "tensorboard.main", *flags]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=str(REPO),
        )
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.url = self._wait_for_url()
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.process.stderr:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"tensorboard exited with {self.process.wait()}:\n{''.join(self.output)}"
                )
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if found:
                return found.group(1)
        raise RuntimeError(
            f"tensorboard printed no URL in {STARTUP_SECONDS} s:\n{''.join(self.output)}"
        )

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """GET `path` (relative to the server's root): status, headers, body."""
        try:
            with urllib.request.urlopen(self.url + path.lstrip("/"), timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def get_json(self, path: str):
        status, _, body = self.get(path)
        assert status == 200, f"{path}: HTTP {status}: {body[:300]!r}"
        return json.loads(body)

    def wait_for_data(self, run: str, last_step: int) -> None:
        """Waits until TensorBoard has loaded the run's points up to `last_step`."""
        deadline = time.monotonic() + DATA_SECONDS
        while time.monotonic() < deadline:
            runs = self.get_json("data/plugin/staleness/runs")["runs"]
            if any(r["run"] == run for r in runs):
                totals = self.get_json(f"data/plugin/staleness/series?run={run}")["totals"]
                if totals is not None and totals["step"] >= last_step:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"TensorBoard did not load run {run!r} in {DATA_SECONDS} s")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)


@dataclass
class TrainedRun:
    logdir: Path
    statistics: tf_diffmap.StalenessStats
    steps: list[int]
    others: dict[str, tf_diffmap.StalenessStats] = field(default_factory=dict)


def _slowed_model(strategy: tf_diffmap.Strategy, seconds: float) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                tf_diffmap.testing.ReplicaDelay(seconds, replicas=[0]),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        compile_logits(model, keras.optimizers.Adam(3e-3))
    return model


# Runs beside the main one, to see the tab with 1 and with 16 replicas
# (16: four replicas on each of the four logical CPU devices).
OTHER_RUNS = {"one": {"devices": ["CPU:0"]}, "sixteen": {"replicas_per_device": 4}}


LOST_AT = {1: [False, True, False, False], 2: [False, False, True, True]}
"""The `lost` run: replica -> lost at points 1 to 4 (replica 1 came back)."""


def write_lost_run(logdir: Path, replicas: int = 4) -> None:
    """A run of a cluster whose replicas 1 and 2 were lost (replica 2 still is)."""
    from tf_diffmap.tensorboard_plugin.summary import StalenessSummaryWriter

    devices = tuple(f"/job:worker/replica:0/task:{r}/device:CPU:0" for r in range(replicas))
    info = metadata.RunInfo(replicas, devices, 8, "batch")
    writer = StalenessSummaryWriter(logdir / metadata.RUN_NAME, info, rules=False, faults=True)
    for point in range(4):
        lost = np.array([LOST_AT.get(r, [False] * 4)[point] for r in range(replicas)])
        histogram = np.zeros((replicas, 8), np.int64)
        histogram[~lost, 1] = 3
        writer.write(
            point + 1,
            tf_diffmap.StalenessStats(
                version=(point + 1) * 12,
                updates=histogram.sum(axis=1),
                dropped=np.zeros(replicas, np.int64),
                staleness_sum=histogram.sum(axis=1),
                staleness_max=np.ones(replicas, np.int64),
                histogram=histogram,
            ),
            version=(point + 1) * 12,
            seconds=0.5,
            lost=lost,
        )
    writer.close()


def train_logs(logdir: Path, epochs: int = 4, steps_per_epoch: int = 12, others: bool = True):
    """A short run with a slow replica 0, logged by Keras' TensorBoard and ours.

    With `others`, first a one-epoch run of each of `OTHER_RUNS` in
    `logdir/<name>` (TensorBoard shows them as runs `<name>/staleness`).

    Returns:
        A `TrainedRun` of the main run (`logdir/staleness`): the strategy's
        statistics at the end, and the steps of its staleness points.
    """
    other_statistics = {}
    if others:
        x, y = classification_data(n=6 * 64)
        for name, options in OTHER_RUNS.items():
            other = tf_diffmap.Strategy(**options)
            model = _slowed_model(other, seconds=0.002)
            callback = tf_diffmap.StalenessTensorBoard(
                logdir / name, update_freq="batch", max_overhead=None
            )
            model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[callback])
            other_statistics[name] = other.statistics()
        write_lost_run(logdir / "lost")
    x, y = classification_data(n=steps_per_epoch * 64)
    strategy = tf_diffmap.Strategy()
    model = _slowed_model(strategy, seconds=0.015)
    every = 2
    model.fit(
        x,
        y,
        batch_size=64,
        epochs=epochs,
        verbose=0,
        callbacks=[
            keras.callbacks.TensorBoard(str(logdir), update_freq=5),
            # Every second batch, whatever it costs, so that the test knows the steps.
            tf_diffmap.StalenessTensorBoard(logdir, update_freq=every, max_overhead=None),
        ],
    )
    return TrainedRun(
        logdir,
        strategy.statistics(),
        list(range(every, epochs * steps_per_epoch + 1, every)),
        other_statistics,
    )


def shared_tensorboard(request, tmp_path_factory) -> tuple[TrainedRun, TensorBoardServer]:
    """The session's training run and the TensorBoard serving it (made once).

    Kept on the pytest session, not in a module global: this module may be
    imported twice (by pytest, and by `test_dashboard_render`).
    """
    shared = getattr(request.session, "_tf_diffmap_staleness_tensorboard", None)
    if shared is None:
        trained = train_logs(tmp_path_factory.mktemp("staleness_logs"))
        server = TensorBoardServer(trained.logdir)
        request.session.config.add_cleanup(server.close)
        server.wait_for_data(metadata.RUN_NAME, trained.steps[-1])
        shared = request.session._tf_diffmap_staleness_tensorboard = (trained, server)
    return shared


# Marks a test that starts TensorBoard: slow, as every test that starts a
# process (each xdist worker that runs one trains and serves once).
in_tensorboard = pytest.mark.slow


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    return shared_tensorboard(request, tmp_path_factory)


# -- installation --------------------------------------------------------------


def test_entry_point_and_static_files_are_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["tensorboard_plugins"]
    assert plugins == {"staleness": "tf_diffmap.tensorboard_plugin.plugin:StalenessPlugin"}
    patterns = project["tool"]["setuptools"]["package-data"]["tf_diffmap.tensorboard_plugin"]
    static = REPO / "tf_diffmap" / "tensorboard_plugin"
    for name in _STATIC:
        assert (static / "static" / name).is_file()
        assert any((static / "static" / name).match(p) for p in patterns), name
    if entry_point_installed():
        (entry,) = [
            e
            for e in importlib.metadata.entry_points(group="tensorboard_plugins")
            if e.name == "staleness"
        ]
        assert entry.load() is StalenessPlugin


# -- the data, in process -----------------------------------------------------


def test_hand_encoded_events_are_what_the_protocol_buffers_say(tmp_path):
    """The writer encodes events by hand: they parse into the events the
    protocol buffer library would make, metadata on each tag's first value."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2

    from tf_diffmap.tensorboard_plugin.encoding import Series
    from tf_diffmap.tensorboard_plugin.event_file import EventFile

    meta = summary_pb2.SummaryMetadata(
        summary_description="d", plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="p")
    )
    scalar, matrix = Series("a/scalar", meta), Series("a/matrix", meta)
    events = EventFile(tmp_path)
    points = [
        (0, 1.5, np.arange(6.0).reshape(2, 3)),
        (2**40, 1e39, np.full((1, 3), -0.25)),  # beyond float32: infinite
        (7, -3.0, np.zeros((0, 3))),
    ]
    for step, number, array in points:
        content = array.astype("<f8").tobytes()
        events.write_encoded(scalar.scalar(number) + matrix.matrix(content, array.shape), step)
    events.close()
    records = list(event_file_loader.EventFileLoader(events.path).Load())
    assert records[0].file_version == "brain.Event:2"
    for (step, number, array), event in zip(points, records[1:], strict=True):
        first = step == 0
        expected = summary_pb2.Summary()
        value = expected.value.add(tag="a/scalar")
        value.tensor.dtype = types_pb2.DT_FLOAT
        value.tensor.tensor_shape.SetInParent()
        value.tensor.float_val.append(np.inf if number > 3.5e38 else number)
        if first:
            value.metadata.CopyFrom(meta)
        value = expected.value.add(tag="a/matrix")
        value.tensor.CopyFrom(tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE))
        for size in array.shape:
            value.tensor.tensor_shape.dim.add().size = size
        value.tensor.tensor_content = array.astype("<f8").tobytes()
        if first:
            value.metadata.CopyFrom(meta)
        assert event.step == step and abs(event.wall_time - time.time()) < 60
        assert event.summary == expected, (event.summary, expected)
    assert np.isinf(records[2].summary.value[0].tensor.float_val[0])


def test_scalars_encoded_in_blocks_are_the_scalars_encoded_one_by_one():
    """`ScalarBlocks` fills templates of bytes with NumPy: the bytes of
    `Series.scalar` of each present slot, in order, whatever the points
    have (three sets of slots among five points, and floats beyond float32)."""
    from tensorboard.compat.proto import summary_pb2

    from tf_diffmap.tensorboard_plugin.encoding import ScalarBlocks, Series

    meta = summary_pb2.SummaryMetadata(summary_description="d")

    def series():
        made = [Series(f"s/{n}/replica_{n % 3}", meta) for n in range(12)]
        for one in made:
            one.scalar(0.0)  # the first value, with the metadata
        return [*made[:5], None, *made[5:]]

    rng = np.random.default_rng(0)
    values = rng.normal(size=(5, 13)) * 10.0 ** rng.integers(-3, 5, size=(5, 13))
    values[1, 2], values[3, 4] = 1e39, -1e40
    present = np.ones((5, 13), bool)
    present[:, 5] = False  # a slot without series is never present
    present[[1, 3], 7] = False
    present[4, :] = False
    present[4, 0] = True
    blocks = ScalarBlocks(series()).encode(values, present)
    reference = series()
    for k in range(5):
        expected = b"".join(reference[j].scalar(values[k, j]) for j in range(13) if present[k, j])
        assert blocks[k] == expected, k
    assert ScalarBlocks(series()).encode(values[:0], present[:0]) == []


def test_data_functions_read_what_the_writer_wrote(tmp_path):
    """Edge cases without a server: a replica with no update in a point, the
    overflow bin, and queries for what is not there."""
    from tensorboard import context, errors
    from tensorboard.backend.event_processing import data_provider as multiplexer_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer

    from tf_diffmap.tensorboard_plugin import data
    from tf_diffmap.tensorboard_plugin.summary import StalenessSummaryWriter

    bins = 4
    info = metadata.RunInfo(2, ("/device:CPU:0", "/device:CPU:1"), bins, "batch")
    writer = StalenessSummaryWriter(tmp_path / "run" / metadata.RUN_NAME, info, rules=False)
    histograms = [[[3, 1, 0, 0], [0, 0, 0, 0]], [[0, 0, 0, 2], [1, 1, 0, 0]]]
    for step, histogram in enumerate(histograms, start=1):
        histogram = np.array(histogram)
        writer.write(
            step,
            tf_diffmap.StalenessStats(
                version=step * 4,
                updates=histogram.sum(axis=1),
                dropped=np.zeros(2, np.int64),
                staleness_sum=(histogram * np.arange(bins)).sum(axis=1),
                staleness_max=np.zeros(2, np.int64),
                histogram=histogram,
                examples=histogram.sum(axis=1) * 8,
            ),
            version=step * 4,
            seconds=0.5,
        )
    writer.close()
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    provider = multiplexer_provider.MultiplexerDataProvider(multiplexer, str(tmp_path))
    ctx = context.RequestContext()
    run = f"run/{metadata.RUN_NAME}"

    (listed,) = data.list_runs(provider, ctx, "")
    assert listed["run"] == run and listed["num_replicas"] == 2 and listed["last_step"] == 2
    body = data.run_series(provider, ctx, "", run, downsample=1000)
    assert body["totals"]["updates"] == [6.0, 2.0] and body["totals"]["staleness_max"] == [3, 1]
    assert body["version"] == [[1, 4.0], [2, 8.0]]
    # Replica 1 had no update at step 1: no mean there, rather than a made-up 0.
    assert body["series"][metadata.MEAN]["1"] == [[2, 0.5]]
    assert body["series"][metadata.MEAN]["0"] == [[1, 0.25], [2, 3.0]]
    assert body["series"][metadata.SHARE]["1"] == [[1, 0.0], [2, 0.5]]
    assert body["series"][metadata.EXAMPLES_PER_SECOND]["all"] == [[1, 64.0], [2, 64.0]]
    heat = data.heatmap(provider, ctx, "", run, None, downsample=500)
    assert heat == {
        "run": run,
        "replica": "all",
        "unit": "versions",
        "steps": [1, 2],
        "counts": [[3, 1], [1, 1, 0, 2]],
        "overflow": bins - 1,
    }
    assert metadata.LOST not in body["series"], "no replica was lost: no series"
    with pytest.raises(errors.NotFoundError, match="runs with staleness data"):
        data.run_series(provider, ctx, "", "elsewhere", downsample=10)
    with pytest.raises(errors.InvalidArgumentError, match="0 to 1"):
        data.heatmap(provider, ctx, "", run, 2, downsample=10)


def served_in_process(logdir: Path):
    """TensorBoard's data provider on `logdir`, loaded, and a request context."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider as multiplexer_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = multiplexer_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    return provider, context.RequestContext()


def write_run(run_dir: Path, histograms, step_histograms=None, info=None):
    """A batch-level run of 2 replicas, a point per histogram, in optimizer
    steps too where `step_histograms` are given (2 steps per point)."""
    from tf_diffmap.tensorboard_plugin.summary import StalenessSummaryWriter

    bins = len(histograms[0][0])
    aggregated = step_histograms is not None
    devices = ("/device:CPU:0", "/device:CPU:1")
    info = info or metadata.RunInfo(
        2, devices, bins, "batch", gradients_per_step=2 if aggregated else None
    )
    writer = StalenessSummaryWriter(run_dir, info, rules=False)
    for step, histogram in enumerate(histograms, start=1):
        histogram = np.array(histogram)
        in_steps = {}
        if aggregated:
            counts = np.array(step_histograms[step - 1])
            in_steps = dict(
                steps=2,
                step_histogram=counts,
                step_staleness_sum=(counts * np.arange(bins)).sum(axis=1),
                step_staleness_max=np.zeros(2, np.int64),
            )
        writer.write(
            step,
            tf_diffmap.StalenessStats(
                version=step * 4,
                updates=histogram.sum(axis=1),
                dropped=np.zeros(2, np.int64),
                staleness_sum=(histogram * np.arange(bins)).sum(axis=1),
                staleness_max=np.zeros(2, np.int64),
                histogram=histogram,
                examples=histogram.sum(axis=1) * 8,
                **in_steps,
            ),
            version=step * 4,
            seconds=0.5,
            optimizer_steps=2 * step if aggregated else None,
        )
    writer.close()


def test_both_units_are_served_where_the_store_aggregated(tmp_path):
    from tensorboard import errors

    from tf_diffmap.tensorboard_plugin import data

    histograms = [[[3, 1, 0, 0], [0, 0, 0, 0]], [[0, 0, 0, 2], [1, 1, 0, 0]]]
    in_steps = [[[4, 0, 0, 0], [0, 0, 0, 0]], [[0, 2, 0, 0], [2, 0, 0, 0]]]
    write_run(tmp_path / "run" / metadata.RUN_NAME, histograms, in_steps)
    provider, ctx = served_in_process(tmp_path)
    run = f"run/{metadata.RUN_NAME}"
    (listed,) = data.list_runs(provider, ctx, "")
    assert listed["gradients_per_step"] == 2
    body = data.run_series(provider, ctx, "", run, downsample=1000)
    assert body["series"][metadata.STEP_MEAN]["0"] == [[1, 0.0], [2, 1.0]]
    assert body["series"][metadata.STEP_MEAN]["all"] == [[1, 0.0], [2, 0.5]]
    assert body["series"][metadata.STEP_MAX]["all"] == [[1, 0.0], [2, 1.0]]
    assert body["series"][metadata.MEAN]["0"] == [[1, 0.25], [2, 3.0]]  # versions, as ever
    assert body["optimizer_steps"] == [[1, 2.0], [2, 4.0]]
    assert body["gradients_per_step"] == [[1, 2.0], [2, 2.0]]
    assert body["totals"]["step_staleness_sum"] == [2.0, 0.0]
    assert body["totals"]["step_staleness_max"] == [1.0, 0.0]
    heat = data.heatmap(provider, ctx, "", run, None, downsample=500, unit="steps")
    assert heat["unit"] == "steps" and heat["steps"] == [1, 2]
    assert heat["counts"] == [[4], [2, 2]]
    # Replica 1 had no update at step 1: no column there.
    one = data.heatmap(provider, ctx, "", run, 1, 500, "steps")
    assert one["steps"] == [2] and one["counts"] == [[2]]
    with pytest.raises(errors.InvalidArgumentError, match="unit must be one of 'versions'"):
        data.heatmap(provider, ctx, "", run, None, downsample=500, unit="seconds")


def test_a_run_written_before_the_step_unit_still_loads(tmp_path, monkeypatch):
    """A run as the callback wrote it before the staleness in optimizer
    steps: no step series, and a run description without
    `gradients_per_step`."""
    from tf_diffmap.tensorboard_plugin import data

    def old_description(info: metadata.RunInfo) -> bytes:
        payload = {
            "num_replicas": info.num_replicas,
            "devices": list(info.devices),
            "histogram_bins": info.histogram_bins,
            "step_unit": info.step_unit,
            "rule": info.rule,
            "format_version": 1,
        }
        return json.dumps(payload, sort_keys=True).encode("utf-8")

    monkeypatch.setattr(metadata.RunInfo, "to_bytes", old_description)
    write_run(tmp_path / "old" / metadata.RUN_NAME, [[[3, 1, 0, 0], [0, 2, 0, 0]]])
    monkeypatch.undo()
    provider, ctx = served_in_process(tmp_path)
    run = f"old/{metadata.RUN_NAME}"
    (listed,) = data.list_runs(provider, ctx, "")
    assert listed["num_replicas"] == 2 and listed["gradients_per_step"] is None
    body = data.run_series(provider, ctx, "", run, downsample=1000)
    assert body["optimizer_steps"] == [] and body["gradients_per_step"] == []
    assert metadata.STEP_MEAN not in body["series"]
    assert set(body["totals"]) == {*metadata.TOTALS_COLUMNS, "step", "wall_time"}
    assert body["series"][metadata.MEAN]["all"] == [[1, 0.5]]
    # The distribution in versions as before; in steps, none.
    assert data.heatmap(provider, ctx, "", run, None, 500)["counts"] == [[3, 3]]
    assert data.heatmap(provider, ctx, "", run, None, 500, "steps")["steps"] == []


def test_lost_replicas_are_a_series_of_their_own(tmp_path):
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider as multiplexer_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer

    from tf_diffmap.tensorboard_plugin import data

    write_lost_run(tmp_path / "lost")
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    provider = multiplexer_provider.MultiplexerDataProvider(multiplexer, str(tmp_path))
    body = data.run_series(provider, context.RequestContext(), "", "lost/staleness", 1000)
    lost = body["series"][metadata.LOST]
    for replica in range(4):
        expected = [float(v) for v in LOST_AT.get(replica, [False] * 4)]
        assert lost[str(replica)] == [[step, v] for step, v in zip(range(1, 5), expected)]
    assert lost[metadata.ALL] == [[1, 0.0], [2, 1.0], [3, 1.0], [4, 1.0]]
    # A cluster's layout has a chart of them in Custom Scalars.
    from tensorboard.plugins.custom_scalar import layout_pb2

    from tf_diffmap.tensorboard_plugin.summary import scalars_layout

    def titles(layout: layout_pb2.Layout) -> list[str]:
        return [chart.title for chart in layout.category[0].chart]

    assert any("lost" in t for t in titles(scalars_layout(rules=False, faults=True)))
    assert not any("lost" in t for t in titles(scalars_layout(rules=False)))
    # Drops without a rule (the strategy's step bound): their chart, no factor's.
    dropping = titles(scalars_layout(rules=False, dropping=True))
    assert "Dropped updates per replica" in dropping
    assert not any("learning-rate" in t for t in dropping)
    assert not any("Dropped" in t for t in titles(scalars_layout(rules=False)))


# -- the HTTP API ---------------------------------------------------------------


@in_tensorboard
def test_tab_is_listed_and_enabled(served):
    _, server = served
    listing = server.get_json("data/plugins_listing")["staleness"]
    assert listing["enabled"] is True
    assert listing["tab_name"] == "Staleness"
    assert listing["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": "/data/plugin/staleness/index.js",
    }


@in_tensorboard
def test_scalar_tags_per_replica_beside_keras(served):
    trained, server = served
    tags = server.get_json("data/plugin/scalars/tags")
    assert "train" in tags  # Keras' own TensorBoard, same log directory
    ours = set(tags[metadata.RUN_NAME])
    # A mean staleness for each replica that updated (on a busy host, some
    # of sixteen replicas may get none of the run's 96 shards), and overall.
    sixteen = trained.others["sixteen"]
    updated = [r for r in range(16) if sixteen.updates[r] + sixteen.dropped[r] > 0]
    assert len(updated) >= 2
    assert sorted(t for t in tags["sixteen/staleness"] if t.startswith(metadata.MEAN)) == sorted(
        [metadata.tag(metadata.MEAN, r) for r in updated] + [metadata.tag(metadata.MEAN, None)]
    )
    for series in (metadata.MEAN, metadata.MAX, metadata.UPDATES, metadata.EXAMPLES_PER_SECOND):
        for replica in [*range(REPLICAS), None]:
            assert metadata.tag(series, replica) in ours
    assert {metadata.tag(metadata.SHARE, r) for r in range(REPLICAS)} <= ours
    assert metadata.VERSION in ours
    histograms = server.get_json("data/plugin/histograms/tags")[metadata.RUN_NAME]
    assert metadata.tag(metadata.DISTRIBUTION, None) in histograms


@in_tensorboard
def test_custom_scalars_layout_puts_replicas_in_one_chart(served):
    _, server = served
    layout = server.get_json("data/plugin/custom_scalars/layout")
    (category,) = [c for c in layout["category"] if c["title"] == metadata.LAYOUT_CATEGORY]
    (regex,) = [
        chart["multiline"]["tag"][0]
        for chart in category["chart"]
        if chart["title"] == "Mean staleness per replica"
    ]
    query = urllib.parse.urlencode({"run": metadata.RUN_NAME, "tag": regex})
    chart = server.get_json(f"data/plugin/custom_scalars/scalars?{query}")
    assert chart["regex_valid"]
    assert sorted(chart["tag_to_events"]) == sorted(
        [metadata.tag(metadata.MEAN, r) for r in range(REPLICAS)]
        + [metadata.tag(metadata.MEAN, None)]
    )


@in_tensorboard
def test_runs_and_series_match_the_strategy(served):
    trained, server = served
    runs = {r["run"]: r for r in server.get_json("data/plugin/staleness/runs")["runs"]}
    assert set(runs) == {metadata.RUN_NAME, "one/staleness", "sixteen/staleness", "lost/staleness"}
    assert [runs[n]["num_replicas"] for n in ("one/staleness", "sixteen/staleness")] == [1, 16]
    run = runs[metadata.RUN_NAME]
    assert run["num_replicas"] == REPLICAS and run["step_unit"] == "batch"
    assert len(run["devices"]) == REPLICAS and run["last_step"] == trained.steps[-1]
    # The main run was written last: the tab opens on it.
    assert max(runs.values(), key=lambda r: r["last_wall_time"]) is run

    body = server.get_json(f"data/plugin/staleness/series?run={metadata.RUN_NAME}")
    stats = trained.statistics
    assert body["totals"]["updates"] == stats.updates.tolist()
    assert body["totals"]["staleness_sum"] == stats.staleness_sum.tolist()
    assert body["totals"]["step"] == trained.steps[-1]
    assert [step for step, _ in body["version"]] == trained.steps
    assert body["version"][-1][1] == stats.version
    updates = body["series"][metadata.UPDATES]
    for r in range(REPLICAS):
        assert sum(value for _, value in updates[str(r)]) == stats.updates[r]
    assert [step for step, _ in updates["all"]] == trained.steps
    assert set(body["series"]) >= {metadata.MEAN, metadata.MAX, metadata.SHARE}
    # No AsyncOptimizer rule in this run: no learning-rate factor, but the
    # default's bound on the staleness in steps may drop, and its drops are there.
    assert metadata.LR_SCALE not in body["series"]
    dropped = body["series"][metadata.DROPPED]
    for r in range(REPLICAS):
        assert sum(value for _, value in dropped[str(r)]) == stats.dropped[r]
    # Four replicas aggregate four gradients to an optimizer step: both units.
    assert stats.aggregated and run["gradients_per_step"] == REPLICAS
    assert body["totals"]["step_staleness_sum"] == stats.step_staleness_sum.tolist()
    # The tab's largest staleness is read from the distribution, where the
    # gradients the default's bound dropped count too (`interval_max_staleness`);
    # the strategy's `step_staleness_max` is of the accepted ones, no larger.
    step_histogram = np.asarray(stats.step_histogram)
    largest = [int(np.flatnonzero(row)[-1]) if row.any() else 0 for row in step_histogram]
    assert body["totals"]["step_staleness_max"] == largest
    assert (stats.step_staleness_max <= np.asarray(largest)).all()
    assert [step for step, _ in body["optimizer_steps"]] == trained.steps
    assert body["optimizer_steps"][-1][1] == stats.steps
    assert {metadata.STEP_MEAN, metadata.STEP_MAX} <= set(body["series"])
    # A point where the interval had pushes (applied or dropped): on a busy
    # host an interval of two batches can end before any of its shards lands
    # (one run beside the other slow tests had step 4 without).
    pushed = {s: v for s, v in updates["all"]}
    for r in range(REPLICAS):
        for s, v in dropped[str(r)]:
            pushed[s] = pushed.get(s, 0) + v
    with_pushes = [s for s in trained.steps if pushed.get(s, 0) > 0]
    assert len(with_pushes) > len(trained.steps) // 2, pushed
    assert [s for s, _ in body["series"][metadata.STEP_MEAN]["all"]] == with_pushes
    # One replica: each gradient is a step, and only versions are written.
    one = server.get_json("data/plugin/staleness/series?run=one/staleness")
    assert one["optimizer_steps"] == [] and metadata.STEP_MEAN not in one["series"]


@in_tensorboard
def test_heatmap_holds_every_staleness_count(served):
    trained, server = served
    heat = server.get_json(f"data/plugin/staleness/heatmap?run={metadata.RUN_NAME}&replica=all")
    assert heat["overflow"] == trained.statistics.histogram.shape[1] - 1
    assert heat["steps"] == sorted(heat["steps"]) and set(heat["steps"]) <= set(trained.steps)
    total = np.zeros(trained.statistics.histogram.shape[1])
    for column in heat["counts"]:
        total[: len(column)] += column
    np.testing.assert_array_equal(total, trained.statistics.histogram.sum(axis=0))
    one = server.get_json(f"data/plugin/staleness/heatmap?run={metadata.RUN_NAME}&replica=0")
    assert (
        one["replica"] == 0
        and sum(map(sum, one["counts"])) == trained.statistics.histogram[0].sum()
    )
    # In optimizer steps: the same updates, counted by the steps they missed.
    steps = server.get_json(
        f"data/plugin/staleness/heatmap?run={metadata.RUN_NAME}&replica=all&unit=steps"
    )
    assert steps["unit"] == "steps" and steps["steps"] == heat["steps"]
    total = np.zeros(trained.statistics.step_histogram.shape[1])
    for column in steps["counts"]:
        total[: len(column)] += column
    np.testing.assert_array_equal(total, trained.statistics.step_histogram.sum(axis=0))


@in_tensorboard
@pytest.mark.parametrize(
    "query, status, message",
    [
        ("series", 400, "needs a run"),
        ("series?run=nowhere", 404, "no staleness data in run 'nowhere'"),
        (f"heatmap?run={metadata.RUN_NAME}&replica=one", 400, "replica must be 'all'"),
        (f"heatmap?run={metadata.RUN_NAME}&replica={REPLICAS}", 400, "0 to 3"),
        (f"heatmap?run={metadata.RUN_NAME}&unit=seconds", 400, "unit must be one of"),
    ],
)
def test_bad_queries_say_what_was_wrong(served, query, status, message):
    _, server = served
    code, headers, body = server.get(f"data/plugin/staleness/{query}")
    assert code == status and message in body.decode()
    assert headers["X-Content-Type-Options"] == "nosniff"


@in_tensorboard
@pytest.mark.parametrize(
    "route, content_type",
    [
        ("runs", "application/json"),
        (f"series?run={metadata.RUN_NAME}", "application/json"),
        (f"heatmap?run={metadata.RUN_NAME}", "application/json"),
        (f"heatmap?run={metadata.RUN_NAME}&unit=steps", "application/json"),
        ("index.js", "text/javascript"),
        ("charts.js", "text/javascript"),
        ("style.css", "text/css"),
        ("index.html", "text/html"),
    ],
)
def test_every_route_is_served_with_nosniff(served, route, content_type):
    _, server = served
    status, headers, body = server.get(f"data/plugin/staleness/{route}")
    assert status == 200 and body
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Content-Type"].startswith(content_type)
    if content_type == "text/html":
        assert "script-src 'self'" in headers["Content-Security-Policy"]


def test_frontend_loads_nothing_from_the_network():
    static = REPO / "tf_diffmap" / "tensorboard_plugin" / "static"
    for name in _STATIC:
        text = (static / name).read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
        assert "@import" not in text and "cdn" not in text.lower(), name


@in_tensorboard
def test_a_server_that_does_not_start_in_time_is_stopped(tmp_path, monkeypatch):
    started = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(sys.modules[__name__], "STARTUP_SECONDS", 0.01)
    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with pytest.raises(RuntimeError, match="printed no URL|exited"):
        TensorBoardServer(tmp_path)
    assert started and started[0].poll() is not None
