"""`<think>...</think>` reasoning (Qwen3, GLM-4.5, DeepSeek-R1/V3.1 thinking, Kimi-K2-Thinking).

A completion that opens with `<think>` (leading whitespace allowed) has the reasoning
up to `</think>` plus the whitespace after it; cut before `</think>` (a length stop),
everything is reasoning. When the template's generation prompt already opened the
block (`opened`: Qwen3-Thinking-2507, DeepSeek-V3.1 thinking mode), the completion has
no `<think>`: the reasoning is the text up to the first `</think>`, if there is one.
"""

from __future__ import annotations

import re

from miles_env.tito.parsers.base import Reasoning

__all__ = ["parse", "parse_opened"]

_OPEN = re.compile(r"(\s*<think>)(.*?)(</think>\s*|$)", re.DOTALL)
_CLOSE = re.compile(r"()(.*?)(</think>\s*)", re.DOTALL)


def parse(text: str) -> tuple[Reasoning | None, str]:
    m = _OPEN.match(text)
    if m is None:
        return None, text
    return Reasoning(m.group(1), m.group(2), m.group(3)), text[m.end() :]


def parse_opened(text: str) -> tuple[Reasoning | None, str]:
    if _OPEN.match(text):
        return parse(text)
    m = _CLOSE.match(text)
    if m is None:
        return None, text
    return Reasoning("", m.group(2), m.group(3)), text[m.end() :]
