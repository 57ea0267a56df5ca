"""The documentation site's internal links and anchors.

`docs/overrides/hooks/links.py` checks every HTML page of a built site and
makes `mkdocs build --strict` (CI's docs build) fail on a broken internal
link or `#anchor`. Here it is checked on small sites made for the test, and
on the real site where mkdocs is installed (`pip install -e ".[docs]"`).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "overrides" / "hooks" / "links.py"


def _load_hook():
    spec = importlib.util.spec_from_file_location("docs_links_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


links = _load_hook()


def write(site: Path, path: str, body: str) -> None:
    target = site / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"<html><body>{body}</body></html>", encoding="utf-8")


@pytest.fixture
def site(tmp_path):
    write(
        tmp_path,
        "index.html",
        '<h2 id="install">Install</h2>'
        '<a href="getting-started/">page</a>'
        '<a href="getting-started/#first-model">anchor</a>'
        '<a href="#install">own anchor</a>'
        '<a href="https://example.org/x#y">external</a>'
        '<a href="mailto:someone@example.org">mail</a>'
        '<link href="assets/style.css" rel="stylesheet">',
    )
    write(tmp_path, "getting-started/index.html", '<h2 id="first-model">First</h2>')
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "style.css").write_text("", encoding="utf-8")
    return tmp_path


def test_a_site_whose_links_all_resolve_has_no_problem(site):
    assert links.broken_links(site) == []


def test_a_missing_anchor_is_reported_with_the_page_and_the_id(site):
    write(site, "notebooks/quickstart/index.html", '<a href="#train-with">toc</a><h2 id="x">x</h2>')
    assert links.broken_links(site) == [
        "notebooks/quickstart/index.html: #train-with "
        "(no id 'train-with' in notebooks/quickstart/index.html)"
    ]


def test_a_missing_page_and_an_anchor_on_another_page_are_reported(site):
    write(
        site,
        "strategy/index.html",
        '<a href="../missing/">gone</a><a href="../getting-started/#second-model">anchor</a>',
    )
    problems = links.broken_links(site)
    assert len(problems) == 2
    assert "strategy/index.html: ../missing/ (no file missing/index.html)" in problems
    assert any("no id 'second-model' in getting-started/index.html" in p for p in problems)


def test_a_percent_encoded_anchor_is_decoded(site):
    write(
        site,
        "api/index.html",
        '<h2 id="tf_diffmap.Strategy">S</h2><a href="#tf_diffmap%2EStrategy">s</a>',
    )
    assert links.broken_links(site) == []


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason='mkdocs is not installed (".[docs]")'
)
def test_the_built_site_has_no_broken_internal_link_or_anchor(tmp_path):
    # The hook runs inside the build and fails it under --strict; the site is
    # checked here again so that a failure names every broken link.
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert links.broken_links(tmp_path / "site") == []
