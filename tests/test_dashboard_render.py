"""The Staleness tab rendered by headless Chromium from a real run.

Chromium loads the tab twice from the TensorBoard that
`test_tensorboard_plugin.shared_tensorboard` serves: as a page of its own
(`/data/plugin/staleness/index.html`, the same ES module TensorBoard loads),
whose DOM is checked for the charts; and inside TensorBoard itself
(`/#staleness`), as a screenshot. The documentation's screenshot is made the same way:

    python -m tests.test_dashboard_render docs/staleness_tab.png
"""

from __future__ import annotations

import decimal
import http.server
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.test_tensorboard_plugin import (
    REPLICAS,
    TensorBoardServer,
    shared_tensorboard,
    train_logs,
)
from tf_diffmap.tensorboard_plugin import metadata

# Chromium in a subprocess, against a TensorBoard server.
pytestmark = pytest.mark.slow

CHROMIUM_SECONDS = 120
WINDOW = (1400, 1000)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def run_chromium(url: str, *action: str, budget_ms: int = 10_000) -> subprocess.CompletedProcess:
    """Headless Chromium on `url`, with a fresh profile, offline but for `url`."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--virtual-time-budget={budget_ms}",
            *action,
            url,
        ]
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=CHROMIUM_SECONDS,
            stdin=subprocess.DEVNULL,
        )


def screenshot(url: str, png: Path) -> None:
    """Saves what Chromium shows at `url` as `png`."""
    png.parent.mkdir(parents=True, exist_ok=True)
    result = run_chromium(url, f"--screenshot={png}", budget_ms=15_000)
    if not png.exists():
        raise RuntimeError(f"Chromium wrote no screenshot:\n{result.stderr[-2000:]}")


def png_size(png: Path) -> tuple[int, int]:
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def make_screenshot(png: Path) -> None:
    """Trains a short run, serves it with TensorBoard, and screenshots the tab."""
    with tempfile.TemporaryDirectory(prefix="staleness-logs-") as logdir:
        trained = train_logs(Path(logdir), others=False)
        server = TensorBoardServer(trained.logdir)
        try:
            server.wait_for_data(metadata.RUN_NAME, trained.steps[-1])
            screenshot(server.url + "#staleness", png)
        finally:
            server.close()


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    if chromium() is None:
        pytest.skip(
            "Chromium is not installed (Debian: apt-get install chromium); "
            ".ci/run installs it so that CI renders the tab"
        )
    return shared_tensorboard(request, tmp_path_factory)


def test_tab_shows_the_charts_of_the_run(served):
    trained, server = served
    result = run_chromium(server.url + "data/plugin/staleness/index.html", "--dump-dom")
    dom = result.stdout
    assert 'id="staleness-app"' in dom, result.stderr[-2000:]
    assert 'class="message error"' not in dom and "Could not load" not in dom
    # Staleness over time: a line per replica and one for all of them.
    chart = re.search(r'<svg class="line-chart"[^>]*data-chart="over-time".*?</svg>', dom, re.S)
    assert chart, "no staleness chart"
    lines = re.findall(r'<path class="series"[^>]*data-key="([^"]+)"', chart.group(0))
    assert sorted(lines) == sorted([str(r) for r in range(REPLICAS)] + ["all"])
    # The heat map: a column per point, with shaded cells.
    heat = re.search(r'<canvas class="heatmap"[^>]*>', dom)
    assert heat, "no heat map"
    assert int(re.search(r'data-columns="(\d+)"', heat.group(0)).group(1)) > 1
    assert int(re.search(r'data-cells="(\d+)"', heat.group(0)).group(1)) > 1
    # The work share: a bar per replica, as long as its share of the updates.
    stats = trained.statistics
    widths = [float(w) for w in re.findall(r'class="bar-fill" style="width:([\d.]+)%', dom)]
    assert len(widths) == REPLICAS
    shares = stats.work_share
    for width, share in zip(widths, shares):
        assert width / max(widths) == pytest.approx(share / shares.max(), abs=1e-3)
    assert f"{_to_fixed(100 * shares[0], 1)}%" in dom
    assert f'<div class="value">{stats.version}</div>' in dom  # the store version card


@pytest.mark.parametrize("run, replicas", [("one/staleness", 1), ("sixteen/staleness", 16)])
def test_tab_reads_for_one_to_sixteen_replicas(served, run, replicas):
    _, server = served
    result = run_chromium(server.url + f"data/plugin/staleness/index.html?run={run}", "--dump-dom")
    dom = result.stdout
    assert f'<option value="{run}" selected="">' in dom, result.stderr[-2000:]
    chart = re.search(r'<svg class="line-chart"[^>]*data-chart="over-time".*?</svg>', dom, re.S)
    assert chart and 'class="message error"' not in dom
    lines = re.findall(r'<path class="series"[^>]*data-key="([^"]+)"', chart.group(0))
    assert len(lines) == replicas + 1
    assert len(re.findall(r'class="legend-item', dom)) == replicas + 1
    assert len(re.findall(r'class="bar-fill"', dom)) == replicas
    assert re.search(r'<canvas class="heatmap"[^>]*data-cells="[1-9]', dom)


def test_tab_names_the_replicas_lost(served):
    _, server = served
    run = "lost/staleness"
    result = run_chromium(server.url + f"data/plugin/staleness/index.html?run={run}", "--dump-dom")
    dom = result.stdout
    assert f'<option value="{run}" selected="">' in dom, result.stderr[-2000:]
    card = re.search(
        r'<div class="card warn"><div class="label">Replicas lost</div>'
        r'<div class="value">(\d+)</div><div class="detail"[^>]*>([^<]*)</div>',
        dom,
    )
    assert card, "no card of the lost replicas"
    assert card.group(1) == "1" and card.group(2).startswith("now: replica 2 ")
    legend = re.findall(r'<span class="swatch"[^>]*></span>([^<]*)<', dom)
    assert "replica 2 · lost" in legend and "replica 1" in legend
    assert '<option value="work/lost"' in dom  # the line chart offers the series


def unit_switch(dom: str) -> str | None:
    """The unit switch's element, or None where it is hidden."""
    found = re.search(r'<span class="unit-switch"([^>]*)>(.*?)</span>', dom, re.S)
    assert found, "no unit switch in the page"
    return None if re.search(r"\bhidden\b", found.group(1)) else found.group(2)


