"""The dialect-neutral conversation the TITO core works on.

Every dialect (chat completions now; Responses and Anthropic Messages later)
converts its request into a `ChatRequest` of `Message`s and turns the core's
`ChatResult` back into its own response shape. The core never sees dialect JSON.

Identity: `message_key` is what stitching compares. An assistant turn is known
by its tool calls when it has any: ids, names and the arguments canonicalised as
parsed JSON (clients re-serialize arguments: compact, their own key order), else
by its stripped text; every other message by role, text and tool-call id. A
message carrying a client-visible item `id` the proxy handed out (Responses
`msg_...`) is matched by that id first (the session's alias table).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ToolCall",
    "Message",
    "ChatRequest",
    "ChatResult",
    "message_key",
    "tools_key",
    "canonical_arguments",
    "digest",
]


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
    id: str | None = None  # an output item id the proxy generated (Responses), if the client sent one


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
    reply_id: str | None = None  # the item id the dialect will show for the reply; stored as an alias


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


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (identity keys, engine-record checksums)."""
    return _digest(*parts)


def _digest(*parts: Any) -> str:
    return hashlib.blake2b(json.dumps(parts, ensure_ascii=False).encode(), digest_size=16).hexdigest()


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments as sorted compact JSON, so a re-serialized call keeps its identity."""
    try:
        obj = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_key(m: Message) -> str:
    if m.role == "assistant":
        if m.tool_calls:
            calls = [(c.id, c.name, canonical_arguments(c.arguments)) for c in m.tool_calls]
            return _digest("assistant-tools", calls)
        return _digest("assistant", m.content.strip())
    return _digest(m.role, m.content, m.tool_call_id)


def tools_key(tools: tuple[dict[str, Any], ...]) -> str:
    return _digest(sorted(json.dumps(t, sort_keys=True) for t in tools)) if tools else ""
