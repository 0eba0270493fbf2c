"""The dialect-neutral conversation the TITO core works on.

Every dialect (chat completions now; Responses and Anthropic Messages later)
converts its request into a `ChatRequest` of `Message`s and turns the core's
`ChatResult` back into its own response shape. The core never sees dialect JSON.

Identity: `message_key` is what stitching compares. An assistant turn is known
by its tool-call ids when it has any (clients re-serialize arguments), else by
its stripped text; every other message by role, text and tool-call id.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "Message", "ChatRequest", "ChatResult", "message_key", "tools_key"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as produced (or as the client sent it back)

    def arguments_obj(self) -> Any:
        try:
            return json.loads(self.arguments) if self.arguments else {}
        except json.JSONDecodeError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[
        dict[str, Any], ...
    ] = ()  # OpenAI function-tool dicts: {"type": "function", "function": {...}}
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    aux: bool = False  # auxiliary call (title generation, ...): served, never stored or trained on


@dataclass(frozen=True, slots=True)
class ChatResult:
    text: str  # the decoded completion without its stop token
    content: str | None  # text outside tool-call blocks (None when only tool calls)
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the session's stored ids
    branch: int
    meta: dict[str, Any] = field(default_factory=dict)


def _digest(*parts: Any) -> str:
    return hashlib.blake2b(json.dumps(parts, ensure_ascii=False).encode(), digest_size=16).hexdigest()


def message_key(m: Message) -> str:
    if m.role == "assistant":
        if m.tool_calls:
            return _digest("assistant-tools", [c.id for c in m.tool_calls])
        return _digest("assistant", m.content.strip())
    return _digest(m.role, m.content, m.tool_call_id)


def tools_key(tools: tuple[dict[str, Any], ...]) -> str:
    return _digest(sorted(json.dumps(t, sort_keys=True) for t in tools)) if tools else ""
