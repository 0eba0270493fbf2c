"""The Anthropic Messages dialect (what Claude Code speaks): wire models, conversion, body and SSE.

Conversion: `system` (string or text blocks) and `role: "system"` messages become
system messages; a user message's `tool_result` blocks become tool messages (in
block order, text runs in between become user messages); an assistant message's
text and `tool_use` blocks become one assistant message; `thinking` blocks are
accepted and not rendered (reasoning is not part of a turn's identity: the stored ids
already hold what was sampled). Reasoning the core split off a completion
(tito/parsers) is answered as a `thinking` block whose `signature` is our exact-text
codec (wire.py). `cache_control` is ignored everywhere, and so are the fields Claude
Code adds (`context_management`, `output_config`, `metadata`, `thinking`).
Identity: `tool_use.id` + the input as parsed JSON, so Claude Code's compact,
re-ordered re-serialization of `tool_use.input` still stitches to the sampled ids.

Auxiliary requests: `output_config.format` of type json_schema (Claude Code's
session-title request) is served but never stored or trained on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.tito.errors import ProxyError, bad_request
from miles_env.tito.messages import ChatRequest, ChatResult, Message, ToolCall
from miles_env.tito.parsers import reasoning_of
from miles_env.tito.wire import Items, encode_reasoning, sse

__all__ = ["MessagesRequest", "CountTokensRequest", "to_core", "message_body", "stream_events", "error_body"]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_In):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | Items[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class MessageIn(_In):
    role: Literal["user", "assistant", "system"]
    content: str | Items[Block]


class ToolIn(_In):
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class CountTokensRequest(_In):
    model: str | None = None
    messages: Items[MessageIn] = Field(min_length=1)
    system: str | Items[Block] | None = None
    tools: Items[ToolIn] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: Items[str] | None = None
    stream: bool = False
    output_config: dict[str, Any] | None = None


def _texts(blocks: list[Block], where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    out = []
    for j, b in enumerate(blocks):
        if b.type not in allowed or b.text is None:
            raise bad_request(f"content block type {b.type!r} is not supported here", param=f"{where}[{j}]")
        out.append(b.text)
    return "\n".join(out)


def _user(content: list[Block], where: str) -> list[Message]:
    out: list[Message] = []
    run: list[Block] = []
    for j, b in enumerate(content):
        if b.type == "tool_result":
            if run:
                out.append(Message("user", _texts(run, where)))
                run = []
            if b.tool_use_id is None:
                raise bad_request("tool_result needs tool_use_id", param=f"{where}[{j}].tool_use_id")
            c = b.content
            text = c if isinstance(c, str) else _texts(c or [], f"{where}[{j}].content")
            out.append(
                Message("tool", ("Error: " + text) if b.is_error else text, tool_call_id=b.tool_use_id)
            )
        else:
            run.append(b)
    if run:
        out.append(Message("user", _texts(run, where)))
    return out


def _assistant(content: list[Block], where: str) -> Message:
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(content):
        if b.type in ("thinking", "redacted_thinking"):
            # Not identity, not in a stitched prompt (the stored ids hold what was sampled): only
            # handed to the template when a full render is needed.
            if b.type == "thinking" and b.thinking:
                thoughts.append(b.thinking)
        elif b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use" and b.id and b.name:
            args = json.dumps(b.input if b.input is not None else {}, ensure_ascii=False)
            calls.append(ToolCall(b.id, b.name, args))
        else:
            raise bad_request(f"content block type {b.type!r} is not supported here", param=f"{where}[{j}]")
    return Message("assistant", "\n".join(texts), tuple(calls), reasoning="".join(thoughts) or None)


def core_messages(req: CountTokensRequest) -> list[Message]:
    out: list[Message] = []
    if req.system:
        sys_text = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        out.append(Message("system", sys_text))
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, list) and not m.content:
            if m.role == "assistant" and i == last:
                continue  # an empty final assistant message (a prefill with nothing in it) adds nothing
            raise bad_request(
                f"messages.{i}: all messages must have non-empty content except for the optional "
                "final assistant message",
                param=f"messages.{i}",
            )
        if isinstance(m.content, str):
            out.append(Message(m.role, m.content))
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        elif m.role == "system":
            out.append(Message("system", _texts(m.content, where)))
        else:
            out.extend(_user(m.content, where))
    return out


def core_tools(tools: list[ToolIn] | None) -> tuple[dict[str, Any], ...]:
    """Client tools as core function tools; Anthropic server tools (typed, no schema) are skipped."""
    out = []
    for t in tools or ():
        if t.type not in (None, "custom") or t.input_schema is None:
            continue
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return tuple(out)


def is_aux(req: MessagesRequest) -> bool:
    fmt = (req.output_config or {}).get("format")
    return isinstance(fmt, dict) and fmt.get("type") == "json_schema"


def to_core(req: MessagesRequest) -> ChatRequest:
    return ChatRequest(
        messages=tuple(core_messages(req)),
        tools=core_tools(req.tools),
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if not req.top_k else req.top_k,
        stop=tuple(req.stop_sequences or ()),
        aux=is_aux(req),
    )


def _stop(result: ChatResult, stops: list[str] | None) -> tuple[str, str | None]:
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    hit = next((s for s in stops or () if result.text.endswith(s)), None)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def content_blocks(result: ChatResult) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    think, rest = reasoning_of(result), result.content or ""
    if think is not None:
        sig = encode_reasoning((think.lead, think.text, think.trail))
        blocks.append({"type": "thinking", "thinking": think.text, "signature": sig})
    if rest or not result.tool_calls:
        blocks.append({"type": "text", "text": rest})
    for c in result.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments_obj()})
    return blocks


def message_body(result: ChatResult, model: str, stops: list[str] | None) -> dict[str, Any]:
    reason, seq = _stop(result, stops)
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(result),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": _usage(result),
    }


def _usage(result: ChatResult) -> dict[str, int]:
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": result.completion_tokens,
    }


def stream_events(result: ChatResult, model: str, stops: list[str] | None, piece: int = 32) -> Iterator[str]:
    """message_start, ping, content_block_start/delta/stop per block, message_delta, message_stop."""
    body = message_body(result, model, stops)
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**body["usage"], "output_tokens": 0}
    yield sse("message_start", {"type": "message_start", "message": start})
    yield sse("ping", {"type": "ping"})
    for i, b in enumerate(body["content"]):
        yield from _block_events(i, b, piece)
    delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
    usage = {"output_tokens": result.completion_tokens}
    yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
    yield sse("message_stop", {"type": "message_stop"})


_EMPTY: dict[str, dict[str, Any]] = {
    "text": {"text": ""},
    "thinking": {"thinking": "", "signature": ""},
    "tool_use": {"input": {}},
}


def _block_events(i: int, b: dict[str, Any], piece: int) -> Iterator[str]:
    def delta(d: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})

    kind = b["type"]
    empty: dict[str, Any] = _EMPTY[kind]
    first = {k: v for k, v in b.items() if k not in empty} | empty
    yield sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": first})
    if kind == "text":
        for k in range(0, len(b["text"]), piece):
            yield delta({"type": "text_delta", "text": b["text"][k : k + piece]})
    elif kind == "thinking":
        yield delta({"type": "thinking_delta", "thinking": b["thinking"]})
        yield delta({"type": "signature_delta", "signature": b["signature"]})
    else:
        text = json.dumps(b["input"], ensure_ascii=False)
        for k in range(0, len(text), piece):
            yield delta({"type": "input_json_delta", "partial_json": text[k : k + piece]})
    yield sse("content_block_stop", {"type": "content_block_stop", "index": i})


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(e: ProxyError) -> dict[str, Any]:
    kind = _TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.anthropic_message or e.message}}
