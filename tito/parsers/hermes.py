"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Format: NousResearch Hermes-2-Pro function calling, adopted by the Qwen2.5 and Qwen3
chat templates (and by our text-action fallback, render.py). A block that is not
strict JSON (strictjson.loads) with a string `name` stays in the content as text.
`parameters` is accepted for `arguments` (some fine-tunes write it).
"""

from __future__ import annotations

import re

from miles_env.tito import strictjson
from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, json_call, parse_blocks

__all__ = ["parse"]

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _block(m: re.Match[str]) -> list[ToolCall] | None:
    try:
        obj = strictjson.loads(m.group(1))
    except strictjson.JSONError:
        return None
    if not isinstance(obj, dict):
        return None
    call = json_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))
    return None if call is None else [call]


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    return parse_blocks(text, _BLOCK, _block)
