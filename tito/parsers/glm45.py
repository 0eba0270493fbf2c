"""GLM-4.5 / 4.6 tool calls: the function name, then key/value element pairs.

Format (zai-org/GLM-4.5's chat template, `glm4_moe_tool_parser.py`):
`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`.
The template writes a string value raw and any other value as JSON (`tojson`), so a
value is read back by its schema type (base.coerce). Reasoning is `<think>...</think>`.
"""

from __future__ import annotations

import re

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, coerce, dump_args, is_name, new_call_id, parse_blocks

__all__ = ["parse"]

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    def block(m: re.Match[str]) -> list[ToolCall] | None:
        body = m.group(1)
        cut = body.find("<arg_key>")
        name = (body if cut < 0 else body[:cut]).strip()
        rest = "" if cut < 0 else body[cut:]
        if not is_name(name) or _PAIR.sub("", rest).strip():
            return None
        args = {k.strip(): coerce(tools, name, k.strip(), v) for k, v in _PAIR.findall(rest)}
        return [ToolCall(new_call_id(), name, dump_args(args))]

    return parse_blocks(text, _BLOCK, block)
