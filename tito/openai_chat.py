"""The OpenAI chat-completions dialect: wire models and conversions to and from the core.

Requests are validated with pydantic. Unknown top-level and message fields are
ignored rather than forbidden: real clients send vendor fields (store, metadata,
reasoning_effort, ...) that do not change what the policy sees. Content parts
other than text are refused with a 400 naming the field.

Reasoning the core split off a completion (tito/parsers) is returned as the message's
`reasoning_content` (the vLLM / SGLang / DeepSeek convention), streamed as
`reasoning_content` deltas before the content. It is not part of an assistant turn's
identity, so a client that drops it (or sends it back) still stitches to the sampled ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.tito import strictjson
from miles_env.tito.errors import bad_request
from miles_env.tito.messages import ChatRequest, ChatResult, Message, ToolCall
from miles_env.tito.parsers import reasoning_of
from miles_env.tito.wire import Items

__all__ = ["ChatCompletionRequest", "to_core", "completion_body", "stream_events"]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCallIn(_In):
    name: str
    arguments: str = ""


class ToolCallIn(_In):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_In):
    type: str
    text: str | None = None


class ChatMessageIn(_In):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[ContentPart] | None = None
    name: str | None = None
    tool_calls: Items[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as we returned it


class FunctionDef(_In):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(_In):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_In):
    include_usage: bool = False


class ChatCompletionRequest(_In):
    model: str | None = None
    messages: Items[ChatMessageIn] = Field(min_length=1)
    tools: Items[ToolIn] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | Items[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


def _text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type != "text" or p.text is None:
            raise bad_request(
                f"content part type {p.type!r} is not supported", param=f"messages[{i}].content[{j}]"
            )
        parts.append(p.text)
    return "".join(parts)


def _message(m: ChatMessageIn, i: int) -> Message:
    role = "system" if m.role == "developer" else m.role
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    reasoning = m.reasoning_content if role == "assistant" else None
    return Message(role, _text(m.content, i), calls, m.tool_call_id, m.name, reasoning=reasoning)


def to_core(req: ChatCompletionRequest) -> ChatRequest:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return ChatRequest(
        messages=tuple(_message(m, i) for i, m in enumerate(req.messages)),
        tools=tuple(t.model_dump(exclude_none=True) for t in req.tools or ()),
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        stop=stop,
        seed=req.seed,
    )


def _calls(result: ChatResult) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in result.tool_calls
    ]


def _usage(result: ChatResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def completion_body(result: ChatResult, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    reasoning = reasoning_of(result)
    if reasoning is not None:
        message["reasoning_content"] = reasoning.text
    if result.tool_calls:
        message["tool_calls"] = _calls(result)
    return {
        "id": new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
        ],
        "usage": _usage(result),
    }


def stream_events(result: ChatResult, model: str, include_usage: bool, piece: int = 32) -> Iterator[str]:
    """SSE `data:` lines of one completion, the content cut into pieces, then `[DONE]`."""
    base = {
        "id": new_completion_id(),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return f"data: {strictjson.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    reasoning = reasoning_of(result)
    thought = reasoning.text if reasoning is not None else ""
    for i in range(0, len(thought), piece):
        yield chunk({"reasoning_content": thought[i : i + piece]})
    content = result.content or ""
    for i in range(0, len(content), piece):
        yield chunk({"content": content[i : i + piece]})
    for i, call in enumerate(_calls(result)):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, result.finish_reason)
    if include_usage:
        yield f"data: {strictjson.dumps({**base, 'choices': [], 'usage': _usage(result)})}\n\n"
    yield "data: [DONE]\n\n"
