"""What every parser family shares: the parsed turn, call ids, block splicing, argument coercion.

A tool parser is `(text, tools) -> (content | None, calls)`: it finds its family's
call blocks, turns each into `ToolCall`s, and leaves a block it cannot parse in the
content verbatim (a bad tool call is data, never an error). A reasoning parser is
`text -> (Reasoning | None, rest)`, where `lead + text + trail + rest` is the input,
byte for byte, so a client can hand the reasoning back and the turn is rebuilt exactly.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from miles_env.tito import strictjson
from miles_env.tito.messages import ToolCall

__all__ = [
    "Tools",
    "Calls",
    "Reasoning",
    "Parsed",
    "ToolParser",
    "ReasoningParser",
    "new_call_id",
    "parse_blocks",
    "json_call",
    "dump_args",
    "coerce",
    "is_name",
]

Tools = tuple[dict[str, Any], ...]
Calls = tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A completion's reasoning: `lead + text + trail` is its exact text (wrappers included)."""

    lead: str
    text: str
    trail: str

    @property
    def raw(self) -> str:
        return self.lead + self.text + self.trail


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None  # the text outside reasoning and parsed call blocks (None: only tool calls)
    tool_calls: Calls
    reasoning: Reasoning | None

    def meta(self) -> dict[str, Any]:
        """What `ChatResult.meta` carries for the dialects: the reasoning, when there is one."""
        return {"reasoning": self.reasoning} if self.reasoning is not None else {}


class ToolParser(Protocol):
    def __call__(self, text: str, tools: Tools) -> tuple[str | None, Calls]: ...


class ReasoningParser(Protocol):
    def __call__(self, text: str) -> tuple[Reasoning | None, str]: ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_blocks(
    text: str, block: re.Pattern[str], parse: Callable[[re.Match[str]], Iterable[ToolCall] | None]
) -> tuple[str | None, Calls]:
    """Calls from every `block` match `parse` accepts; content = the text outside accepted blocks.

    A block `parse` rejects (None) stays in the content verbatim. With no call at all the
    text is returned unchanged; otherwise the content is stripped, None when empty."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in block.finditer(text):
        got = parse(m)
        if got is None:
            continue
        found = list(got)
        if not found:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.extend(found)
    if not calls:
        return text, ()
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), tuple(calls)


_NAME = re.compile(r"[\w.:/-]+")


def is_name(name: str) -> bool:
    """Whether `name` can be a function name (letters, digits, `_ . : / -`): guards the XML formats."""
    return _NAME.fullmatch(name) is not None


def dump_args(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def json_call(name: Any, args: Any, call_id: str | None = None) -> ToolCall | None:
    """A call from a name and JSON arguments (an object, or a string holding one); None if malformed."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = strictjson.loads(args) if args.strip() else {}
        except strictjson.JSONError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=call_id or new_call_id(), name=name, arguments=dump_args(args))


def _param_type(tools: Tools, fn: str, param: str) -> Any:
    for t in tools:
        f = t.get("function", t)
        if isinstance(f, dict) and f.get("name") == fn:
            props = (f.get("parameters") or {}).get("properties") or {}
            schema = props.get(param)
            return schema.get("type") if isinstance(schema, dict) else None
    return None


def coerce(tools: Tools, fn: str, param: str, value: str) -> Any:
    """An XML-style argument value as its schema's type: strings stay text, others are parsed as JSON.

    A value the schema does not type, or whose JSON does not parse, is kept as text."""
    kind = _param_type(tools, fn, param)
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return strictjson.loads(value)
    except strictjson.JSONError:
        return value
