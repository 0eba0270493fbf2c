"""Qwen3-Coder tool calls: XML functions with one element per parameter.

Format (Qwen3-Coder-480B-A35B-Instruct's chat template, `qwen3coder_tool_parser.py`):
`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
Values are raw text: one newline on each side is the template's framing and is
dropped; a value whose schema type is not a string is read as JSON (base.coerce).
A block without exactly one well-formed `<function=...>` stays in the content.
"""

from __future__ import annotations

import re

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, coerce, dump_args, is_name, new_call_id, parse_blocks

__all__ = ["parse"]

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _value(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    def block(m: re.Match[str]) -> list[ToolCall] | None:
        fn = _FUNCTION.fullmatch(m.group(1))
        if fn is None:
            return None
        name, body = fn.group(1).strip(), fn.group(2)
        params = list(_PARAM.finditer(body))
        if (
            not is_name(name) or _PARAM.sub("", body).strip()
        ):  # stray text between parameters: not ours to guess
            return None
        args = {
            p.group(1).strip(): coerce(tools, name, p.group(1).strip(), _value(p.group(2))) for p in params
        }
        return [ToolCall(new_call_id(), name, dump_args(args))]

    return parse_blocks(text, _BLOCK, block)
