"""Parse hermes / qwen `<tool_call>` JSON blocks: kept for callers of the one-format API.

The parsers of every family live in `tito/parsers/` (one module each, chosen from the
chat template); this is the hermes one, which the text-action fallback also asks for.
A block that is not strict JSON with a string `name` stays in the content as text.
"""

from __future__ import annotations

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers import hermes
from miles_env.tito.parsers.base import new_call_id

__all__ = ["parse_tool_calls", "new_call_id"]


def parse_tool_calls(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """Return (content outside the parsed blocks or None, tool calls)."""
    return hermes.parse(text)
