"""Model families end to end: each family's chat template (tests/templates/, written from the model's
public template) over SmolLM2's vocabulary plus the family's special tokens, a scripted policy that
emits the family's native tool-call (and reasoning) format non-canonically (the families are defined
in tests/tito_families.py), and a three-turn session in all three dialects through the official
`openai` / `anthropic` clients. Every sampled id must be stored exactly with mask 1, the engine must
have been fed the stored prefix, and `tito audit` is clean.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic

from miles_env.engines.scripted import ScriptedEngine
from miles_env.tito import audit
from tests.tito_families import ANSWER, FAMILIES, Family
from tests.tito_support import TOOLS, Served, check_fidelity, served

pytestmark = pytest.mark.anyio

SYSTEM = "You are terse."
FILES = "a.txt\nb.txt"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_gpt_oss_stitches_what_its_template_rewrites(dialect: str) -> None:
    """gpt-oss's template drops a call's analysis once a final answer follows and writes a final answer's
    sampled <|return|> as <|end|> in history; the stored ids keep both, and a tool result is rendered
    after the call it answers (the template names it so)."""
    family = next(f for f in FAMILIES if f.name == "gpt_oss")
    tok = family.tokenizer()
    engine = family.engine(tok, [family.call, family.answer, family.bye])
    async with served(tok, engine, stop_token=family.stop) as s:
        h = s.proxy.create_session()
        await DIALECTS[dialect](s, h.session_id)
        trajs = s.proxy.export(h.session_id)
    assert_one_stitched_branch(trajs, engine)
    tails = []
    for before, after in zip(engine.calls[:-1], engine.calls[1:], strict=True):
        fed = len(before.input_ids) + len(before.generation.output_ids)
        tails.append(tok.decode(list(after.input_ids[fed:])))
    assert tails == [
        '<|start|>functions.bash to=assistant<|channel|>commentary<|message|>"a.txt\\nb.txt"<|end|><|start|>assistant',
        "<|start|>user<|message|>thanks<|end|><|start|>assistant",  # after the sampled <|return|>
    ]
    assert tok.decode(engine.calls[1].generation.output_ids).endswith(f"{ANSWER}<|return|>")


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
