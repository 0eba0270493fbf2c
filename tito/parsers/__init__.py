"""Tool-call and reasoning parsers, one module per model family, chosen from the chat template.

Concept: a completion is split in two steps, reasoning first (`think`: `<think>...</think>`),
then tool calls in the family's native format (hermes, qwen3_coder, glm45, llama3_json,
kimi_k2, deepseek_v31, gpt_oss: harmony's channels, read by harmony_reader.py, openai-harmony's rules in Python; its reasoning
parser is `harmony`, and its parser also runs without tools, since even a plain answer is framed). `build_parsers` picks both from the template's markers
(`detect`) unless the config names them (`tito.tool_parser`, `tito.reasoning_parser`);
an unknown name is a config error listing the known ones.

Invariant: parsing never fails a turn. A block a parser cannot read stays in the
content as text; a parser that raises is logged and the text is kept whole. The
reasoning split is exact (`Reasoning.raw + rest` is the text), so dialects can hand
it to clients in their own field and nothing of the sampled text is lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from miles_env.tito.messages import ChatResult
from miles_env.tito.parsers import deepseek_v31, glm45, gpt_oss, hermes, kimi_k2, llama3, qwen3_coder, think
from miles_env.tito.parsers.base import Parsed, Reasoning, ReasoningParser, ToolParser, Tools

__all__ = [
    "TOOL_PARSERS",
    "REASONING_PARSERS",
    "Parsed",
    "Parsers",
    "Reasoning",
    "build_parsers",
    "detect",
    "check_name",
    "reasoning_of",
]

log = logging.getLogger("miles_env.tito")

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": hermes.parse,
    "qwen3_coder": qwen3_coder.parse,
    "glm45": glm45.parse,
    "llama3_json": llama3.parse,
    "kimi_k2": kimi_k2.parse,
    "deepseek_v31": deepseek_v31.parse,
    "gpt_oss": gpt_oss.parse,
}
REASONING_PARSERS: dict[str, ReasoningParser | None] = {
    "think": think.parse,
    "think_opened": think.parse_opened,
    "harmony": gpt_oss.reasoning,
    "none": None,
}

# A template marker per family, most specific first (Qwen3-Coder's template also says `<tool_call>`).
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "gpt_oss"),
    ("<function=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v31"),
    ("<|start_header_id|>", "llama3_json"),
    ("<tool_call>", "hermes"),
)
_PROBE = [{"role": "user", "content": "hi"}]
# Formats whose plain answers are framed too (harmony's `<|channel|>final<|message|>`): their tool
# parser also runs when the request offered no tools, to take the answer out of its frame.
_FRAMED = frozenset({"gpt_oss"})


def check_name(kind: str, name: str) -> str:
    """`name` if it is "auto" or a registered parser of `kind`, else a ValueError naming the known ones."""
    known = TOOL_PARSERS if kind == "tool_parser" else REASONING_PARSERS
    if name != "auto" and name not in known:
        raise ValueError(f"{kind}: unknown parser {name!r}; known: auto, {', '.join(sorted(known))}")
    return name


def _opens_think(tokenizer: Any) -> bool:
    """Whether the template's generation prompt already opens `<think>` (the model then only closes it)."""
    try:
        prompt = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses the probe says nothing either way: assume it does not
        return False
    return str(prompt).rstrip().endswith("<think>")


def detect(tokenizer: Any) -> tuple[str, str]:
    """(tool parser, reasoning parser) for the tokenizer's chat template, by its family's markers."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    tool = next((name for marker, name in _MARKERS if marker in template), "hermes")
    if tool == "gpt_oss":
        return tool, "harmony"
    return tool, "think_opened" if _opens_think(tokenizer) else "think"


@dataclass(frozen=True, slots=True)
class Parsers:
    tool: str
    reasoning: str

    def parse(self, text: str, tools: Tools) -> Parsed:
        """Reasoning, then tool calls (only when the request offered tools); never raises."""
        split = REASONING_PARSERS[self.reasoning]
        reasoning, rest = split(text) if split is not None else (None, text)
        if not tools and self.tool not in _FRAMED:
            return Parsed(rest, (), reasoning)
        try:
            content, calls = TOOL_PARSERS[self.tool](rest, tools)
        except Exception:  # a parser bug must not cost the sampled turn: the text is kept as content
            log.exception("tool parser %s failed; the completion is kept as text", self.tool)
            content, calls = rest, ()
        return Parsed(content, calls, reasoning)


def build_parsers(
    tokenizer: Any, tool_parser: str = "auto", reasoning_parser: str = "auto", *, native_tools: bool = True
) -> Parsers:
    """The configured parsers, "auto" ones detected; without native tools (the renderer's text-action
    fallback asks for hermes blocks) an "auto" tool parser is hermes whatever the template."""
    auto_tool, auto_reasoning = detect(tokenizer)
    auto_tool = auto_tool if native_tools else "hermes"
    tool = auto_tool if check_name("tool_parser", tool_parser) == "auto" else tool_parser
    reasoning = (
        auto_reasoning if check_name("reasoning_parser", reasoning_parser) == "auto" else reasoning_parser
    )
    return Parsers(tool, reasoning)


def reasoning_of(result: ChatResult) -> Reasoning | None:
    """The reasoning the core split off a completion (`Parsed.meta`), for a dialect to show."""
    r = result.meta.get("reasoning")
    return r if isinstance(r, Reasoning) else None
