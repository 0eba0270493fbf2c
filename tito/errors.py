"""Errors the proxy reports to clients, translated once at the HTTP boundary.

A `ProxyError` carries an HTTP status and the OpenAI error fields; the app turns
it into `{"error": {"message", "type", "code", "param"}}`. Raising one never
loses or rewrites stored tokens: turns are committed only after a generation
(a budget error may additionally mark the session truncated).
"""

from __future__ import annotations

from typing import Any

from miles_env.errors import MilesEnvError

__all__ = ["ProxyError", "bad_request", "unauthorized", "not_found", "budget_exceeded", "context_exceeded"]


class ProxyError(MilesEnvError):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

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
        400, f"session budget {budget} exceeded: {message}", code="budget_exceeded", param=budget
    )


def context_exceeded(message: str) -> ProxyError:
    return ProxyError(400, message, code="context_length_exceeded", param="messages")
