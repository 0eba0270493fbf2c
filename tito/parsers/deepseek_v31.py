"""DeepSeek-V3.1 / V3.2 tool calls: name and JSON arguments between full-width markers.

Format (deepseek-ai/DeepSeek-V3.1's chat template, "Tool Calling" in its model card):
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>` (V3.0's `function<｜tool▁sep｜>NAME\\n```json ...``` form is not
read). A section with any malformed call stays in the content whole. Reasoning
(thinking mode) is `...</think>` after a prompt that opened `<think>`.
"""

from __future__ import annotations

import re

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, json_call, parse_blocks

__all__ = ["parse"]

_SECTION = re.compile(r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", re.DOTALL)
_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>([^<]*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>\s*", re.DOTALL)


def _section(m: re.Match[str]) -> list[ToolCall] | None:
    body, calls, pos = m.group(1), [], 0
    for c in _CALL.finditer(body):
        call = json_call(c.group(1).strip(), c.group(2)) if c.start() == pos else None
        if call is None:
            return None
        calls.append(call)
        pos = c.end()
    return calls if calls and pos == len(body) else None


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    return parse_blocks(text, _SECTION, _section)
