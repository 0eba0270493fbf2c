"""The OpenAI Responses dialect (what Codex speaks), request side: wire models, conversion to core.

The reply side (the output items, the response body and its SSE events) is openai_responses_out.py.

Input items become core messages: `message` (developer/system -> system), a run of
assistant-side items (`reasoning`, assistant `message`, `function_call`,
`custom_tool_call`) -> one assistant message, `function_call_output` /
`custom_tool_call_output` -> tool messages. `instructions` is a leading system
message. Only `store: false`-style use is served: the full history is resent, and
`previous_response_id` is refused (400).

Tools: `function`; `custom` (freeform) as a function with one string `input`; each
`function` member of a `namespace` (Codex's `multi_agent_v1`: spawn_agent, ...) as a
function under its own name (the name Codex's prompts and tool descriptions use), so
a member's name must be unique in the request. Its `function_call` output item
carries `namespace` (Codex dispatches a namespaced call only with it); `namespace` on
a `function_call` input item is accepted and not rendered (the model saw the bare
name). The hosted `web_search` is not offered (Codex sends it on every request);
any other tool type is refused with a 400 naming it.

Identity: the reply's `msg_...` id is generated before the turn and stored with it
as an alias, `function_call` items are known by `call_id` (+ canonical arguments),
`fc_...` ids derive from the call id. Reasoning the core split off a completion
(tito/parsers) is a `reasoning` output item (summary = the reasoning text,
`encrypted_content` = our exact-text codec, wire.py); it is not part of the turn's
identity, so reasoning items sent back are accepted and not rendered (the stored ids
already hold what was sampled). So Codex's history, resent as an exact byte prefix,
stitches to the sampled ids. Unknown fields are ignored; unknown item types and non-text content
parts are refused with a 400 naming the item.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_env.tito.errors import bad_request
from miles_env.tito.messages import ChatRequest, Message, ToolCall
from miles_env.tito.wire import Items, custom_tool_function

__all__ = ["ResponsesRequest", "ToolKinds", "to_core", "new_reply_id"]

# Hosted tools a Responses server runs itself; this one offers none, so they are left out of
# the prompt. Codex sends `web_search` on every request unless its config disables it.
HOSTED = frozenset({"web_search", "web_search_preview"})


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Part(_In):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_In):
    type: Literal["message"]
    role: Literal["developer", "system", "user", "assistant"]
    content: str | Items[Part]
    id: str | None = None


class FunctionCallItem(_In):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # not rendered: the model called the member by its own name
    id: str | None = None


class CustomCallItem(_In):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None


class CallOutputItem(_In):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | Items[Part]


class ReasoningItem(_In):
    type: Literal["reasoning"]
    id: str | None = None
    encrypted_content: str | None = None
    summary: Items[dict[str, Any]] = Field(default_factory=list)


Item = Annotated[
    MessageItem | FunctionCallItem | CustomCallItem | CallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class ResponsesRequest(_In):
    model: str | None = None
    input: str | Items[Item]
    instructions: str | None = None
    tools: Items[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        # the "easy" message form has no `type`; give it one so the discriminator can dispatch
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = [
                {**x, "type": "message"} if isinstance(x, dict) and "type" not in x and "role" in x else x
                for x in data["input"]
            ]
            data = {**data, "input": items}
        return data


def _text(content: str | list[Part], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(content):
        if p.type in ("input_text", "output_text", "text") and p.text is not None:
            out.append(p.text)
        elif p.type == "refusal" and p.refusal is not None:
            out.append(p.refusal)
        else:
            raise bad_request(f"content part type {p.type!r} is not supported", param=f"{where}.content[{j}]")
    return "".join(out)


class _Assistant:
    """Collects a run of assistant-side items into one core message."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.calls: list[ToolCall] = []
        self.id: str | None = None
        self.reasoning: str | None = None  # a preceding reasoning item's summary text

    def empty(self) -> bool:
        return self.text is None and not self.calls

    def message(self) -> Message:
        return Message("assistant", self.text or "", tuple(self.calls), id=self.id, reasoning=self.reasoning)


