"""JSON out, strict: what `analyze --json`, `hang --json`, `plan --json`, the Perfetto
timeline and the report's embedded data write parses with any JSON parser. A non-finite
number (a NaN loss, an infinite duration) is written as ``null``: Python's ``NaN`` and
``Infinity`` are not JSON, and JSON.parse (browsers, chrome://tracing), Go and Rust
reject them."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """VALUE with every non-finite float (in dicts, lists and tuples) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """json.dumps of VALUE, non-finite numbers as null (``options`` as json.dumps takes)."""
    return json.dumps(finite(value), allow_nan=False, **options)
