"""TITO: the token-in-token-out proxy (see proxy.py for the core, app.py for HTTP)."""

from miles_env.tito.app import create_app
from miles_env.tito.audit import AuditReport, Drift, audit
from miles_env.tito.config import Budget, TitoConfig
from miles_env.tito.errors import ProxyError
from miles_env.tito.messages import ChatRequest, ChatResult, Message, ToolCall
from miles_env.tito.proxy import SessionHandle, TitoProxy
from miles_env.tito.session import SessionInfo

__all__ = [
    "AuditReport",
    "Drift",
    "audit",
    "Budget",
    "ChatRequest",
    "ChatResult",
    "Message",
    "ProxyError",
    "SessionHandle",
    "SessionInfo",
    "TitoConfig",
    "TitoProxy",
    "ToolCall",
    "create_app",
]
