"""Fails the site's build on a broken internal link or anchor.

mkdocs' own `validation` checks the links written in the Markdown pages. It
does not see what is made later: the notebook pages, whose table of
contents mkdocs-jupyter writes from the notebooks' headings, and the API
reference. This hook reads every HTML page of the built site and checks
that each internal `href` names a file of the site and, when it has a
`#fragment`, an element of that file with this `id` (or `name`). Each
broken one is logged as a warning, so that `mkdocs build --strict` fails.

`broken_links(site_dir)` is plain Python with no mkdocs import:
tests/test_docs_links.py runs it on small trees and on a built site.
"""

from __future__ import annotations

import logging
import posixpath
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

log = logging.getLogger("mkdocs.hooks.links")

# Links that leave the site, or are not addresses at all.
_EXTERNAL_SCHEMES = ("http", "https", "mailto", "javascript", "data", "ftp", "tel")


class _Page(HTMLParser):
    """The ids and the `href`s of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            elif name == "href" and tag in ("a", "link", "area"):
                self.hrefs.append(value)


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _target(site: Path, page: Path, path: str) -> Path:
    """The file of the site that `path` (a link's path, relative to `page`
    unless it starts with `/`) names: a directory's `index.html`."""
    if path.startswith("/"):
        joined = posixpath.normpath(path.lstrip("/"))
    else:
        base = page.parent.relative_to(site).as_posix()
        joined = posixpath.normpath(posixpath.join(base, path))
    target = site / joined
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


def broken_links(site_dir: str | Path) -> list[str]:
    """Every internal link of the HTML pages under `site_dir` that is broken.

    Args:
        site_dir: a built site (`mkdocs build --site-dir DIR`).

    Returns:
        One line per broken link, `page: href (what is wrong)`, sorted.
    """
    site = Path(site_dir).resolve()
    pages = {path: _read(path) for path in sorted(site.rglob("*.html"))}
    problems = []
    for path, page in pages.items():
        where = path.relative_to(site).as_posix()
        for href in page.hrefs:
            parts = urlsplit(href)
            if parts.scheme in _EXTERNAL_SCHEMES or parts.netloc or href.startswith("//"):
                continue
            if parts.scheme:
                problems.append(f"{where}: {href} (unknown scheme {parts.scheme!r})")
                continue
            fragment = unquote(parts.fragment)
            if parts.path:
                target = _target(site, path, unquote(parts.path))
                if not target.is_file():
                    problems.append(f"{where}: {href} (no file {target.relative_to(site)})")
                    continue
            else:
                target = path
            if not fragment or target.suffix != ".html":
                continue
            if target not in pages:
                pages[target] = _read(target)
            if fragment not in pages[target].ids:
                shown = target.relative_to(site).as_posix()
                problems.append(f"{where}: {href} (no id {fragment!r} in {shown})")
    return sorted(set(problems))


def on_post_build(config, **kwargs):
    for problem in broken_links(config["site_dir"]):
        log.warning("Broken internal link: %s", problem)
