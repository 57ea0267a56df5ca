"""The edits that turn an example's source into a run: listed, located, and checked.

An example is run as written, except for a short list of edits, each with
its reason and its kind:

- ``"data"``: the statements that download or load a data set are replaced
  by a call that makes synthetic data of the same shapes and types;
- ``"shorten"``: a count (epochs, repetitions, rows) is cut so that a run
  fits a few minutes on a 2-core host;
- ``"scope"``: statements that build the model and compile it are put in
  ``with __contender_scope__():``, the one edit every strategy needs. Under
  plain Keras the scope is a `contextlib.nullcontext`.

Edits name the statements they touch by an *anchor*, a piece of text that
must occur in exactly one innermost statement of the source (found with
`ast`, so that a statement that spans lines is taken whole). An anchor that
matches nothing, or more than one statement, raises a `ValueError`: a
changed example fails loudly instead of running unedited. Nothing here
imports TensorFlow.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Sequence

__all__ = ["Edit", "apply_edits", "locate", "SCOPE_NAME"]

SCOPE_NAME = "__contender_scope__"
KINDS = ("data", "shorten", "scope")


@dataclasses.dataclass(frozen=True)
class Edit:
    """One edit of an example's source.

    Attributes:
        kind: ``"data"``, ``"shorten"`` or ``"scope"``.
        anchor: text found in exactly one innermost statement: the first
            statement the edit touches.
        why: one line for the report.
        through: text of the last statement the edit touches, at or after
            the first in the same block; None for the first statement alone.
        new: for ``"data"`` and ``"shorten"``: the code that replaces the
            statements (re-indented to theirs), or, with `old`, the text
            that replaces `old` inside them. Unused for ``"scope"``.
        old: for a replacement inside the statements: the text replaced,
            which must occur there exactly once.
    """

    kind: str
    anchor: str
    why: str
    through: str | None = None
    new: str = ""
    old: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Edit kind must be one of {KINDS}, received {self.kind!r}.")
        if self.kind != "scope" and not self.new and self.old is None:
            raise ValueError(f"A {self.kind!r} edit needs `new` code, anchor {self.anchor!r}.")


def _statements(tree: ast.AST) -> list[tuple[ast.stmt, list[ast.stmt]]]:
    """Every statement of the tree, with the block (list) that holds it."""
    found = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                found.extend((s, block) for s in block if isinstance(s, ast.stmt))
    return found


def _text(lines: Sequence[str], stmt: ast.stmt) -> str:
    return "".join(lines[stmt.lineno - 1 : stmt.end_lineno])


def locate(source: str, anchor: str, through: str | None = None) -> tuple[int, int, int]:
    """The lines an anchor names: ``(first, last, indent)``.

    ``first`` and ``last`` are 0-based line indices, inclusive, of the
    innermost statement whose text holds `anchor` (through the statement
    holding `through`, in the same block), and ``indent`` that statement's
    column.

    Raises:
        ValueError: if `anchor` or `through` names no statement, or more than one.
    """
    lines = source.splitlines(keepends=True)
    statements = _statements(ast.parse(source))
    holding = [(s, block) for s, block in statements if anchor in _text(lines, s)]
    # Innermost: a statement none of whose inner statements holds the anchor.
    innermost = [
        (s, block)
        for s, block in holding
        if not any(
            o is not s and s.lineno <= o.lineno and o.end_lineno <= s.end_lineno for o, _ in holding
        )
    ]
    if len(innermost) != 1:
        raise ValueError(
            f"The anchor {anchor!r} names {len(innermost)} statements of the source; "
            "it must name exactly one: the example changed, update its edits."
        )
    first, block = innermost[0]
    last = first
    if through is not None:
        after = block[block.index(first) :]
        ends = [s for s in after if through in _text(lines, s)]
        if not ends:
            raise ValueError(
                f"No statement from {anchor!r} on, in its block, holds {through!r}: "
                "the example changed, update its edits."
            )
        last = ends[0]
    start = first.lineno - 1
    # Decorators belong to the statement they decorate.
    decorators = getattr(first, "decorator_list", None)
    if decorators:
        start = min(d.lineno for d in decorators) - 1
    return start, last.end_lineno - 1, first.col_offset


def _indent(code: str, indent: int) -> list[str]:
    pad = " " * indent
    return [(pad + line if line.strip() else line) + "\n" for line in code.splitlines()]


def apply_edits(source: str, edits: Sequence[Edit]) -> str:
    """The source with every edit applied.

    An edit with `old` replaces it inside one line of its statements (and
    may sit inside a scope); an edit without replaces its statements whole,
    and must not overlap another such edit; a ``"scope"`` edit indents its
    statements under ``with __contender_scope__():``.

    Raises:
        ValueError: if an anchor names no statement or several, if an `old`
            text is not on exactly one line of its statements, once, or if
            two replacing edits overlap.
    """
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    located = [(edit, *locate(source, edit.anchor, edit.through)) for edit in edits]
    # Per original line: what it becomes (a list of lines).
    out: list[list[str]] = [[line] for line in lines]
    for edit, first, last, _ in located:
        if edit.kind == "scope" or edit.old is None:
            continue
        hits = [i for i in range(first, last + 1) if edit.old in lines[i]]
        if len(hits) != 1 or lines[hits[0]].count(edit.old) != 1:
            raise ValueError(
                f"{edit.old!r} must occur once, on one line, in the statements at "
                f"{edit.anchor!r}; found on {len(hits)} lines."
            )
        out[hits[0]] = [lines[hits[0]].replace(edit.old, edit.new)]
    whole = sorted(
        (x for x in located if x[0].kind != "scope" and x[0].old is None), key=lambda x: x[1]
    )
    for (a, _, a_last, _), (b, b_first, _, _) in zip(whole, whole[1:]):
        if b_first <= a_last:
            raise ValueError(f"The edits at {a.anchor!r} and {b.anchor!r} overlap.")
    for edit, first, last, indent in whole:
        out[first] = _indent(edit.new, indent)
        for i in range(first + 1, last + 1):
            out[i] = []
    # Each scope that encloses a line indents it by 4 more columns.
    depth = [0] * len(lines)
    openers: dict[int, list[str]] = {}
    for edit, first, last, indent in located:
        if edit.kind != "scope":
            continue
        for i in range(first, last + 1):
            depth[i] += 1
        openers.setdefault(first, []).append(" " * indent + f"with {SCOPE_NAME}():\n")
    result = []
    for i, produced in enumerate(out):
        for k, opener in enumerate(openers.get(i, [])):
            outer = depth[i] - len(openers[i]) + k
            result.append(" " * (4 * outer) + opener)
        pad = " " * (4 * depth[i])
        result.extend(pad + line if line.strip() else line for line in produced)
    return "".join(result)
