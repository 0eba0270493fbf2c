"""Completion parsers per model family (tito/parsers): native formats written non-canonically,
malformed blocks kept as text, reasoning split exactly, the registry and its config names."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from miles_env.tito import TitoConfig
from miles_env.tito.parsers import TOOL_PARSERS, Parsers, build_parsers, detect, think

TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    },
)

# family -> (a completion with prose and two calls, written with odd spacing and key order)
NATIVE = {
    "hermes": 'Sure.\n<tool_call>\n  { "arguments": {"timeout": 5, "command": "ls"},"name":"bash" }\n</tool_call>'
    '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>',
    "qwen3_coder": "Sure.\n<tool_call>\n<function=bash>\n<parameter=timeout>\n5\n</parameter>\n"
    "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call><function=bash><parameter=command>pwd</parameter></function></tool_call>",
    "glm45": "Sure.\n<tool_call>bash\n<arg_key>timeout</arg_key>\n<arg_value>5</arg_value>"
    "<arg_key> command </arg_key><arg_value>ls</arg_value>\n</tool_call>"
    "<tool_call> bash <arg_key>command</arg_key>  <arg_value>pwd</arg_value></tool_call>",
    "llama3_json": 'Sure.<|python_tag|>{"parameters": {"timeout": 5, "command": "ls"}, "name": "bash"}; '
    ' {"name": "bash", "arguments": {"command": "pwd"}}',
    "kimi_k2": "Sure.<|tool_calls_section_begin|> <|tool_call_begin|>functions.bash:0"
    '<|tool_call_argument_begin|> {"timeout":5,"command":"ls"} <|tool_call_end|>\n'
    '<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{"command": "pwd"}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "deepseek_v31": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>"
    '{ "timeout": 5, "command": "ls" }<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜> bash <｜tool▁sep｜>'
    '{"command":"pwd"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}

# family -> a malformed call block (stays in the content verbatim)
BROKEN = {
    "hermes": '<tool_call>{"name": "bash", "arguments": {"command": NaN}}</tool_call>',
    "qwen3_coder": "<tool_call><function=bash>stray<parameter=command>ls</parameter></function></tool_call>",
    "glm45": "<tool_call>bash<arg_key>command</arg_key>ls</tool_call>",
    "llama3_json": '{"name": "bash", "parameters": {"command": "ls"}} and then some prose',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
    "{not json}<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("family", sorted(NATIVE))
def test_native_calls_parse_with_typed_arguments(family: str) -> None:
    content, calls = TOOL_PARSERS[family](NATIVE[family], TOOLS)
    assert content == "Sure."
    assert [c.name for c in calls] == ["bash", "bash"]
    assert [json.loads(c.arguments) for c in calls] == [{"timeout": 5, "command": "ls"}, {"command": "pwd"}]
    assert len({c.id for c in calls}) == 2
    if family == "kimi_k2":  # the model's own ids are kept: the template writes them back
        assert [c.id for c in calls] == ["functions.bash:0", "functions.bash:1"]


@pytest.mark.parametrize("family", sorted(BROKEN))
def test_a_malformed_block_stays_text(family: str) -> None:
    text = "Let me try. " + BROKEN[family]
    assert TOOL_PARSERS[family](text, TOOLS) == (text, ())


def test_every_family_ignores_the_others_formats() -> None:
    for family, parse in TOOL_PARSERS.items():
        for other, text in NATIVE.items():
            if other != family:
                assert parse(text, TOOLS) == (text, ()), (family, other)


@pytest.mark.parametrize(
    ("text", "parts", "rest"),
    [
        ("<think>plan</think>\n\nDone.", ("<think>", "plan", "</think>\n\n"), "Done."),
        ("\n<think>\na\nb\n</think>ok", ("\n<think>", "\na\nb\n", "</think>"), "ok"),
        ("<think>cut by length", ("<think>", "cut by length", ""), ""),
        ("No reasoning. </think>", None, "No reasoning. </think>"),
    ],
)
def test_think_splits_exactly(text: str, parts: tuple[str, str, str] | None, rest: str) -> None:
    r, after = think.parse(text)
    assert (None if r is None else (r.lead, r.text, r.trail)) == parts and after == rest
    assert (r.raw if r else "") + after == text


def test_think_opened_by_the_prompt() -> None:
    r, rest = think.parse_opened("plan\n</think>\n\nDone.")
    assert r is not None and (r.lead, r.text, r.trail, rest) == ("", "plan\n", "</think>\n\n", "Done.")
    assert think.parse_opened("Just text.") == (None, "Just text.")


def test_reasoning_then_calls_and_a_parser_bug_keeps_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Parsers("glm45", "think")
    got = p.parse("<think>x</think>" + NATIVE["glm45"], TOOLS)
    assert got.reasoning is not None and got.reasoning.text == "x" and len(got.tool_calls) == 2
    assert p.parse("<think>x</think>hi", ()).content == "hi"  # no tools offered: calls are not parsed

    def boom(text: str, tools: object) -> None:
        raise RuntimeError("parser bug")

    monkeypatch.setitem(TOOL_PARSERS, "glm45", boom)
    got = p.parse("<think>x</think>" + NATIVE["glm45"], TOOLS)
    assert got.content == NATIVE["glm45"] and got.tool_calls == ()


class _Tok:
    def __init__(self, template: str, prompt_end: str = "<|im_start|>assistant\n") -> None:
        self.chat_template = template
        self._end = prompt_end

    def apply_chat_template(self, messages: object, **kw: object) -> str:
        return "<|im_start|>user\nhi<|im_end|>\n" + self._end


@pytest.mark.parametrize(
    ("marker", "family"),
    [
        ("{{ '<function=' + name + '>' }}<tool_call>", "qwen3_coder"),
        ("<tool_call>{{ name }}<arg_key>", "glm45"),
        ("<|tool_calls_section_begin|>", "kimi_k2"),
        ("<｜tool▁calls▁begin｜>", "deepseek_v31"),
        ("<|start_header_id|>assistant<|end_header_id|>", "llama3_json"),
        ("<tool_call>\n{{ tool_call | tojson }}", "hermes"),
        ("{{ messages }}", "hermes"),  # plain chatml: the text-action fallback asks for hermes blocks
    ],
)
def test_detect_by_template_markers(marker: str, family: str) -> None:
    assert detect(_Tok(marker)) == (family, "think")


def test_detect_a_prompt_that_opens_think_and_config_overrides() -> None:
    tok = _Tok("<tool_call>", "<|im_start|>assistant\n<think>\n")
    assert detect(tok) == ("hermes", "think_opened")
    assert build_parsers(tok, "kimi_k2", "none") == Parsers("kimi_k2", "none")
    glm = _Tok("<tool_call>{{ name }}<arg_key>")
    assert build_parsers(glm, native_tools=False) == Parsers("hermes", "think")  # the text fallback's blocks
    assert build_parsers(glm, "glm45", native_tools=False) == Parsers("glm45", "think")


@pytest.mark.parametrize("field", ["tool_parser", "reasoning_parser"])
def test_unknown_parser_name_is_a_config_error_naming_the_known_ones(field: str) -> None:
    with pytest.raises(ValidationError) as e:
        TitoConfig(**{field: "mistral"})
    msg = str(e.value)
    assert field in msg and "'mistral'" in msg and "auto" in msg
    assert ("kimi_k2" in msg) if field == "tool_parser" else ("think_opened" in msg)
