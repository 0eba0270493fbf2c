"""The model families the TITO tests run (a helpers module, not a test module).

A `Family` is one model family as the proxy sees it: its chat template (tests/templates/, written
from the model's public template) over SmolLM2's vocabulary plus the family's special tokens, the
tool and reasoning parsers `detect` must pick from that template, and a three-turn script in the
family's native format, written non-canonically (odd spacing, key order) so a parser that only
handles the canonical form fails. `FamilyEngine` is a ScriptedEngine that also stops on the
family's other end-of-turn tokens. Used by tests/test_tito_parsers_families.py (every family in
every dialect) and tests/test_tito_render.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from miles_env.engines.base import EngineInfo
from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer

__all__ = [
    "ANSWER",
    "FAMILIES",
    "GPT_OSS",
    "HARMONY_TOKENS",
    "QWEN_TAGS",
    "TEMPLATES",
    "Family",
    "FamilyEngine",
]

TEMPLATES = Path(__file__).parent / "templates"
ANSWER = "There are two files."


@dataclass(frozen=True)
class Family:
    name: str  # the template file
    parser: str  # the tool parser `detect` must pick from it
    specials: tuple[str, ...]
    stop: str
    call: str  # turn 1: (reasoning) + a native `bash {"command": "ls -la"}` call, odd spacing and order
    answer: str  # turn 2: (reasoning) + ANSWER
    bye: str  # turn 3
    thoughts: tuple[str | None, str | None] = (None, None)  # the reasoning of turns 1 and 2
    reasoning: str = "think"  # the reasoning parser `detect` must pick
    eos: tuple[str, ...] = ()  # other tokens that end a turn, reported by the engine as eos ids

    def tokenizer(self) -> Any:
        tok = load_tokenizer()
        tok.add_tokens([AddedToken(t, special=True) for t in self.specials], special_tokens=True)
        tok.chat_template = (TEMPLATES / f"{self.name}.jinja").read_text()
        return tok

    def engine(self, tok: Any, replies: list[str]) -> ScriptedEngine:
        return FamilyEngine(tok, replies, stop_token=self.stop, eos=tok.convert_tokens_to_ids(list(self.eos)))


class FamilyEngine(ScriptedEngine):
    """A ScriptedEngine that also stops on the family's other end-of-turn tokens, which a real engine
    reports as eos ids (the model's generation_config), so a reply may end on any of them."""

    def __init__(self, *args: Any, eos: list[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.eos = tuple(eos)

    async def info(self) -> EngineInfo:
        info = await super().info()
        return replace(info, eos_token_ids=(*info.eos_token_ids, *self.eos))


# o200k_harmony's special tokens (openai-harmony's encoding), as the gpt-oss tokenizer declares them.
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
QWEN_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
FAMILIES = [
    Family(
        "qwen3",  # hermes JSON + <think>; the template drops reasoning before the last user query
        "hermes",
        QWEN_TAGS,
        "<|im_end|>",
        '<think>\nI should list the files.\n</think>\n\n<tool_call>\n{"arguments":  {"command": "ls -la"}, '
        '"name": "bash"}\n</tool_call>',
        f"<think>\nTwo names.\n</think>\n\n{ANSWER}",
        "<think>\n\n</think>\n\nBye.",
        ("\nI should list the files.\n", "\nTwo names.\n"),
    ),
    Family(
        "qwen3_thinking_2507",  # the prompt opens <think>: the completion only closes it
        "hermes",
        QWEN_TAGS,
        "<|im_end|>",
        'I should list the files.\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}'
        "\n</tool_call>",
        f"Two names.\n</think>\n\n{ANSWER}",
        "Nothing to do.\n</think>\n\nBye.",
        ("I should list the files.\n", "Two names.\n"),
        reasoning="think_opened",
    ),
    Family(
        "qwen3_coder",
        "qwen3_coder",
        QWEN_TAGS,
        "<|im_end|>",
        "I'll look.\n<tool_call>\n<function=bash>\n\n<parameter=command>\nls -la\n</parameter>  \n</function>\n"
        "</tool_call>",
        ANSWER,
        "Bye.",
    ),
    Family(
        "glm45",
        "glm45",
        (
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            *QWEN_TAGS,
        ),
        "<|user|>",  # GLM ends a turn on the token that opens the next message: <|user|> or <|observation|>
        "\n<think>I should list the files.</think>\n<tool_call>bash\n<arg_key> command</arg_key>  "
        "<arg_value>ls -la</arg_value>\n</tool_call><|observation|>",
        f"\n<think>Two names.</think>\n{ANSWER}",
        "\n<think></think>\nBye.",
        ("I should list the files.", "Two names."),
        eos=("<|endoftext|>", "<|observation|>"),
    ),
    Family(
        "llama3",
        "llama3_json",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        "<|eot_id|>",
        '<|python_tag|>{"parameters": {"command": "ls -la"},  "name": "bash"}',
        ANSWER,
        "Bye.",
    ),
    Family(
        "kimi_k2",
        "kimi_k2",
        (
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        "<|im_end|>",
        "Let me look.<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.bash:0 "
        '<|tool_call_argument_begin|>{ "command":"ls -la" }<|tool_call_end|>\n<|tool_calls_section_end|>',
        ANSWER,
        "Bye.",
    ),
    Family(
        "deepseek_v31",
        "deepseek_v31",
        (
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
            "<think>",
            "</think>",
        ),
        "<｜end▁of▁sentence｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜> bash<｜tool▁sep｜>{\n  "command": "ls -la"\n}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ANSWER,
        "Bye.",
    ),
]

# gpt-oss (harmony): besides FAMILIES' end-to-end test, tests/test_tito_gpt_oss.py checks the parser and
# its offline vocabulary.
GPT_OSS = Family(
    "gpt_oss",  # harmony: channels; the template drops analysis once a final answer follows
    "gpt_oss",
    HARMONY_TOKENS,
    "<|return|>",  # a final answer ends on <|return|>, a call on <|call|> (the model's other eos)
    "<|channel|>analysis<|message|>I should list the files.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.bash <|constrain|>json<|message|>{ "command":"ls -la" }<|call|>',
    f"<|channel|>analysis<|message|>Two names.<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
    "<|channel|>final<|message|>Bye.",
    ("I should list the files.", "Two names."),
    reasoning="harmony",
    eos=("<|call|>",),
)
FAMILIES.append(GPT_OSS)
