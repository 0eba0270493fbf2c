"""Model families end to end: each family's chat template (tests/templates/, written from the model's
public template) over SmolLM2's vocabulary plus the family's special tokens, a scripted policy that
emits the family's native tool-call (and reasoning) format non-canonically, and a three-turn session
in all three dialects through the official `openai` / `anthropic` clients. Every sampled id must be
stored exactly with mask 1, the engine must have been fed the stored prefix, and `tito audit` is clean.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic
from miles_env.tito import audit
from tokenizers import AddedToken

from miles_env.engines.base import EngineInfo
from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from tests.test_tito_support import TOOLS, Served, check_fidelity, served

pytestmark = pytest.mark.anyio

TEMPLATES = Path(__file__).parent / "templates"
SYSTEM = "You are terse."
FILES = "a.txt\nb.txt"
ANSWER = "There are two files."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": "Run", "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]

# One turn as the test saw it: (reasoning shown in the dialect's own field, text, tool calls as (name, args)).
Turn = tuple[str | None, str | None, list[tuple[str, dict[str, Any]]]]


async def chat(s: Served, sid: str) -> list[Turn]:
    c = s.client(sid)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "list files"},
    ]
    turns: list[Turn] = []
    for follow in ("tool", "user", None):
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        turns.append((getattr(m, "reasoning_content", None), m.content, calls))
        back = m.model_dump(exclude_none=True)
        if follow == "user":
            back.pop("reasoning_content", None)  # a client that drops reasoning still stitches
        msgs.append(back)
        if follow == "tool":
            msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": FILES})
        elif follow == "user":
            msgs.append({"role": "user", "content": "thanks"})
    return turns


async def responses(s: Served, sid: str) -> list[Turn]:
    c = s.client(sid)
    items: list[Any] = [{"role": "user", "content": "list files"}]
    turns: list[Turn] = []
    for follow in ("tool", "user", None):
        r = await c.responses.create(model="policy", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS)
        think = next((o.summary[0].text for o in r.output if o.type == "reasoning"), None)
        fcs = [o for o in r.output if o.type == "function_call"]
        text = "".join(
            p.text for o in r.output if o.type == "message" for p in o.content if p.type == "output_text"
        )
        turns.append((think, text or None, [(f.name, json.loads(f.arguments)) for f in fcs]))
        items += [o.model_dump(exclude_none=True) for o in r.output]
        if follow == "tool":
            items.append({"type": "function_call_output", "call_id": fcs[0].call_id, "output": FILES})
        elif follow == "user":
            items.append({"role": "user", "content": "thanks"})
    return turns


async def anthropic(s: Served, sid: str) -> list[Turn]:
    ep = s.proxy.endpoint(sid, s.url)
    a = AsyncAnthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    turns: list[Turn] = []
    try:
        for follow in ("tool", "user", None):
            r = await a.messages.create(
                model="policy", max_tokens=512, system=SYSTEM, messages=msgs, tools=ANTHROPIC_TOOLS
            )
            think = next((b.thinking for b in r.content if b.type == "thinking"), None)
            uses = [b for b in r.content if b.type == "tool_use"]
            text = "".join(b.text for b in r.content if b.type == "text")
            turns.append((think, text or None, [(u.name, dict(u.input)) for u in uses]))
            msgs.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}
            )
            if follow == "tool":
                result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": FILES}
                msgs.append({"role": "user", "content": [result]})
            elif follow == "user":
                msgs.append({"role": "user", "content": "thanks"})
    finally:
        await a.close()
    return turns


DIALECTS = {"chat": chat, "responses": responses, "anthropic": anthropic}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
async def test_three_turn_session_is_token_exact(family: Family, dialect: str, tmp_path: Path) -> None:
    tok = family.tokenizer()
    engine = family.engine(tok, [family.call, family.answer, family.bye])
    async with served(tok, engine, store_dir=tmp_path, stop_token=family.stop) as s:
        assert (s.proxy.parsers.tool, s.proxy.parsers.reasoning) == (family.parser, family.reasoning)
        h = s.proxy.create_session()
        turns = await DIALECTS[dialect](s, h.session_id)
        trajs = s.proxy.export(h.session_id)
    (think1, _, calls1), (think2, text2, calls2), (_, text3, _) = turns
    assert calls1 == [("bash", {"command": "ls -la"})]
    assert (think1, think2) == family.thoughts
    assert text2 == ANSWER and calls2 == [] and text3 == "Bye."
    check_fidelity(trajs, engine, h.session_id)  # every sampled id stored exactly once, mask 1
    assert audit(tmp_path).ok
    assert_one_stitched_branch(trajs, engine)


def assert_one_stitched_branch(trajs: list[Any], engine: ScriptedEngine) -> None:
    assert len(trajs) == 1  # every request extended the stored ids, sampled reasoning included
    t = trajs[0]
    for call, turn in zip(engine.calls, t.turns, strict=True):
        assert list(call.input_ids) == t.token_ids[: turn.start]  # the engine was fed the stored prefix


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_a_template_that_drops_earlier_reasoning_still_stitches(dialect: str) -> None:
    family = next(f for f in FAMILIES if f.name == "qwen3")
    tok = family.tokenizer()
    engine = family.engine(tok, [family.call, family.answer, family.bye])
    async with served(tok, engine, stop_token=family.stop) as s:
        h = s.proxy.create_session()
        await DIALECTS[dialect](s, h.session_id)
        trajs = s.proxy.export(h.session_id)
    assert_one_stitched_branch(trajs, engine)
    first, second = engine.calls[:2]  # the second prompt: the first one, its sampled ids, the tail
    fed = len(first.input_ids) + len(first.generation.output_ids)
    assert list(second.input_ids[:fed]) == [*first.input_ids, *first.generation.output_ids]
    tail = "\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(list(second.input_ids[fed:])) == tail  # the reasoning the template drops is kept


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_a_sampled_stop_token_that_opens_the_next_message_is_not_repeated(dialect: str) -> None:
    """GLM-4.5 ends its turns on <|observation|> / <|user|>, which the template also prints to open the
    tool result / user message that follows: the tail appended to the stored ids starts after it."""
    family = next(f for f in FAMILIES if f.name == "glm45")
    tok = family.tokenizer()
    engine = family.engine(tok, [family.call, family.answer, family.bye])
    async with served(tok, engine, stop_token=family.stop) as s:
        h = s.proxy.create_session()
        await DIALECTS[dialect](s, h.session_id)
        trajs = s.proxy.export(h.session_id)
    assert_one_stitched_branch(trajs, engine)
    check_fidelity(trajs, engine, h.session_id)
    ends, tails = [], []
    for before, after in zip(engine.calls[:-1], engine.calls[1:], strict=True):
        out = before.generation.output_ids
        ends.append(tok.decode(out[-1:]))
        tails.append(tok.decode(list(after.input_ids[len(before.input_ids) + len(out) :])))
    assert ends == ["<|observation|>", "<|user|>"]
    assert tails == [
        "\n<tool_response>\na.txt\nb.txt\n</tool_response><|assistant|>",
        "\nthanks<|assistant|>",
    ]


async def test_an_auxiliary_reply_keeps_its_reasoning() -> None:
    family = next(f for f in FAMILIES if f.name == "qwen3")
    tok = family.tokenizer()
    engine = family.engine(tok, ['<think>\nA short title.\n</think>\n\n{"title": "List files"}'])
    async with served(tok, engine, stop_token=family.stop) as s:
        h = s.proxy.create_session()
        ep = s.proxy.endpoint(h.session_id, s.url)
        a = AsyncAnthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0)
        fmt = {"type": "json_schema", "schema": {"type": "object"}}
        msgs: list[Any] = [{"role": "user", "content": "title this"}]
        try:
            raw = await a.messages.with_raw_response.create(
                model="policy", max_tokens=64, messages=msgs, extra_body={"output_config": {"format": fmt}}
            )
            r = await raw.parse()
        finally:
            await a.close()
        info = s.proxy.get_session(h.session_id)
    assert raw.headers["x-tito-aux"] == "1" and (info.n_aux, info.n_turns) == (1, 0)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "\nA short title.\n"  # type: ignore[union-attr]
    assert r.content[1].text == '{"title": "List files"}'  # type: ignore[union-attr]


async def test_chat_streams_reasoning_as_reasoning_content_deltas() -> None:
    family = next(f for f in FAMILIES if f.name == "glm45")
    tok = family.tokenizer()
    engine = family.engine(tok, [family.answer])
    async with served(tok, engine, stop_token=family.stop) as s:
        c = s.client(s.proxy.create_session().session_id)
        msgs = [{"role": "user", "content": "list files"}]
        stream = await c.chat.completions.create(model="policy", messages=msgs, stream=True)
        thought, content = "", ""
        async for ev in stream:
            for ch in ev.choices:
                thought += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
    assert (thought, content) == ("Two names.", ANSWER)


@pytest.mark.parametrize("name", ["glm45", "kimi_k2", "deepseek_v31"])
async def test_a_malformed_native_call_is_data(name: str, tmp_path: Path) -> None:
    """The text is kept as content, the turn recorded: a bad tool call is never an error."""
    family = next(f for f in FAMILIES if f.name == name)
    broken = family.call.replace("ls -la", 'ls -la"', 1).replace("<arg_value>", "<arg_valu>", 1)
    tok = family.tokenizer()
    engine = family.engine(tok, [broken])
    async with served(tok, engine, store_dir=tmp_path, stop_token=family.stop) as s:
        h = s.proxy.create_session()
        msgs = [{"role": "user", "content": "list files"}]
        r = await s.client(h.session_id).chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        trajs = s.proxy.export(h.session_id)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls
    assert m.content is not None and m.content.strip() in broken
    assert len(trajs) == 1 and len(trajs[0].turns) == 1
    check_fidelity(trajs, engine, h.session_id)
    assert audit(tmp_path).ok
