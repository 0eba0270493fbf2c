"""Parse tool calls out of generated text (hermes / qwen `<tool_call>` JSON blocks).

Used both with templates that support tools natively and with the text-action
fallback, which asks for the same block format. A block that is not valid JSON
with a string `name` stays in the content as plain text: a bad tool call is data.
So does one that is not strict JSON (strictjson.loads: NaN, too deep, an escape that
decodes to a lone surrogate): no client could be sent it, while its text can.
"""

from __future__ import annotations

import json
import re
import uuid

from miles_env.tito import strictjson
from miles_env.tito.messages import ToolCall

__all__ = ["parse_tool_calls", "new_call_id"]

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = strictjson.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = strictjson.loads(args)
    except strictjson.JSONError:
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """Return (content outside the parsed blocks or None, tool calls)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1))
        if call is None:
            continue  # stays in the content verbatim
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, ()
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), tuple(calls)
