"""The tutorial notebooks: committed clean, as generated, and running top to bottom.

Each notebook is executed in smoke mode (`TF_DIFFMAP_SMOKE=1`) with nbclient, in
a fresh kernel that runs this interpreter (`sys.executable`) and imports
tf_diffmap from this checkout, with a temporary working directory. Cells tagged
`colab-only` (the inline TensorBoard) are skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
GENERATOR = NOTEBOOK_DIR / "build_notebooks.py"
NOTEBOOKS = sorted(path.stem for path in NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ["quickstart", "staleness_in_tensorboard", "stragglers_and_policies"]

COLAB_ONLY = "colab-only"
SMOKE_ENV = "TF_DIFFMAP_SMOKE"
KERNEL_NAME = "tf-diffmap-notebook-tests"
CELL_TIMEOUT = 120  # seconds per cell; a whole notebook takes well under a minute
NOTEBOOK_TIMEOUT = 240  # seconds per notebook, kernel start included

# Magics that start or need a live front end; every cell using one must be tagged.
LIVE_ONLY = re.compile(r"^\s*%(load_ext\s+tensorboard|tensorboard)\b", re.MULTILINE)


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def load_generator():
    spec = importlib.util.spec_from_file_location("build_notebooks", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_notebooks_are_there():
    assert NOTEBOOKS == EXPECTED


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    dirty = [
        i
        for i, cell in enumerate(read(name).cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{name}.ipynb is committed with outputs or execution counts in cells {dirty}; "
        "clear them (python notebooks/build_notebooks.py rewrites the notebooks clean)."
    )


@pytest.mark.skipif(not GENERATOR.exists(), reason="no notebooks/build_notebooks.py")
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebooks_are_generated(name):
    generator = load_generator()
    committed = (NOTEBOOK_DIR / f"{name}.ipynb").read_text(encoding="utf-8")
    assert committed == generator.render(name), (
        f"{name}.ipynb differs from what notebooks/build_notebooks.py writes: edit the "
        "generator, not the notebook, and run python notebooks/build_notebooks.py."
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_conventions(name):
    cells = read(name).cells
    colab = f"colab.research.google.com/github/.+/notebooks/{name}.ipynb"
    assert cells[0].cell_type == "markdown" and re.search(colab, cells[0].source), (
        f"{name}.ipynb must open with an Open-in-Colab badge"
    )
    code = [cell for cell in cells if cell.cell_type == "code"]
    assert "TF_DIFFMAP_SOURCE" in code[0].source, "the first code cell installs tf_diffmap"
    assert any(SMOKE_ENV in cell.source for cell in code), f"no parameters read {SMOKE_ENV}"
    untagged = [
        cell.source
        for cell in code
        if LIVE_ONLY.search(cell.source) and COLAB_ONLY not in cell.metadata.get("tags", [])
    ]
    assert not untagged, f"cells that need a live front end must be tagged {COLAB_ONLY!r}"


def test_readme_links_every_notebook():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "## Notebooks" in readme
    if GENERATOR.exists():
        generator = load_generator()
        missing = [name for name in NOTEBOOKS if generator.colab_url(name) not in readme]
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
