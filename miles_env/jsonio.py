"""Strict JSON out: what miles-env writes parses in jq, JavaScript and every other JSON parser.

Python's json writes NaN, Infinity and -Infinity by default; they are not JSON, and a single one
makes a whole metrics.jsonl unreadable outside Python. Here a non-finite float (NaN, a diverged
loss, an empty mean) is written as null: the number is unknown, the row stays readable.

Invariant: every JSON file the project writes outside tito/, engines/ and sandboxes/ goes through
`dumps`/`write_json` (tests/test_jsonio.py checks the call sites). `allow_nan=False` underneath
means a value that slips past the replacement fails loudly instead of writing a bad token.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["finite", "dumps", "write_json"]


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, through dicts, lists and tuples."""
    if isinstance(obj, float):  # float subclasses too (numpy.float64)
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, *, default: Callable[[Any], Any] | None = None, **kwargs: Any) -> str:
    """json.dumps writing strict JSON. `default` converts what json cannot (e.g. `float` for a
    tensor or numpy scalar); its result is made finite as well."""

    def strict_default(value: Any) -> Any:
        if default is None:
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        return finite(default(value))

    return json.dumps(finite(obj), allow_nan=False, default=strict_default, **kwargs)


def write_json(
    path: Path, obj: Any, *, indent: int | None = 2, default: Callable[[Any], Any] | None = None
) -> None:
    """Write one JSON document atomically (a temporary file renamed over `path`)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(obj, indent=indent, default=default) + "\n")
    tmp.replace(path)
