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

Delivery: a turn's reply (`json_reply`, `event_stream`) is sent chunk by chunk, and its
first and last chunk only while the client is still there (a disconnect the server has
seen, checked without waiting); with `undelivered` set, a reply not sent whole calls it with `client_gone`
(nothing was sent) or `stream_cut` (the client left, or a send failed, part way). What
counts as delivered is "every byte handed to the server while the connection was open":
a client that dies after that is indistinguishable from one that read it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from miles_env.tito import anthropic_messages as am
from miles_env.tito.errors import ProxyError

__all__ = ["Dialect", "Reply", "dialect_of", "error_response", "guard", "event_stream", "json_reply", "log"]

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


async def _gone(receive: Receive) -> bool:
    """Whether the server has seen the client leave, without waiting (as Starlette's
    `Request.is_disconnected`): a receive that would block is cancelled at once."""
    message: Message = {}
    with anyio.CancelScope() as scope:
        scope.cancel()
        message = await receive()
    return message.get("type") == "http.disconnect"


class Reply(Response):
    """A reply encoded in full now, sent chunk by chunk while the client is there (module docstring)."""

    def __init__(
        self, chunks: list[bytes], media_type: str, headers: dict[str, str] | None, length: bool
    ) -> None:
        self.status_code, self.media_type, self.background = 200, media_type, None
        if length:  # a JSON body: one chunk, with its content-length
            self.body = b"".join(chunks)
        self.init_headers(headers)
        self.chunks = chunks
        self.undelivered: Callable[[str], Any] | None = None  # set by the route: the turn's marker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reason = await self._send(receive, send)
        if reason is not None:
            log.info("tito: reply not delivered (%s): %s", reason, scope.get("path", ""))
            if self.undelivered is not None:
                self.undelivered(reason)

    async def _send(self, receive: Receive, send: Send) -> str | None:
        """None once every chunk went out; else why not."""
        started, last = False, len(self.chunks) - 1
        try:
            for i, chunk in enumerate(self.chunks):
                # before the first and the last chunk (not each: a check costs a cancelled receive);
                # a server drops what is sent to a closed connection without a word (uvicorn)
                if (i == 0 or i == last) and await _gone(receive):
                    return "stream_cut" if started else "client_gone"
                if not started:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": self.status_code,
                            "headers": self.raw_headers,
                        }
                    )
                    started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": i < last})
        except (ClientDisconnect, OSError):
            return "stream_cut" if started else "client_gone"
        return None


def json_reply(body: Any, headers: dict[str, str] | None = None) -> Reply:
    """A JSON reply, encoded now as JSONResponse encodes it."""
    return Reply([bytes(JSONResponse(body).body)], "application/json", headers, length=True)


def event_stream(events: Iterable[str], headers: dict[str, str] | None = None) -> Reply:
    """An SSE reply whose every byte is encoded now (raises here, before any turn is stored)."""
    return Reply([e.encode("utf-8") for e in events], "text/event-stream", headers, length=False)
