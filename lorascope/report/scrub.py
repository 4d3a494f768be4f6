"""Keeping secrets out of the report.

A report is a file people attach to tickets and chat threads, so nothing that looks like
a credential may reach it. Launch commands, configs, exception texts and stacks can all
carry one (``HF_TOKEN=hf_... torchrun ...``, ``--wandb-api-key KEY``, a config field
``hub_token``, a URL with ``user:password@``). :func:`scrub` walks the report data and
replaces such values with :data:`REDACTED`. It errs on the side of redacting: a false
positive costs a config value in the page, a false negative leaks a credential.
"""

from __future__ import annotations

import functools
import re
from typing import Any

REDACTED = "[redacted]"

#: Words that make a name secret-like, matched against the name's parts (split on
#: ``_ - .`` and camelCase): ``hub_token`` and ``WANDB_API_KEY`` match, ``max_tokens`` and
#: ``tokenizer_class`` do not. ``num_key_value_heads`` matches, but only string values are
#: redacted in configs (a number is never a credential).
_SECRET_WORDS = (
    "token",
    "key",
    "secret",
    "password",
    "passwd",
    "pwd",
    "credential",
    "credentials",
    "apikey",
    "auth",
    "cookie",
    "passphrase",
    "privatekey",
)
_WORDS = "|".join(_SECRET_WORDS)
_PART = "[A-Za-z0-9]+"
#: A name whose parts include a secret word, e.g. ``HF_TOKEN``, ``api-key``, ``db.password``.
_NAME = rf"(?:{_PART}[_.-])*(?:{_WORDS})(?:[_.-]{_PART})*"
_VALUE = r"(\"[^\"]*\"|'[^']*'|[^\s\"',;]+)"

#: ``NAME=value`` with an environment-variable-like NAME (``HF_TOKEN=hf_...``), or ``--api-key=value``.
_ENV_ASSIGN = re.compile(rf"(?<![A-Za-z0-9_.-])(-{{0,2}}{_NAME})={_VALUE}", re.IGNORECASE)
#: ``--api-key value`` (the ``=`` form is covered by _ENV_ASSIGN); numbers are kept.
_FLAG_SPACE = re.compile(rf"(?<![A-Za-z0-9_])(--?{_NAME})(\s+)(?![-\d])(\"[^\"]*\"|'[^']*'|\S+)", re.IGNORECASE)
_FLAG_ALONE = re.compile(rf"^--?{_NAME}$", re.IGNORECASE)
#: Quoted ``"api_key": "value"`` / ``'token': 'value'`` pairs inside text (repr'd dicts).
_QUOTED_PAIR = re.compile(rf"""(["']{_NAME}["']\s*:\s*)(["'])(.*?)\2""", re.IGNORECASE)
#: Credentials in URLs: ``scheme://user:password@host``. The scheme starts where no
#: scheme character precedes it (not at a word boundary: on "a.a.a...." every dot is one,
#: and each start scanned the rest of the run again: 40k characters took 4 s).
_URL_USERINFO = re.compile(r"((?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://[^\s/:@]+:)([^\s/@]+)(@)", re.IGNORECASE)
#: Tokens recognisable by their shape, wherever they appear.
_KNOWN_TOKENS = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abpors]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|glpat-[A-Za-z0-9_-]{20,})\b"
)
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_PLAIN = (int, float, bool, type(None))
_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")


def is_secret_name(name: str) -> bool:
    """Whether a key or option name says its value is a credential."""
    parts = re.split(r"[_\-.\s]+", _CAMEL.sub("_", name.lstrip("-")).lower())
    return any(p in _SECRET_WORDS for p in parts)


@functools.lru_cache(maxsize=1 << 16)
def scrub_text(text: str) -> str:
    """Redact secret-looking values inside free text (a command line, a message, a stack).
    Cached: a 1,024-rank report repeats its texts (sites, ops, labels) rank after rank."""
    text = _ENV_ASSIGN.sub(
        lambda m: (
            m.group(0) if _NUMBER.match(m.group(2)) and m.group(1).startswith("-") else f"{m.group(1)}={REDACTED}"
        ),
        text,
    )
    text = _FLAG_SPACE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _QUOTED_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}{m.group(2)}", text)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(3)}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _KNOWN_TOKENS.sub(REDACTED, text)


def _scrub_list(items: list[Any]) -> list[Any]:
    """An argv-like list: a secret-named option's value may be the next element."""
    out: list[Any] = []
    redact_next = False
    for item in items:
        if redact_next and isinstance(item, str) and not item.startswith("-") and not _NUMBER.match(item):
            out.append(REDACTED)
            redact_next = False
            continue
        redact_next = isinstance(item, str) and bool(_FLAG_ALONE.match(item))
        out.append(scrub(item))
    return out


def scrub(value: Any) -> Any:
    """A copy of ``value`` (JSON-like data) with every secret-looking value redacted."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) and v else scrub(v))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # chart columns: nothing to scrub, and long
            return list(value)
        return _scrub_list(list(value))
    return value
