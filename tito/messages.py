"""The dialect-neutral conversation the TITO core works on.

Every dialect (chat completions now; Responses and Anthropic Messages later)
converts its request into a `ChatRequest` of `Message`s and turns the core's
`ChatResult` back into its own response shape. The core never sees dialect JSON.

Identity: `message_key` is what stitching compares. An assistant turn is known
by its tool calls when it has any: ids, names and the arguments canonicalised as
parsed JSON (clients re-serialize arguments: compact, their own key order), else
by its stripped text; every other message by role, text and tool-call id. A
message carrying a client-visible item `id` the proxy handed out (Responses
`msg_...`) is matched by that id first (the session's alias table). Arguments
that are not strict JSON (strictjson.loads: NaN, too deep, lone surrogates) are
kept and compared as their text.

Key schemes: `message_key` (scheme 2) is sha256 over length-prefixed raw fields
(64 hex digits); `message_key_v1` (scheme 1, blake2b-128 over `json.dumps` of the
fields, 32 hex digits) is kept for sessions whose journal was written with it.
A journal stores keys, not messages, so a session's keys cannot be recomputed:
`key_function(stored_key)` picks the scheme a session already uses from the length
of one of its keys, and the whole session stays on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_env.tito import strictjson

__all__ = [
    "ToolCall",
    "Message",
    "ChatRequest",
    "ChatResult",
    "message_key",
    "message_key_v1",
    "key_function",
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
        """The arguments as parsed strict JSON, or the text itself when it is not (strictjson.loads)."""
        try:
            return strictjson.loads(self.arguments) if self.arguments else {}
        except strictjson.JSONError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    id: str | None = None  # an output item id the proxy generated (Responses), if the client sent one
    # An assistant turn's reasoning as the client sent it back: handed to the template as
    # `reasoning_content` in a full render (templates that keep recent reasoning print it), never part
    # of the message's identity (a client may drop it) nor of a stitched prompt (the stored ids hold it).
    reasoning: str | None = None


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
    start: int = -1  # offset of the completion in its branch (Turn.start); -1: not stored (aux)


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (identity keys, engine-record checksums)."""
    return _digest(*parts)


_CHUNK = 1 << 20


def _digest(*parts: Any) -> str:
    """blake2b of `json.dumps(parts, ensure_ascii=False)`; a long string is fed in slices of the same
    bytes, so no single step holds the GIL for long (other sessions keep being served)."""
    h = hashlib.blake2b(digest_size=16)
    if all(not isinstance(p, str) or len(p) <= _CHUNK for p in parts):
        h.update(json.dumps(parts, ensure_ascii=False).encode())
        return h.hexdigest()
    h.update(b"[")
    for i, p in enumerate(parts):
        if i:
            h.update(b", ")
        if isinstance(p, str) and len(p) > _CHUNK:  # JSON escapes are per character: slices concatenate
            h.update(b'"')
            for k in range(0, len(p), _CHUNK):
                h.update(json.dumps(p[k : k + _CHUNK], ensure_ascii=False)[1:-1].encode())
            h.update(b'"')
        else:
            h.update(json.dumps(p, ensure_ascii=False).encode())
    h.update(b"]")
    return h.hexdigest()


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments as sorted compact JSON, so a re-serialized call keeps its identity."""
    try:
        obj = strictjson.loads(arguments) if arguments else {}
    except strictjson.JSONError:
        return arguments
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_key_v1(m: Message) -> str:
    """Scheme 1 (journals written before scheme 2): blake2b-128 over `json.dumps` of the fields."""
    if m.role == "assistant":
        if m.tool_calls:
            calls = [(c.id, c.name, canonical_arguments(c.arguments)) for c in m.tool_calls]
            return _digest("assistant-tools", calls)
        return _digest("assistant", m.content.strip())
    return _digest(m.role, m.content, m.tool_call_id)


def _key(tag: str, ref: str | None, text: str) -> str:
    """sha256 of `tag`, `ref` (None apart from "") and `text`, each prefixed by its length in
    characters (unambiguous). A long text is fed in slices (hashlib releases the GIL on each)."""
    head = f"{len(tag)}:{tag}" + ("-" if ref is None else f"{len(ref)}:{ref}") + f"{len(text)}:"
    h = hashlib.sha256(head.encode("utf-8", "surrogatepass"))
    if len(text) <= _CHUNK:
        h.update(text.encode("utf-8", "surrogatepass"))
    else:
        for k in range(0, len(text), _CHUNK):
            h.update(text[k : k + _CHUNK].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def message_key(m: Message) -> str:
    """Scheme 2: the message's identity (see the module note), 64 hex digits."""
    if m.role == "assistant":
        if m.tool_calls:
            calls = [(c.id, c.name, canonical_arguments(c.arguments)) for c in m.tool_calls]
            return _key("assistant-tools", None, json.dumps(calls, ensure_ascii=False))
        return _key("assistant", None, m.content.strip())
    return _key(m.role, m.tool_call_id, m.content)


_V1_LEN = 32


def key_function(stored_key: str | None) -> Callable[[Message], str]:
    """The key scheme of a session holding `stored_key` (None: a session with no key yet: scheme 2)."""
    return message_key_v1 if stored_key is not None and len(stored_key) == _V1_LEN else message_key


def tools_key(tools: tuple[dict[str, Any], ...]) -> str:
    return _digest(sorted(json.dumps(t, sort_keys=True) for t in tools)) if tools else ""