def pressed(switch: str) -> list[str]:
    return re.findall(r'<button[^>]*data-unit="(\w+)"[^>]*aria-pressed="true"', switch)


def check_drawn_in_steps(dom: str, trained) -> None:
    """The tab of the main run, drawn with the staleness in optimizer steps."""
    assert 'class="message error"' not in dom
    switch = unit_switch(dom)
    assert switch and pressed(switch) == ["steps"]
    chart = re.search(r'<svg class="line-chart"[^>]*data-chart="over-time".*?</svg>', dom, re.S)
    assert chart and 'aria-label="Mean staleness (optimizer steps)"' in chart.group(0)
    lines = re.findall(r'<path class="series"[^>]*data-key="([^"]+)"', chart.group(0))
    assert sorted(lines) == sorted([str(r) for r in range(REPLICAS)] + ["all"])
    assert re.search(r'<canvas class="heatmap"[^>]*data-unit="optimizer steps"', dom)
    stats = trained.statistics
    steps_card = re.search(
        r'<div class="label">Optimizer steps</div><div class="value">(\d+)</div>', dom
    )
    assert steps_card and int(steps_card.group(1)) == stats.steps
    mean = re.search(
        r'<div class="label">Mean staleness</div><div class="value">([\d.]+)'
        r'<span class="unit">optimizer steps</span>',
        dom,
    )
    assert mean and mean.group(1) == _to_fixed(stats.overall_mean_step_staleness, 2)


