"""Request bodies: read within a size and a time limit, parsed as strict JSON.

`read_body(request, limit, timeout_s)`: a declared Content-Length over `limit` is
refused (413) before a byte is read, and so is a body that grows past it while it
arrives (chunked). A body not fully arrived `timeout_s` after reading began is
refused (408, connection closed): a slow client holds a handler that long at most.
After a 413 the server (uvicorn) discards the rest of the body and keeps the
connection, unless more than DRAIN_FACTOR x `limit` was declared: then it closes.
A client that hangs up mid-body raises starlette's ClientDisconnect.

`parse_json(raw)`: UTF-8 and strictjson.loads (no NaN, bounded depth and size, no
lone surrogates); every failure is a 400 naming the place. CPU-bound on a large
body: callers run it in a worker thread. Fast path: pydantic-core's parser (Rust,
~6x faster than `json`), which refuses NaN/Infinity, lone surrogates, invalid UTF-8
and a BOM as strictjson does; what it accepts is walked once for what it does not
bound (depth, value count, a literal overflowing to inf). Anything it refuses or
the walk flags is parsed again by strictjson.loads, so result and error are strictjson's.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
from pydantic_core import from_json
from starlette.requests import Request

from miles_env.tito import strictjson
from miles_env.tito.errors import ProxyError, bad_request, body_timeout, too_large

__all__ = ["read_body", "parse_json", "DRAIN_FACTOR"]

DRAIN_FACTOR = 4


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("Content-Length is not a number", code="invalid_request")
        if int(declared) > limit:
            raise too_large(int(declared), limit, close=int(declared) > DRAIN_FACTOR * limit)
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(None, limit, close=False)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    return b"".join(chunks)


def _invalid(message: str) -> ProxyError:
    return bad_request(f"request body is not valid JSON: {message}", code="invalid_json")


def _plain(data: Any) -> bool:
    """Whether strictjson would accept `data` as parsed (depth, value count, finite floats)."""
    if type(data) is not dict and type(data) is not list:
        return type(data) is not float or math.isfinite(data)
    stack: list[tuple[Any, int]] = [(data, 1)]  # containers only, with the depth of their items
    n = 1
    while stack:
        value, depth = stack.pop()
        items = value.values() if type(value) is dict else value
        n += len(items)
        if depth >= strictjson.MAX_DEPTH:
            return False
        for x in items:
            kind = type(x)
            if kind is dict or kind is list:
                stack.append((x, depth + 1))
            elif kind is float and not math.isfinite(x):
                return False
    return n < strictjson.MAX_VALUES


def parse_json(raw: bytes) -> Any:
    """The body as strict JSON (None when empty); a ProxyError 400 otherwise."""
    if not raw:
        return None
    try:
        data = from_json(raw, allow_inf_nan=False)
    except ValueError:
        pass  # strictjson words the refusal (or accepts what this parser does not)
    else:
        if _plain(data):
            return data
    return _strict(raw)


def _strict(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"invalid UTF-8 at byte {e.start}") from None
    try:
        return strictjson.loads(text)
    except strictjson.JSONError as e:
        if e.path is not None:
            raise bad_request(f"{e.path}: {e}", code="invalid_request", param=e.path) from None
        raise _invalid(str(e)) from None
