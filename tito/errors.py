"""Errors the proxy reports to clients, translated once at the HTTP boundary.

A `ProxyError` carries an HTTP status and the OpenAI error fields; app.py turns it
into the route's dialect: `{"error": {"message", "type", "code", "param"}}` (OpenAI)
or `{"type": "error", "error": {"type", "message"}}` (Anthropic, which shows
`anthropic_message` when set). Raising one never loses or rewrites stored tokens:
turns are committed only after a generation whose response could be serialized
(a budget error may additionally mark the session truncated).

`fault` is the episode class (miles_env.types.EpisodeEnd) a session's last request failing
with this error stands for: ENGINE_ERROR for an engine failure, None for a budget or context
refusal (the agent's own budget: a policy end), PROXY_REFUSAL for every other refusal.

Context refusals (ours and the engine's) read exactly like the real APIs, so the
CLIs' own recovery (Codex's `context_length_exceeded`, Claude Code's
"prompt is too long" compaction) works behind the proxy.
"""

from __future__ import annotations

from typing import Any

from miles_env.errors import EngineRefused, MilesEnvError
from miles_env.tito.strictjson import safe_text
from miles_env.types import EpisodeEnd

__all__ = [
    "ProxyError",
    "bad_request",
    "unauthorized",
    "not_found",
    "budget_exceeded",
    "context_exceeded",
    "too_large",
    "body_timeout",
    "engine_refused",
    "engine_failed",
]


class ProxyError(MilesEnvError):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        anthropic_message: str | None = None,
        headers: dict[str, str] | None = None,
        fault: EpisodeEnd | None = EpisodeEnd.PROXY_REFUSAL,
    ) -> None:
        message = safe_text(message)  # it may echo client input: always sendable as UTF-8
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.anthropic_message = anthropic_message  # the Messages API's own wording, when it differs
        self.headers = headers or {}  # extra response headers (Allow, Connection)
        self.fault = fault  # the episode class it stands for (module docstring); None: a budget

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def unauthorized(message: str = "invalid API key for this session") -> ProxyError:
    return ProxyError(401, message, type="authentication_error", code="invalid_api_key")


def not_found(message: str) -> ProxyError:
    return ProxyError(404, message, type="not_found_error", code="not_found")


def budget_exceeded(budget: str, message: str) -> ProxyError:
    return ProxyError(
        400, f"session budget {budget} exceeded: {message}", code="budget_exceeded", param=budget, fault=None
    )


def context_exceeded(prompt_tokens: int, limit: int) -> ProxyError:
    """The prompt leaves no room under `limit`; worded as OpenAI and Anthropic word it."""
    return ProxyError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the messages.",
        code="context_length_exceeded",
        param="messages",
        anthropic_message=f"prompt is too long: {prompt_tokens} tokens > {limit} maximum",
        fault=None,
    )


def too_large(size: int | None, limit: int, close: bool) -> ProxyError:
    got = f"{size} bytes" if size is not None else "more"
    headers = {"connection": "close"} if close else None
    return ProxyError(
        413,
        f"request body too large: {got}, the limit is {limit} bytes",
        code="request_too_large",
        headers=headers,
    )


def body_timeout(seconds: float) -> ProxyError:
    return ProxyError(
        408,
        f"request body not received within {seconds:g}s",
        code="request_timeout",
        headers={"connection": "close"},
    )


def engine_refused(e: EngineRefused, prompt_tokens: int, limit: int | None) -> ProxyError:
    """A deterministic refusal: the dialect's own 400 (retrying cannot help)."""
    if e.reason == "context_length":
        n = e.prompt_tokens if e.prompt_tokens is not None else prompt_tokens
        m = e.limit if e.limit is not None else limit
        if m is not None:
            return context_exceeded(n, m)
    return ProxyError(400, e.message, code="invalid_request")


def engine_failed(e: Exception) -> ProxyError:
    """A transient engine failure: a 5xx, so clients retry."""
    return ProxyError(
        502, f"engine failed: {e}", type="server_error", code="engine_error", fault=EpisodeEnd.ENGINE_ERROR
    )
