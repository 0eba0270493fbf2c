"""Strict JSON for everything tito reads from a client, writes to disk or returns.

Out (`dumps`, `encode`): RFC 8259 JSON only: no `NaN`/`Infinity` tokens
(`allow_nan=False`) and only text that encodes to UTF-8 (a lone surrogate raises
instead of being written). A float that is not finite (an engine's `-inf` logprob)
is written as the string "-Infinity", "Infinity" or "NaN": the spelling of
pydantic's `ser_json_inf_nan="strings"`, which `float()` and pydantic read back, so
the value round-trips exactly. Compare encoded forms (`number`) to treat NaN as
equal to itself.

In (`loads`): the same rules backwards, plus bounds: NaN/Infinity (also as an
overflowing literal such as 1e400), integers longer than Python converts, nesting
deeper than MAX_DEPTH (RecursionError included), more than MAX_VALUES values, and
strings or keys holding a lone surrogate raise `JSONError` (a ValueError) naming
the place, so whatever is parsed can be rendered, hashed and sent back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

__all__ = [
    "number",
    "numbers",
    "floats",
    "dumps",
    "encode",
    "safe_text",
    "loads",
    "JSONError",
    "MAX_DEPTH",
    "MAX_VALUES",
]

MAX_DEPTH = 100  # JSON Schemas and tool inputs nest a few dozen levels at most
MAX_VALUES = 250_000  # a long agent conversation is ~10^4 values


def number(x: float) -> float | str:
    """`x` itself when finite, else its sentinel string."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def numbers(xs: Iterable[float]) -> list[float | str]:
    return [number(x) for x in xs]


def floats(xs: Iterable[float | str]) -> list[float]:
    """The inverse of `numbers` (also accepts plain floats and ints)."""
    return [float(x) for x in xs]


def dumps(obj: Any) -> str:
    """Compact strict JSON text; raises ValueError on a non-finite float."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode(obj: Any) -> bytes:
    """`dumps` as UTF-8; raises UnicodeEncodeError on a lone surrogate."""
    return dumps(obj).encode("utf-8")


def safe_text(text: str) -> str:
    """`text` with anything UTF-8 cannot carry replaced (for error messages that echo input)."""
    return text.encode("utf-8", "replace").decode("utf-8")


class JSONError(ValueError):
    """Not strict JSON; `path` is the dotted place of the offending string, when there is one."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} is out of range")
    return x


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str, *, max_values: int = MAX_VALUES) -> Any:
    """Parse strict JSON text (see the module note); raises JSONError."""
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise JSONError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, over-long integers
        raise JSONError(str(e)[:200]) from None
    if not _check_shape(data, max_values):  # a string with a lone surrogate somewhere: find where
        raise JSONError("a string holds a lone surrogate (not valid Unicode)", _surrogate(data, "") or "body")
    return data


def _check_shape(data: Any, max_values: int) -> bool:
    """Bounds depth and size (raises); False when some string or key cannot be encoded as UTF-8."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    n, ok = 0, True
    while stack:
        value, depth = stack.pop()
        n += 1
        if n > max_values:
            raise JSONError(f"more than {max_values} values")
        kind = type(value)
        if kind is str:
            ok = ok and (value.isascii() or not _bad(value))  # isascii is O(1): an ASCII str is fine
            continue
        if kind is dict:
            ok = ok and all(k.isascii() or not _bad(k) for k in value)
            value = value.values()
        elif kind is not list:
            continue
        if depth >= MAX_DEPTH:
            raise JSONError(f"nested deeper than {MAX_DEPTH} levels")
        stack.extend((x, depth + 1) for x in value)
    return ok


def _bad(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) with a lone surrogate, if any (depth <= MAX_DEPTH)."""
    if isinstance(value, str):
        return path if _bad(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _bad(k):
                return path or "body"
            found = _surrogate(v, f"{path}.{k}" if path else k)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None