def test_tab_shows_the_staleness_in_optimizer_steps(served):
    trained, server = served
    page = server.url + "data/plugin/staleness/index.html"
    # By default in versions, with the switch offered: the run aggregated.
    dom = run_chromium(page, "--dump-dom").stdout
    switch = unit_switch(dom)
    assert switch and pressed(switch) == ["versions"]
    assert 'aria-label="Mean staleness (versions)"' in dom
    assert not re.search(r'<canvas class="heatmap"[^>]*data-unit="optimizer', dom)
    # The page can be opened in steps.
    result = run_chromium(page + "?unit=steps", "--dump-dom")
    assert 'id="staleness-app"' in result.stdout, result.stderr[-2000:]
    check_drawn_in_steps(result.stdout, trained)


# A page that renders the tab and clicks the switch to optimizer steps,
# served beside the plugin's own files (`ClickingProxy`).
_CLICK_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8" />
<link rel="stylesheet" href="style.css" data-staleness-style /></head>
<body><script type="module">
import { render } from "./index.js";
await render();
document.querySelector('.unit-switch button[data-unit="steps"]').click();
</script></body></html>
"""


class ClickingProxy:
    """Serves `_CLICK_PAGE` at `/click.html`, and everything else from the
    plugin's routes of `server`, on a port of its own on 127.0.0.1."""

    def __init__(self, server):
        upstream = server.url + "data/plugin/staleness/"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the standard library's name
                if self.path == "/click.html":
                    status, kind, body = 200, "text/html", _CLICK_PAGE
                else:
                    try:
                        with urllib.request.urlopen(upstream + self.path.lstrip("/")) as response:
                            status, body = response.status, response.read()
                            kind = response.headers["Content-Type"]
                    except urllib.error.HTTPError as error:
                        status, kind, body = error.code, "text/plain", error.read()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def test_the_unit_switch_redraws_the_tab_in_optimizer_steps(served):
    trained, server = served
    proxy = ClickingProxy(server)
    try:
        result = run_chromium(proxy.url + "click.html", "--dump-dom")
    finally:
        proxy.close()
    assert 'id="staleness-app"' in result.stdout, result.stderr[-2000:]
    check_drawn_in_steps(result.stdout, trained)


@pytest.mark.parametrize("run", ["one/staleness", "lost/staleness"])
def test_a_run_without_optimizer_steps_shows_versions(served, run):
    # One replica (every gradient a step), and a run written as before the
    # step unit existed: no switch, whatever the page asks for.
    _, server = served
    page = server.url + f"data/plugin/staleness/index.html?run={run}&unit=steps"
    dom = run_chromium(page, "--dump-dom").stdout
    assert f'<option value="{run}" selected="">' in dom and 'class="message error"' not in dom
    assert unit_switch(dom) is None
    assert "optimizer steps" not in dom.split('<main class="content">')[1]
    assert re.search(r'<canvas class="heatmap"[^>]*data-cells="[1-9]', dom)


def test_tab_inside_tensorboard_screenshot(served, tmp_path):
    _, server = served
    png = tmp_path / "staleness_tab.png"
    screenshot(server.url + "#staleness", png)
    assert png_size(png) == WINDOW
    # A blank or error page compresses to a few kilobytes; charts do not.
    assert png.stat().st_size > 60_000


if __name__ == "__main__":
    from tests import conftest  # noqa: F401  (four logical CPU devices)

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/staleness_tab.png")
    make_screenshot(out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def _to_fixed(value: float, digits: int) -> str:
    """`value` as JavaScript's `toFixed(digits)` writes it: the float's exact
    value rounded half up (Python's formatting rounds a tie such as 6.25 to
    even, "6.2", where the page shows "6.3")."""
    exact = decimal.Decimal(float(value))
    return str(exact.quantize(decimal.Decimal(1).scaleb(-digits), decimal.ROUND_HALF_UP))
