"""The source context of a call site, recorded once per site so that the run directory
explains itself on any machine: the line's text and the ``if`` / ``while`` conditions
that enclose it (innermost first), e.g. ``if rank == 0:`` around a collective."""

from __future__ import annotations

import ast
import functools
import io
import linecache
import os
import re
import tokenize
from collections.abc import Mapping, Sequence
from typing import Any

from lorascope.errors import BadInputError
from lorascope.rundir.format.safe_open import read_head

MAX_FILE_BYTES = 2_000_000
#: A condition that tests the rank (``if rank == 0:``, ``is_main_process``, ...).
RANK_CONDITION = re.compile(
    r"\b(?:rank|local_rank|global_rank|is_main_process|is_local_main_process|"
    r"is_world_process_zero|main_process|process_index|local_process_index|"
    # flags set from the rank that jobs name alike: nanoGPT's master_process, Lightning's
    # is_global_zero, is_master / is_main / rank_zero of many scripts
    r"master_process|is_master|is_main|is_global_zero|is_rank_zero|rank_zero)\b"
    # a call's ")" is followed by no word character: \b after it never matched, and
    # `if dist.get_rank() == 0:` was no rank condition (get_local_rank(), get_node_local_rank() too)
    r"|\bget_(?:\w+_)?rank\(",
    re.IGNORECASE,  # os.environ["RANK"], os.environ.get("LOCAL_RANK")
)
#: How :func:`describe` marks the ``else`` branch of a condition.
ELSE = "else of:"
#: Frames followed up from a call site to the job's own code whose line sits in a rank
#: condition, at most (the probes' ``via``; `hang --pid`'s reading of a stack).
MAX_VIA_FRAMES = 40


@functools.lru_cache(maxsize=64)
def _tree(text: str) -> ast.AST | None:
    if not text or len(text) > MAX_FILE_BYTES:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


@functools.lru_cache(maxsize=64)
def job_source(filename: str, roots: tuple[str, ...]) -> tuple[str, ...] | None:
    """The lines of a job's source file as the analysis side reads one a record or a stack
    names (it may name anything: /dev/zero, a FIFO, the analyst's own files): a regular
    ``.py`` file under one of ROOTS (the job's working directory, its import roots), not
    reached through a symlink out of it, of at most MAX_FILE_BYTES; else None."""
    if not filename.endswith(".py") or not os.path.isabs(filename):
        return None
    real = os.path.realpath(filename)
    root = next((r for r in roots if os.path.isabs(r) and _under(real, os.path.realpath(r))), None)
    if root is None:
        return None
    try:
        data = read_head(filename, MAX_FILE_BYTES + 1, inside=root)
    except (OSError, BadInputError):
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    return tuple(data.decode("utf-8", "replace").splitlines(keepends=True))


def _under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip(os.sep) + os.sep)


def _spans(node: ast.AST, lineno: int) -> bool:
    start: int = getattr(node, "lineno", 0)
    end: int = getattr(node, "end_lineno", None) or start
    return start <= lineno <= end


def code_only(text: str) -> str:
    """A line of source without its trailing comment: ``if step > 5:  # every rank saves``
    tests no rank. Tokenized, so a ``#`` inside a string stays; a line that does not
    tokenize alone (the first line of a condition spanning several) is cut at its ``#``."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                return text[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        return text.split("#", 1)[0].rstrip()
    return text


def describe(filename: str, lineno: int, lines: Sequence[str] | None = None) -> dict[str, Any]:
    """``{"line": text or None, "conditions": [enclosing if/while lines, innermost first]}``;
    a line in an ``else`` branch is given as ``else of: <the if line>``. LINES: the file's
    (:func:`job_source`); by default the running process's own, through linecache (the
    probes, in the job)."""
    if lines is None:
        lines = linecache.getlines(filename)

    def at(n: int) -> str:
        return lines[n - 1].strip() if 0 < n <= len(lines) else ""

    line = at(lineno) or None
    found: list[tuple[int, str]] = []
    tree = _tree("".join(lines))
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.While)) and node.lineno < lineno and _spans(node, lineno):
                text = code_only(at(node.lineno))
                in_else = any(_spans(child, lineno) for child in node.orelse)
                found.append((node.lineno, f"{ELSE} {text}" if in_else else text))
    return {"line": line, "conditions": [text for _, text in sorted(found, reverse=True)]}


def rank_condition_in(context: Mapping[str, Any] | None) -> str | None:
    """The innermost enclosing condition in a :func:`describe` context that tests the rank
    (in its code: a recording made before conditions were stored without their comments
    may carry one)."""
    for cond in (context or {}).get("conditions", []):
        code = code_only(str(cond))
        if RANK_CONDITION.search(code):
            return code
    return None
