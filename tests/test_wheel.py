"""The wheel: it builds, installs into a fresh virtual environment with the
Staleness tab's files and entry point, and runs the README's quick start.

The package is not on the package index; a wheel that `python -m build`
makes is how it reaches a host without a clone (docs/getting-started.md).
The build runs on a copy of the files git tracks, so that nothing left in
the working tree (build/, *.egg-info/) goes into the wheel or is changed.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from docs_blocks import ROOT, readme_quick_start, shape

pytestmark = pytest.mark.slow

STATIC_FILES = {"index.html", "index.js", "charts.js", "style.css"}
ENTRY_POINT = "staleness = tf_diffmap.tensorboard_plugin.plugin:StalenessPlugin"


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} exited {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    tracked = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist)], cwd=source, timeout=600)
    (built,) = dist.glob("*.whl")
    return built


def test_the_wheel_holds_the_staleness_tab(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_text = archive.read(entry_points).decode()
    static = {Path(n).name for n in names if n.startswith("tf_diffmap/tensorboard_plugin/static/")}
    assert static == STATIC_FILES
    assert "[tensorboard_plugins]" in entry_text and ENTRY_POINT in entry_text
    assert not any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in names)


# Run in the fresh environment, from a folder outside the clone: the package
# it imports is the wheel's, its entry point loads, its files are there.
CHECK_INSTALL = textwrap.dedent(
    """
    import importlib.metadata, importlib.resources, sys
    import tf_diffmap
    assert tf_diffmap.__file__.startswith(sys.prefix), tf_diffmap.__file__
    (entry,) = [e for e in importlib.metadata.entry_points(group="tensorboard_plugins")
                if e.name == "staleness"]
    plugin = entry.load()
    static = importlib.resources.files("tf_diffmap.tensorboard_plugin") / "static"
    print(plugin.__name__, sorted(p.name for p in static.iterdir()))
    """
)


def test_the_wheel_installs_and_runs_the_quick_start(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # scikit-learn for the quick start's data, as the `examples` extra brings it.
    _run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[cpu,examples]"], timeout=1200)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("PYTHONPATH", None)
    installed = _run([str(python), "-c", CHECK_INSTALL], cwd=work, env=env, timeout=300)
    assert installed.stdout.split()[0] == "StalenessPlugin"
    for name in STATIC_FILES:
        assert name in installed.stdout

    # The README's quick start as written, with one epoch instead of ten.
    code = readme_quick_start()
    assert "epochs=10" in code
    (work / "quick_start.py").write_text(code.replace("epochs=10", "epochs=1"), encoding="utf-8")
    ran = _run([str(python), "quick_start.py"], cwd=work, env=env, timeout=600)
    lines = ran.stdout.splitlines()
    header = [line for line in lines if line.startswith("store version ")]
    assert len(header) == 1, ran.stdout[-3000:]
    assert shape(header[0]) == (
        "store version # # optimizer steps (# gradients each); mean staleness # versions "
        "(max #), # steps (max #); momentum added by asynchrony #"
    )
    assert sum(line.startswith("  replica ") for line in lines) == 4
