"""The proxy's HTTP surface (Starlette): session dialect routes and the admin API.

Routes: `POST /s/{id}/v1/chat/completions`, `POST /s/{id}/v1/responses`,
`POST /s/{id}/v1/messages` (`?beta=true` too) and `/v1/messages/count_tokens`,
`GET /s/{id}/v1/models`, `HEAD /` and `HEAD /s/{id}/` (Claude Code's warm-up), admin
`POST /admin/sessions`, `GET /admin/sessions/{id}/trajectory`,
`DELETE /admin/sessions/{id}`, `GET /health`. Every error leaves in its dialect's
shape (Anthropic `{"type": "error", ...}` on the Messages routes, OpenAI
`{"error": ...}` elsewhere) with a 4xx/5xx status; the app keeps serving. A streamed completion is
generated (and recorded) before its first byte goes out, so a client that hangs
up mid-stream loses nothing and leaves the session usable.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from miles_env.tito import anthropic_messages as am
from miles_env.tito import openai_responses as oa
from miles_env.tito.config import Budget
from miles_env.tito.errors import ProxyError, bad_request, unauthorized
from miles_env.tito.messages import ChatRequest
from miles_env.tito.openai_chat import ChatCompletionRequest, completion_body, stream_events, to_core
from miles_env.tito.proxy import TitoProxy
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["create_app"]

M = TypeVar("M", bound=BaseModel)


class CreateSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] | None = None
    budget: Budget | None = None


def _error(e: ProxyError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None


def _validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {err['msg']}", code="invalid_request", param=loc or None) from None


def _api_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if key is None and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key


Handler = Callable[[Request], Awaitable[Response]]


def _anthropic_errors(handler: Handler) -> Handler:
    """Answer every failure of an Anthropic route in Anthropic's error shape."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ProxyError as e:
            return JSONResponse(am.error_body(e), status_code=e.status)
        except Exception as e:  # noqa: BLE001 - the client gets a 500 in its own shape, the app keeps serving
            err = ProxyError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
            return JSONResponse(am.error_body(err), status_code=500)

    return wrapped


def create_app(proxy: TitoProxy) -> Starlette:
    """Build the ASGI app serving `proxy`."""

    def check_admin(request: Request) -> None:
        token = proxy.config.admin_token
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token is None or not secrets.compare_digest(given.encode(), token.encode()):
            raise unauthorized("admin API: missing or wrong admin token")

    async def chat_completions(request: Request) -> Response:
        sid = request.path_params["session_id"]
        proxy.authenticate(sid, _api_key(request))
        req = _validate(ChatCompletionRequest, await _json(request))
        result = await proxy.chat(sid, to_core(req))
        model = req.model or proxy.config.model_name
        if not req.stream:
            return JSONResponse(completion_body(result, model))
        usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(stream_events(result, model, usage), media_type="text/event-stream")

    async def responses(request: Request) -> Response:
        sid = request.path_params["session_id"]
        proxy.authenticate(sid, _api_key(request))
        req = _validate(oa.ResponsesRequest, await _json(request))
        core, custom = oa.to_core(req)
        result = await proxy.chat(sid, core)
        model, reply_id = req.model or proxy.config.model_name, core.reply_id or oa.new_reply_id()
        if not req.stream:
            return JSONResponse(oa.response_body(result, reply_id, custom, model))
        return StreamingResponse(
            oa.stream_events(result, reply_id, custom, model), media_type="text/event-stream"
        )

    @_anthropic_errors
    async def messages(request: Request) -> Response:
        sid = request.path_params["session_id"]
        proxy.authenticate(sid, _api_key(request))
        req = _validate(am.MessagesRequest, await _json(request))
        core = am.to_core(req)
        result = await proxy.chat(sid, core)
        model = req.model or proxy.config.model_name
        headers = {"x-tito-aux": "1"} if core.aux else None
        if not req.stream:
            return JSONResponse(am.message_body(result, model, req.stop_sequences), headers=headers)
        events = am.stream_events(result, model, req.stop_sequences)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    @_anthropic_errors
    async def count_tokens(request: Request) -> Response:
        sid = request.path_params["session_id"]
        proxy.authenticate(sid, _api_key(request))
        req = _validate(am.CountTokensRequest, await _json(request))
        core = ChatRequest(messages=tuple(am.core_messages(req)), tools=am.core_tools(req.tools))
        return JSONResponse({"input_tokens": await proxy.count_tokens(sid, core)})

    async def head(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        proxy.authenticate(request.path_params["session_id"], _api_key(request))
        name = proxy.config.model_name
        # one body both SDKs accept: OpenAI's list and Anthropic's page
        model = {"id": name, "object": "model", "created": 0, "owned_by": "miles-env"}
        model |= {"type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        page = {"has_more": False, "first_id": name, "last_id": name}
        return JSONResponse({"object": "list", "data": [model], **page})

    async def admin_create(request: Request) -> Response:
        check_admin(request)
        data = await _json(request)
        body = _validate(CreateSessionBody, data if data is not None else {})
        h = proxy.create_session(body.metadata, body.budget)
        base = f"{str(request.base_url).rstrip('/')}/s/{h.session_id}/v1"
        return JSONResponse({"session_id": h.session_id, "base_url": base, "api_key": h.api_key})

    async def admin_trajectory(request: Request) -> Response:
        check_admin(request)
        sid = request.path_params["session_id"]
        info = proxy.get_session(sid)
        branches = [t.model_dump(mode="json") for t in proxy.export(sid)]
        return JSONResponse(
            {"session_id": sid, "truncated": info.truncated, "metadata": info.metadata, "branches": branches}
        )

    async def admin_delete(request: Request) -> Response:
        check_admin(request)
        proxy.close_session(request.path_params["session_id"])
        return JSONResponse({"deleted": True})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(proxy.session_ids())})

    async def on_proxy_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        return _error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ProxyError(exc.status_code, str(exc.detail), type=kind, code=str(exc.status_code)))

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        return _error(ProxyError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    routes = [
        Route("/s/{session_id}/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/s/{session_id}/v1/responses", responses, methods=["POST"]),
        Route("/s/{session_id}/v1/messages", messages, methods=["POST"]),
        Route("/s/{session_id}/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/s/{session_id}/v1/models", models, methods=["GET"]),
        Route("/", head, methods=["HEAD", "GET"]),
        Route("/s/{session_id}/", head, methods=["HEAD", "GET"]),
        Route("/s/{session_id}", head, methods=["HEAD", "GET"]),
        Route("/admin/sessions", admin_create, methods=["POST"]),
        Route("/admin/sessions/{session_id}/trajectory", admin_trajectory, methods=["GET"]),
        Route("/admin/sessions/{session_id}", admin_delete, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {ProxyError: on_proxy_error, HTTPException: on_http_error, Exception: on_internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
