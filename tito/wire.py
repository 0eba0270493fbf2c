"""Pieces shared by the dialects (mostly Responses and Anthropic Messages).

- `Items[X]`: the list type of every wire model; validation stops at a list's first
  bad item, so a huge junk array costs one error, not one per item.
- SSE framing (`event:` + `data:` lines).
- The reasoning codec: a completion that opens with `<think>...</think>` is shown
  to the client as a reasoning item / thinking block whose opaque field
  (`encrypted_content` / `signature`) carries the exact wrapper text. When the
  client sends it back, `merge_reasoning` rebuilds the completion text byte for
  byte, so the assistant turn keeps its identity and stitches to the sampled ids.
  Reasoning the proxy did not produce (foreign signatures, or a payload that is not
  three strings of valid Unicode) is not rendered.
- Freeform (custom) tools: presented to the model as a function with one string
  parameter `input`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import Field

from miles_env.tito import strictjson

__all__ = [
    "Items",
    "sse",
    "split_reasoning",
    "encode_reasoning",
    "decode_reasoning",
    "custom_tool_function",
    "custom_input",
]

T = TypeVar("T")
Items = Annotated[list[T], Field(fail_fast=True)]

_THINK = re.compile(r"(\s*<think>)(.*?)(</think>\s*)", re.DOTALL)
_PREFIX = "tito1:"


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {strictjson.dumps(data)}\n\n"


def split_reasoning(content: str) -> tuple[tuple[str, str, str] | None, str]:
    """(lead, thinking, trail) of a leading `<think>` block, if any, and the rest of the text."""
    m = _THINK.match(content)
    if m is None:
        return None, content
    return (m.group(1), m.group(2), m.group(3)), content[m.end() :]


def encode_reasoning(parts: tuple[str, str, str]) -> str:
    return _PREFIX + base64.b64encode(json.dumps(list(parts)).encode()).decode()


def decode_reasoning(opaque: str | None) -> str | None:
    """The exact completion prefix a reasoning item stands for, or None when it is not ours."""
    if not opaque or not opaque.startswith(_PREFIX):
        return None
    try:
        parts = json.loads(base64.b64decode(opaque[len(_PREFIX) :], validate=True))
    except (binascii.Error, ValueError, RecursionError):
        return None
    if not (isinstance(parts, list) and len(parts) == 3 and all(isinstance(p, str) for p in parts)):
        return None
    text = "".join(parts)
    try:
        text.encode("utf-8")  # a lone surrogate (an escape inside the payload) is not ours either
    except UnicodeEncodeError:
        return None
    return text


def custom_tool_function(name: str, description: str | None) -> dict[str, Any]:
    params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def custom_input(arguments: str) -> str:
    """The freeform input of a call the model made to a custom tool (raw text when not `{"input": str}`)."""
    try:
        obj = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(obj, dict) and isinstance(obj.get("input"), str):
        return str(obj["input"])
    return arguments