def _messages(req: ResponsesRequest) -> list[Message]:
    out: list[Message] = [Message("system", req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return [*out, Message("user", req.input)]
    group = _Assistant()

    def flush() -> None:
        nonlocal group
        if not group.empty():
            out.append(group.message())
        group = _Assistant()

    for i, it in enumerate(req.input):
        if isinstance(it, ReasoningItem):  # not identity, not stitched: the stored ids hold what was sampled
            if group.text is not None or group.calls:
                flush()
            said = "".join(s["text"] for s in it.summary if isinstance(s.get("text"), str))
            group.reasoning = said or None  # only for a full render (templates that print it)
        elif isinstance(it, MessageItem) and it.role == "assistant":
            if group.text is not None or group.calls:
                flush()
            group.text, group.id = _text(it.content, f"input[{i}]"), it.id
        elif isinstance(it, FunctionCallItem):
            group.calls.append(ToolCall(it.call_id, it.name, it.arguments))
        elif isinstance(it, CustomCallItem):
            group.calls.append(ToolCall(it.call_id, it.name, _json_input(it.input)))
        else:
            flush()
            if isinstance(it, MessageItem):
                role = "system" if it.role == "developer" else it.role
                out.append(Message(role, _text(it.content, f"input[{i}]")))
            else:
                out.append(Message("tool", _text(it.output, f"input[{i}]"), tool_call_id=it.call_id))
    flush()
    return out


def _json_input(text: str) -> str:
    return json.dumps({"input": text}, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolKinds:
    """How the request offered the tools the model may call: the freeform (custom) ones by name,
    and the namespace of each namespace member, which its `function_call` output item names."""

    custom: frozenset[str] = frozenset()
    namespace: Mapping[str, str] = field(default_factory=dict)


def _name(t: dict[str, Any], where: str) -> str:
    if not isinstance(t.get("name"), str):
        raise bad_request(f"a {t.get('type')} tool needs a string name", param=f"{where}.name")
    return str(t["name"])


def _function(t: dict[str, Any], where: str) -> dict[str, Any]:
    _name(t, where)
    fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _members(t: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A namespace's member functions, as core tools."""
    members = t.get("tools")
    if not isinstance(members, list):
        raise bad_request("a namespace tool needs a list of tools", param=f"{where}.tools")
    out = []
    for j, m in enumerate(members):
        kind = m.get("type") if isinstance(m, dict) else None
        if kind != "function":
            msg = f"tool type {kind!r} is not supported in a namespace (only function)"
            raise bad_request(msg, param=f"{where}.tools[{j}].type")
        out.append(_function(m, f"{where}.tools[{j}]"))
    return out


def _tools(tools: list[dict[str, Any]] | None) -> tuple[tuple[dict[str, Any], ...], ToolKinds]:
    """Core function tools, and how each was offered (module docstring). Hosted tools are left out;
    any other type is a 400 naming it."""
    out: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespace: dict[str, str] = {}
    for i, t in enumerate(tools or ()):
        kind = t.get("type")
        if kind == "function":
            out.append(_function(t, f"tools[{i}]"))
        elif kind == "custom":
            name = _name(t, f"tools[{i}]")
            out.append(custom_tool_function(name, t.get("description")))
            custom.add(name)
        elif kind == "namespace":
            ns = _name(t, f"tools[{i}]")
            members = _members(t, f"tools[{i}]")
            out += members
            namespace |= {fn["function"]["name"]: ns for fn in members}
        elif kind not in HOSTED:
            raise bad_request(f"tool type {kind!r} is not supported", param=f"tools[{i}].type")
    seen = Counter(fn["function"]["name"] for fn in out)
    clash = next((name for name in namespace if seen[name] > 1), None)
    if clash is not None:  # the model calls a member by its bare name: it must name one tool
        raise bad_request(f"tool name {clash!r} is offered twice, once in a namespace", param="tools")
    return tuple(out), ToolKinds(frozenset(custom), namespace)


def new_reply_id() -> str:
    return "msg_" + uuid.uuid4().hex


def to_core(req: ResponsesRequest) -> tuple[ChatRequest, ToolKinds]:
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: send the full history (store: false)",
            param="previous_response_id",
        )
    messages = _messages(req)
    if not messages:
        raise bad_request("input must not be empty", param="input")
    tools, kinds = _tools(req.tools)
    core = ChatRequest(
        messages=tuple(messages),
        tools=tools,
        max_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        reply_id=new_reply_id(),
    )
    return core, kinds
