"""Kimi-K2 tool calls: a section of calls, each named by its id `functions.NAME:IDX`.

Format (moonshotai/Kimi-K2-Instruct's chat template and its tool-call guidance):
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{json}<|tool_call_end|>...<|tool_calls_section_end|>`. The id is kept verbatim as the
call id (the template writes it back into history, and tool results cite it); the
name is what lies between `functions.` and `:`. A section with any malformed call
stays in the content whole.
"""

from __future__ import annotations

import re

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, json_call, parse_blocks

__all__ = ["parse"]

_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>", re.DOTALL)
_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*([^<\s]+)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
    re.DOTALL,
)
_ID = re.compile(r"(?:functions\.)?([^:\s]+):\d+")


def _section(m: re.Match[str]) -> list[ToolCall] | None:
    body, calls, pos = m.group(1), [], 0
    for c in _CALL.finditer(body):
        ident = _ID.fullmatch(c.group(1))
        if c.start() != pos or ident is None:
            return None
        call = json_call(ident.group(1), c.group(2), call_id=c.group(1))
        if call is None:
            return None
        calls.append(call)
        pos = c.end()
    return calls if calls and pos == len(body) else None


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    return parse_blocks(text, _SECTION, _section)
