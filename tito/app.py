"""The proxy's HTTP surface (Starlette): session dialect routes and the admin API.

Routes: `POST /s/{id}/v1/chat/completions`, `POST /s/{id}/v1/responses`,
`POST /s/{id}/v1/messages` (`?beta=true` too) and `/v1/messages/count_tokens`,
`GET /s/{id}/v1/models`, `HEAD /` and `HEAD /s/{id}/` (Claude Code's warm-up), admin
`POST /admin/sessions`, `GET /admin/sessions/{id}/trajectory`,
`DELETE /admin/sessions/{id}`, `GET /health`.

Every error leaves in its route's dialect (replies.py), 404 and 405 included, with
a 4xx for anything the client got wrong and without closing the connection. A
request is authenticated, then its body is read within the route's size and time
limits (body.py: 413, 408), then parsed, validated and converted off the event
loop when large; the core renders and tokenizes off the loop too. The response is
built (serialized) before the turn is stored. A streamed completion is generated
and recorded before its first byte goes out, so a client that hangs up
mid-stream loses nothing and leaves the session usable. A turn's reply that does not
reach the client whole (replies.Reply) marks the turn undelivered: it stays stored and
never trains. A request of a session that fails (a bad body, an engine failure) leaves
its class on the session (`TitoProxy.note_fault`) for the rollout to classify the episode.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from miles_env.tito import anthropic_messages as am
from miles_env.tito import openai_responses as oa
from miles_env.tito import openai_responses_out as oa_out
from miles_env.tito.body import parse_json, read_body
from miles_env.tito.config import Budget, Route
from miles_env.tito.errors import ProxyError, bad_request, unauthorized
from miles_env.tito.messages import ChatRequest, ChatResult
from miles_env.tito.openai_chat import ChatCompletionRequest, completion_body, stream_events, to_core
from miles_env.tito.proxy import TitoProxy
from miles_env.tito.replies import Dialect, Reply, dialect_of, error_response, event_stream, guard, json_reply
from miles_env.tito.store import export_body

__all__ = ["create_app"]

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# Smaller bodies are parsed on the loop: a thread hop would cost more. 96 KB (parse, validate,
# convert: ~0.15 ms) holds the loop about as long as 64 KB did with the json-module parser.
_INLINE_BYTES = 96 * 1024
_HEAVY_PARSES = 4  # larger ones in at most this many threads at once: bounds their memory


class CreateSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] | None = None
    budget: Budget | None = None


def _validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {err['msg']}", code="invalid_request", param=loc or None) from None


def _api_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if key is None and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key


def create_app(proxy: TitoProxy) -> Starlette:
    """Build the ASGI app serving `proxy`."""
    cfg = proxy.config
    heavy = anyio.CapacityLimiter(_HEAVY_PARSES)

    def check_admin(request: Request) -> None:
        token = cfg.admin_token
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token is None or not secrets.compare_digest(given.encode(), token.encode()):
            raise unauthorized("admin API: missing or wrong admin token")

    async def body(request: Request, route: Route, work: Callable[[Any], T]) -> T:
        """Read the body within the route's limits; parse it and run `work` on it, off the loop if large."""
        raw = await read_body(request, cfg.body_limit(route), cfg.body_timeout_s)

        def parse() -> T:
            return work(parse_json(raw))

        if len(raw) <= _INLINE_BYTES:
            return parse()
        return await anyio.to_thread.run_sync(parse, limiter=heavy)

    def session(request: Request) -> str:
        sid = str(request.path_params["session_id"])
        proxy.authenticate(sid, _api_key(request))
        return sid

    async def turn_body(request: Request, sid: str, route: Route, work: Callable[[Any], T]) -> T:
        """`body` for a session's turn: a body refused (too large, too slow, invalid) is the
        session's fault record too (its harness may end on it)."""
        try:
            return await body(request, route, work)
        except ProxyError as e:
            proxy.note_fault(sid, e)
            raise

    def tracked(sid: str, result: ChatResult, reply: Reply) -> Reply:
        """`reply`, marking its turn undelivered when it does not reach the client (aux: not stored)."""
        if result.start >= 0:
            reply.undelivered = lambda reason: proxy.undelivered(sid, result.branch, result.start, reason)
        return reply

    async def chat_completions(request: Request) -> Response:
        sid = session(request)
        req, core = await turn_body(
            request, sid, "chat_completions", lambda d: _with(_validate(ChatCompletionRequest, d), to_core)
        )
        model = req.model or cfg.model_name

        def respond(result: ChatResult) -> Response:
            if not req.stream:
                return tracked(sid, result, json_reply(completion_body(result, model)))
            usage = req.stream_options is not None and req.stream_options.include_usage
            return tracked(sid, result, event_stream(stream_events(result, model, usage)))

        return await proxy.serve(sid, core, respond)

    async def responses(request: Request) -> Response:
        sid = session(request)
        req, (core, custom) = await turn_body(
            request, sid, "responses", lambda d: _with(_validate(oa.ResponsesRequest, d), oa.to_core)
        )
        model, reply_id = req.model or cfg.model_name, core.reply_id or oa.new_reply_id()

        def respond(result: ChatResult) -> Response:
            if not req.stream:
                return tracked(sid, result, json_reply(oa_out.response_body(result, reply_id, custom, model)))
            return tracked(sid, result, event_stream(oa_out.stream_events(result, reply_id, custom, model)))

        return await proxy.serve(sid, core, respond)

    async def messages(request: Request) -> Response:
        sid = session(request)
        req, core = await turn_body(
            request, sid, "messages", lambda d: _with(_validate(am.MessagesRequest, d), am.to_core)
        )
        model = req.model or cfg.model_name
        headers = {"x-tito-aux": "1"} if core.aux else None

        def respond(result: ChatResult) -> Response:
            if not req.stream:
                return tracked(
                    sid, result, json_reply(am.message_body(result, model, req.stop_sequences), headers)
                )
            return tracked(
                sid, result, event_stream(am.stream_events(result, model, req.stop_sequences), headers)
            )

        return await proxy.serve(sid, core, respond)

    def count_request(data: Any) -> ChatRequest:
        req = _validate(am.CountTokensRequest, data)
        return ChatRequest(messages=tuple(am.core_messages(req)), tools=am.core_tools(req.tools))

    async def count_tokens(request: Request) -> Response:
        sid = session(request)
        core = await body(request, "count_tokens", count_request)
        return JSONResponse({"input_tokens": await proxy.count_tokens(sid, core)})

    async def head(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        session(request)
        name = cfg.model_name
        # one body both SDKs accept: OpenAI's list and Anthropic's page
        model = {"id": name, "object": "model", "created": 0, "owned_by": "miles-env"}
        model |= {"type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        page = {"has_more": False, "first_id": name, "last_id": name}
        return JSONResponse({"object": "list", "data": [model], **page})

    async def admin_create(request: Request) -> Response:
        check_admin(request)
        new = await body(request, "admin", lambda d: _validate(CreateSessionBody, d if d is not None else {}))
        h = proxy.create_session(new.metadata, new.budget)
        base = f"{str(request.base_url).rstrip('/')}/s/{h.session_id}/v1"
        return JSONResponse({"session_id": h.session_id, "base_url": base, "api_key": h.api_key})

    async def admin_trajectory(request: Request) -> Response:
        check_admin(request)
        sid = request.path_params["session_id"]
        info = proxy.get_session(sid)
        branches = [export_body(t) for t in proxy.export(sid)]  # -inf logprobs as "-Infinity"
        return JSONResponse(
            {"session_id": sid, "truncated": info.truncated, "metadata": info.metadata, "branches": branches}
        )

    async def admin_delete(request: Request) -> Response:
        check_admin(request)
        proxy.close_session(request.path_params["session_id"])
        return JSONResponse({"deleted": True})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(proxy.session_ids())})

    async def on_http_error(request: Request, exc: Exception) -> Response:
        """The router's own 404 and 405, in the dialect of the path asked for."""
        assert isinstance(exc, HTTPException)
        status, headers = exc.status_code, dict(exc.headers or {})
        if status == 405:
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {headers.get('Allow')})"
        elif status == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        err = ProxyError(status, message, type=kind, code=str(status), headers=headers)
        return error_response(dialect_of(request), err)

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        err = ProxyError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(dialect_of(request), err)

    openai: Dialect = "openai"
    anthropic: Dialect = "anthropic"
    routes = [
        HttpRoute("/s/{session_id}/v1/chat/completions", guard(openai, chat_completions), methods=["POST"]),
        HttpRoute("/s/{session_id}/v1/responses", guard(openai, responses), methods=["POST"]),
        HttpRoute("/s/{session_id}/v1/messages", guard(anthropic, messages), methods=["POST"]),
        HttpRoute(
            "/s/{session_id}/v1/messages/count_tokens", guard(anthropic, count_tokens), methods=["POST"]
        ),
        HttpRoute("/s/{session_id}/v1/models", guard(None, models), methods=["GET"]),
        HttpRoute("/", head, methods=["HEAD", "GET"]),
        HttpRoute("/s/{session_id}/", head, methods=["HEAD", "GET"]),
        HttpRoute("/s/{session_id}", head, methods=["HEAD", "GET"]),
        HttpRoute("/admin/sessions", guard(openai, admin_create), methods=["POST"]),
        HttpRoute(
            "/admin/sessions/{session_id}/trajectory", guard(openai, admin_trajectory), methods=["GET"]
        ),
        HttpRoute("/admin/sessions/{session_id}", guard(openai, admin_delete), methods=["DELETE"]),
        HttpRoute("/health", health, methods=["GET"]),
    ]
    handlers = {HTTPException: on_http_error, Exception: on_internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]


def _with(req: M, convert: Callable[[M], T]) -> tuple[M, T]:
    return req, convert(req)
