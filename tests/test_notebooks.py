"""The tutorial notebooks: kept as code, committed clean, and running top to bottom.

Each notebook is a jupytext pair: `notebooks/<name>.py` (percent format, linted
by ruff) and `notebooks/<name>.ipynb` (committed without outputs), with the same
cells. After editing either, `jupytext --sync notebooks/<name>.py` updates the
other.

Each notebook is executed in smoke mode (`TF_DIFFMAP_SMOKE=1`) with nbclient, in
a fresh kernel that runs this interpreter (`sys.executable`) and imports
tf_diffmap from this checkout, with a temporary working directory. Cells tagged
`colab-only` (the inline TensorBoard) are skipped.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(path.stem for path in NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ["quickstart", "staleness_in_tensorboard", "stragglers_and_policies"]
PAIRING = "ipynb,py:percent"  # jupytext's `formats` of every pair

# Where the repository lives on GitHub, and the branch the Colab badges open: the
# badges (in the notebooks and the README), the links between notebooks and the
# install cell must all point here.
GITHUB_REPO = "tf-diffmap/tf_diffmap"
GITHUB_BRANCH = "main"
TF_DIFFMAP_SOURCE = f"git+https://github.com/{GITHUB_REPO}"

COLAB_ONLY = "colab-only"
SMOKE_ENV = "TF_DIFFMAP_SMOKE"
KERNEL_NAME = "tf-diffmap-notebook-tests"
CELL_TIMEOUT = 120  # seconds per cell; a whole notebook takes well under a minute
NOTEBOOK_TIMEOUT = 240  # seconds per notebook, kernel start included

# Magics that start or need a live front end; every cell using one must be tagged.
LIVE_ONLY = re.compile(r"^\s*%(load_ext\s+tensorboard|tensorboard)\b", re.MULTILINE)
COLAB_LINK = re.compile(r"colab\.research\.google\.com/github/([^)\s\"]+)")
GITHUB_ADDRESS = re.compile(r"(?<![\w.])github\.com/([\w.-]+/[\w.-]+)")


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def read_source(name: str) -> nbformat.NotebookNode:
    """The notebook as jupytext reads it from `notebooks/<name>.py`."""
    return jupytext.read(NOTEBOOK_DIR / f"{name}.py", fmt="py:percent")


def cell_contents(notebook: nbformat.NotebookNode) -> list[tuple[str, str, list[str]]]:
    """What a pair must agree on: each cell's type, source and tags."""
    return [
        (cell.cell_type, cell.source, list(cell.metadata.get("tags", [])))
        for cell in notebook.cells
    ]


def colab_url(name: str) -> str:
    """The URL that opens notebook `name` (without `.ipynb`) in Colab."""
    return (
        f"https://colab.research.google.com/github/{GITHUB_REPO}/blob/{GITHUB_BRANCH}"
        f"/notebooks/{name}.ipynb"
    )


def test_the_notebooks_are_there():
    assert NOTEBOOKS == EXPECTED
    sources = sorted(path.stem for path in NOTEBOOK_DIR.glob("*.py"))
    assert sources == NOTEBOOKS, "each notebooks/<name>.ipynb has its notebooks/<name>.py"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_pair_agrees(name):
    notebook, source = read(name), read_source(name)
    resync = f"jupytext --sync notebooks/{name}.py"
    for paired in (notebook, source):
        formats = paired.metadata.get("jupytext", {}).get("formats")
        assert formats == PAIRING, (
            f"{name}: jupytext formats {formats!r}, not {PAIRING!r}; run "
            f"jupytext --set-formats {PAIRING} notebooks/{name}.ipynb"
        )
    committed, written = cell_contents(notebook), cell_contents(source)
    differ = [i for i, (a, b) in enumerate(zip(committed, written)) if a != b]
    assert len(committed) == len(written) and not differ, (
        f"notebooks/{name}.py and notebooks/{name}.ipynb disagree ({len(written)} and "
        f"{len(committed)} cells; cells that differ: {differ}). After editing either, run "
        f"{resync} (it updates the older of the two from the newer)."
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    dirty = [
        i
        for i, cell in enumerate(read(name).cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{name}.ipynb is committed with outputs or execution counts in cells {dirty}; "
        f"clear them (jupyter nbconvert --clear-output --inplace notebooks/{name}.ipynb)."
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_conventions(name):
    cells = read(name).cells
    assert cells[0].cell_type == "markdown" and colab_url(name) in cells[0].source, (
        f"{name}.ipynb must open with an Open-in-Colab badge to {colab_url(name)}"
    )
    code = [cell for cell in cells if cell.cell_type == "code"]
    install = f'TF_DIFFMAP_SOURCE = "{TF_DIFFMAP_SOURCE}"'
    assert install in code[0].source, f"the first code cell installs tf_diffmap ({install})"
    assert any(SMOKE_ENV in cell.source for cell in code), f"no parameters read {SMOKE_ENV}"
    untagged = [
        cell.source
        for cell in code
        if LIVE_ONLY.search(cell.source) and COLAB_ONLY not in cell.metadata.get("tags", [])
    ]
    assert not untagged, f"cells that need a live front end must be tagged {COLAB_ONLY!r}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_links_point_to_the_repository(name):
    text = "\n".join(cell.source for cell in read(name).cells)
    expected = {colab_url(other).split("github/", 1)[1] for other in NOTEBOOKS}
    wrong = [link for link in COLAB_LINK.findall(text) if link not in expected]
    wrong += [repo for repo in GITHUB_ADDRESS.findall(text) if repo != GITHUB_REPO]
    assert not wrong, f"{name}.ipynb links elsewhere than {GITHUB_REPO} ({GITHUB_BRANCH}): {wrong}"


def test_readme_links_every_notebook():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "## Notebooks" in readme
    missing = [name for name in NOTEBOOKS if colab_url(name) not in readme]
    assert not missing, f"README.md has no Colab badge for {missing}"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> str:
    """A kernelspec for this interpreter, importing tf_diffmap from this checkout."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL_NAME
    spec.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tf_diffmap notebook tests",
        "language": "python",
        "env": {SMOKE_ENV: "1", "PYTHONPATH": pythonpath, "TF_CPP_MIN_LOG_LEVEL": "2"},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel), encoding="utf-8")
    return str(root)


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_smoke_mode(name, kernel_dir, tmp_path):
    notebook = read(name)
    notebook.cells = [
        cell for cell in notebook.cells if COLAB_ONLY not in cell.metadata.get("tags", [])
    ]
    # Which tf_diffmap the kernel imported, to check that it is this checkout's.
    notebook.cells.append(
        nbformat.v4.new_code_cell("import tf_diffmap\nprint(tf_diffmap.__file__)")
    )
    kernel_manager = AsyncKernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir], ensure_native_kernel=False),
    )
    client = NotebookClient(
        notebook,
        km=kernel_manager,
        timeout=CELL_TIMEOUT,
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    client.execute(cleanup_kc=True)  # a kernel manager passed in is not shut down otherwise
    print(f"{name}: {time.perf_counter() - start:.1f} s in smoke mode")

    imported = "".join(output.get("text", "") for output in notebook.cells[-1].outputs).strip()
    assert Path(imported).resolve().is_relative_to(REPO / "tf_diffmap"), imported
