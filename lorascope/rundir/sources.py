"""The source context of a call site, recorded once per site so that the run directory
explains itself on any machine: the line's text and the ``if`` / ``while`` conditions
that enclose it (innermost first), e.g. ``if rank == 0:`` around a collective."""

from __future__ import annotations

import ast
import functools
import io
import linecache
import re
import tokenize
from typing import Any

MAX_FILE_BYTES = 2_000_000
#: A condition that tests the rank (``if rank == 0:``, ``is_main_process``, ...).
RANK_CONDITION = re.compile(
    r"\b(?:rank|local_rank|global_rank|is_main_process|is_local_main_process|"
    r"is_world_process_zero|main_process|process_index|local_process_index)\b"
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
def _tree(filename: str) -> ast.AST | None:
    text = "".join(linecache.getlines(filename))
    if not text or len(text) > MAX_FILE_BYTES:
        return None
    try:
        return ast.parse(text, filename)
    except (SyntaxError, ValueError):
        return None


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


def describe(filename: str, lineno: int) -> dict[str, Any]:
    """``{"line": text or None, "conditions": [enclosing if/while lines, innermost first]}``;
    a line in an ``else`` branch is given as ``else of: <the if line>``."""
    line = linecache.getline(filename, lineno).strip() or None
    found: list[tuple[int, str]] = []
    tree = _tree(filename)
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.While)) and node.lineno < lineno and _spans(node, lineno):
                text = code_only(linecache.getline(filename, node.lineno).strip())
                in_else = any(_spans(child, lineno) for child in node.orelse)
                found.append((node.lineno, f"{ELSE} {text}" if in_else else text))
    return {"line": line, "conditions": [text for _, text in sorted(found, reverse=True)]}


def rank_condition_in(context: dict[str, Any] | None) -> str | None:
    """The innermost enclosing condition in a :func:`describe` context that tests the rank
    (in its code: a recording made before conditions were stored without their comments
    may carry one)."""
    for cond in (context or {}).get("conditions", []):
        code = code_only(str(cond))
        if RANK_CONDITION.search(code):
            return code
    return None
