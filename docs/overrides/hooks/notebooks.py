"""Puts the tutorial notebooks of `notebooks/` into the documentation site.

The notebooks live beside the code (where `notebooks/build_notebooks.py`
writes them and the tests run them), outside `docs/`. This hook adds each
one to the site's files as `notebooks/<name>.ipynb`, before mkdocs-jupyter
turns notebooks into pages, so the nav and the pages link to them as if
they were in `docs/notebooks/`. They are rendered as committed, without
outputs: `execute: false` in `mkdocs.yml`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

NOTEBOOK_DIR = "notebooks"


@event_priority(100)  # before mkdocs-jupyter's on_files, which picks the notebooks up
def on_files(files, config):
    # A file of the repository, found as a file of the docs would be: its
    # path under the repository's root is its path in the site.
    root = Path(config["config_file_path"]).parent
    for path in sorted((root / NOTEBOOK_DIR).glob("*.ipynb")):
        files.append(
            File(
                f"{NOTEBOOK_DIR}/{path.name}",
                src_dir=str(root),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
