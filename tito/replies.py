"""How every answer leaves the proxy: the route's dialect, its error shape, its streams.

Concept: a route belongs to a dialect. `/s/{id}/v1/messages...` is Anthropic's, the
chat and Responses routes are OpenAI's, and a shared or unknown route answers in
Anthropic's shape only when the request carries `anthropic-version` (Claude Code
and the anthropic SDK always send it). `guard(dialect, handler)` wraps a route so
that every failure becomes a response in that shape: a ProxyError with its status,
anything else a 500 (logged with its traceback: a bug), and none is re-raised, so
the server keeps the connection alive. A client that hangs up is one log line.

Streams are serialized in full before a turn is stored (`event_stream` takes the
encoded chunks), so a response that cannot be built stores nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Literal

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from miles_env.tito import anthropic_messages as am
from miles_env.tito.errors import ProxyError

__all__ = ["Dialect", "dialect_of", "error_response", "guard", "event_stream", "log"]

log = logging.getLogger("miles_env.tito")

Dialect = Literal["openai", "anthropic"]
Handler = Callable[[Request], Awaitable[Response]]

_MESSAGES = re.compile(r"^/s/[^/]+/v1/messages(/|$)")
_OPENAI = re.compile(r"^/s/[^/]+/v1/(chat/completions|responses)(/|$)")


def dialect_of(request: Request) -> Dialect:
    path = request.url.path
    if _MESSAGES.match(path):
        return "anthropic"
    if _OPENAI.match(path):
        return "openai"
    return "anthropic" if "anthropic-version" in request.headers else "openai"


def error_response(dialect: Dialect, e: ProxyError) -> Response:
    body = am.error_body(e) if dialect == "anthropic" else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers or None)


def client_gone(request: Request, where: str) -> None:
    log.info("tito: client hung up %s: %s %s", where, request.method, request.url.path)


def guard(dialect: Dialect | None, handler: Handler) -> Handler:
    """`handler` answering every failure in its dialect (None: decided per request, `dialect_of`)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ProxyError as e:
            return error_response(dialect or dialect_of(request), e)
        except ClientDisconnect:
            client_gone(request, "before its request was read")
            return Response(status_code=499)  # nobody is there to read it
        except Exception as e:  # noqa: BLE001 - a bug: logged in full, answered in the client's shape
            log.exception("tito: internal error on %s %s", request.method, request.url.path)
            err = ProxyError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
            return error_response(dialect or dialect_of(request), err)

    return wrapped


class _Events(StreamingResponse):
    """Pre-encoded SSE chunks; a client that hangs up mid-stream is one log line, not a traceback."""

    def __init__(self, chunks: list[bytes], headers: dict[str, str] | None) -> None:
        async def replay() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        super().__init__(replay(), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            log.info("tito: client hung up mid-stream: %s", scope.get("path", ""))


def event_stream(events: Iterable[str], headers: dict[str, str] | None = None) -> Response:
    """An SSE response whose every byte is encoded now (raises here, before any turn is stored)."""
    return _Events([e.encode("utf-8") for e in events], headers)
