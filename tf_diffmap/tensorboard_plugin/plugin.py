"""The "Staleness" tab of TensorBoard.

TensorBoard finds `StalenessPlugin` through the `tensorboard_plugins` entry
point that tf_diffmap installs. The tab is an ES module (`static/index.js`)
that TensorBoard loads in an iframe; it draws with SVG and canvas, loads
nothing from the network, and reads these JSON routes under
`/data/plugin/staleness/`:

- `runs`: the runs with staleness data, with their replicas and devices;
- `series?run=R`: every scalar series of run R per replica, and its totals;
- `heatmap?run=R&replica=all|i&unit=versions|steps`: the staleness
  distribution over steps, in versions (the default) or optimizer steps.

`index.html` serves the tab as a page of its own (the same module), for a
browser pointed straight at it. Every response goes through TensorBoard's
`http_util.Respond`, which sets `X-Content-Type-Options: nosniff` (and a
Content-Security-Policy on HTML).
"""

from __future__ import annotations

import importlib.resources

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from werkzeug import wrappers

from tf_diffmap.tensorboard_plugin import data, metadata

__all__ = ["StalenessPlugin"]

# Points per series when TensorBoard's --samples_per_plugin says nothing:
# what the scalars and histograms dashboards keep by default.
_DEFAULT_SCALAR_POINTS = 1000
_DEFAULT_HISTOGRAM_POINTS = 500

_STATIC = {
    "index.js": "text/javascript",
    "charts.js": "text/javascript",
    "style.css": "text/css",
    "index.html": "text/html",
}


def _static_file(name: str) -> str:
    return (importlib.resources.files(__package__) / "static" / name).read_text("utf-8")


class StalenessPlugin(base_plugin.TBPlugin):
    """Serves the Staleness tab and the data it draws.

    Args:
        context: the `base_plugin.TBContext` TensorBoard passes to plugins.
    """

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._data_provider = context.data_provider
        hints = context.sampling_hints or {}
        self._scalar_points = hints.get(scalar_metadata.PLUGIN_NAME, _DEFAULT_SCALAR_POINTS)
        self._histogram_points = hints.get(
            histogram_metadata.PLUGIN_NAME, _DEFAULT_HISTOGRAM_POINTS
        )

    def get_plugin_apps(self) -> dict:
        apps = {
            "/runs": self._serve_runs,
            "/series": self._serve_series,
            "/heatmap": self._serve_heatmap,
        }
        for name in _STATIC:
            apps["/" + name] = self._static_app(name)
        return apps

    def is_active(self) -> bool:
        # TensorBoard's `list_plugins` sees the plugin's own tensor
        # (`staleness/totals`) in any run the callback wrote to.
        return False

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Staleness")

    # -- routes ---------------------------------------------------------------

    def _provider(self):
        if self._data_provider is None:
            raise errors.NotFoundError(
                "TensorBoard started without a data provider; start it with --logdir"
            )
        return self._data_provider

    @staticmethod
    def _run(request) -> str:
        run = request.args.get("run")
        if not run:
            raise errors.InvalidArgumentError("the query needs a run, e.g. ?run=staleness")
        return run

    @wrappers.Request.application
    def _serve_runs(self, request):
        runs = data.list_runs(
            self._provider(),
            plugin_util.context(request.environ),
            plugin_util.experiment_id(request.environ),
        )
        return http_util.Respond(request, {"runs": runs}, "application/json")

    @wrappers.Request.application
    def _serve_series(self, request):
        body = data.run_series(
            self._provider(),
            plugin_util.context(request.environ),
            plugin_util.experiment_id(request.environ),
            self._run(request),
            downsample=self._scalar_points,
        )
        return http_util.Respond(request, body, "application/json")

    @wrappers.Request.application
    def _serve_heatmap(self, request):
        text = request.args.get("replica", metadata.ALL)
        if text == metadata.ALL:
            replica = None
        elif text.isascii() and text.isdigit():
            replica = int(text)
        else:
            raise errors.InvalidArgumentError(
                f"replica must be 'all' or a replica id such as 0, received {text!r}"
            )
        body = data.heatmap(
            self._provider(),
            plugin_util.context(request.environ),
            plugin_util.experiment_id(request.environ),
            self._run(request),
            replica,
            downsample=self._histogram_points,
            unit=request.args.get("unit", "versions"),
        )
        return http_util.Respond(request, body, "application/json")

    def _static_app(self, name: str):
        content_type = _STATIC[name]

        @wrappers.Request.application
        def serve(request):
            return http_util.Respond(request, _static_file(name), content_type)

        return serve
