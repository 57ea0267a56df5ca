"""The fenced code blocks of the README and of the documentation pages.

A page's Python blocks are run by the tests (tests/test_docs_examples.py),
each on its own, unless the line just before the block's fence is a
comment that says why it cannot run alone:

    <!-- not run: a fragment; build_model is the reader's -->

The comment shows neither on GitHub nor on the site. A block that is run
and followed by a paragraph beginning "It prints `...`" must print that as
its last line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<why>.+?)\s*-->$")
PRINTS = re.compile(r"^It prints `(?P<output>[^`]+)`")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)")


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # why it is not run, from the comment before it
    prints: str | None = None  # its last line of output, as the text after it says

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of `page`, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent = len(match["indent"])
        start = i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        previous = lines[start - 1].strip() if start else ""
        marker = NOT_RUN.match(previous)
        i += 1
        after = i
        while after < len(lines) and not lines[after].strip():
            after += 1
        prints = PRINTS.match(lines[after]) if after < len(lines) else None
        found.append(
            Block(
                page,
                start + 1,
                match["lang"],
                "\n".join(body) + "\n",
                marker and marker["why"],
                prints and prints["output"],
            )
        )
    return found


def python_blocks() -> list[Block]:
    """Every Python block of the README and the pages."""
    return [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def readme_quick_start() -> str:
    """The README's quick start: its one Python block."""
    (block,) = [b for b in blocks(ROOT / "README.md") if b.lang == "python"]
    return block.code


STATISTICS_START = "store version "


def statistics_samples() -> list[Block]:
    """The blocks that show what `print(strategy.statistics())` prints."""
    return [b for page in PAGES for b in blocks(page) if b.code.startswith(STATISTICS_START)]


NUMBER = re.compile(r"\d[\d,]*(\.\d+)?")


def shape(line: str) -> str:
    """`line` with each number replaced by `#`: the format, not the figures."""
    return NUMBER.sub("#", line.rstrip())
