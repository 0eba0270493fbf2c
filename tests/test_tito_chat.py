"""TITO chat completions end to end: official openai client -> uvicorn -> TitoProxy -> ScriptedEngine."""

from __future__ import annotations

import json

import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from tests.tito_support import TOOLS, check_fidelity, served

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_multi_turn_tool_session_is_token_exact(tok) -> None:
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    engine = ScriptedEngine(tok, ["Let me look.", call, "There are two files."])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "list files"},
        ]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r1.choices[0].message.content == "Let me look."
        assert r1.choices[0].finish_reason == "stop"
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        assert await engine.update_weights_from_disk("unused") == 1  # later turns record the new version
        r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m2 = r2.choices[0].message
        assert r2.choices[0].finish_reason == "tool_calls"
        assert m2.content is None and m2.tool_calls is not None
        assert m2.tool_calls[0].function.name == "bash"
        assert json.loads(m2.tool_calls[0].function.arguments) == {"command": "ls -la"}
        msgs += [m2.model_dump(exclude_none=True)]
        msgs += [{"role": "tool", "tool_call_id": m2.tool_calls[0].id, "content": "a.txt\nb.txt"}]
        r3 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r3.choices[0].message.content == "There are two files."
        assert r3.usage is not None and r3.usage.prompt_tokens_details is not None
        assert r3.usage.prompt_tokens_details.cached_tokens > 0  # the history was stitched, not re-rendered
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1  # one branch: every request extended the stored history
    check_fidelity(trajs, engine, h.session_id)
    t = trajs[0]
    assert t.weight_versions == [0, 1, 1]
    assert [x.finish_reason for x in t.turns] == ["stop", "tool_calls", "stop"]
    # the engine saw exactly the stored prefix each time: stitched ids are what the model was fed
    for call_, turn in zip(engine.calls, t.turns, strict=True):
        assert list(call_.input_ids) == t.token_ids[: turn.start]
    text = tok.decode(t.token_ids)
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in text
    assert text.endswith("There are two files.<|im_end|>")


async def test_assistant_text_that_retokenizes_differently_still_stitches(tok) -> None:
    # By construction: "hello world" emitted one character per token. Decoding gives the same text,
    # re-encoding it gives 2 tokens, so re-tokenizing the history would silently change the sample.
    chars = [tok.encode(ch, add_special_tokens=False)[0] for ch in "hello world"]
    assert len(chars) == 11
    emitted = [*chars, engine_stop(tok)]
    assert tok.encode("hello world", add_special_tokens=False) != chars
    engine = ScriptedEngine(tok, [emitted, "fine"])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "say hello"}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs)
        assert r1.choices[0].message.content == "hello world"
        msgs += [{"role": "assistant", "content": "hello world"}, {"role": "user", "content": "again?"}]
        await c.chat.completions.create(model="policy", messages=msgs)
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1
    t = trajs[0]
    first = t.turns[0]
    assert t.token_ids[first.start : first.start + first.completion_len] == emitted
    # the second prompt the engine saw contains the original character-level ids
    assert list(engine.calls[1].input_ids[first.start : first.start + len(emitted)]) == emitted
    check_fidelity(trajs, engine, h.session_id)


def engine_stop(tok) -> int:
    return int(tok.convert_tokens_to_ids("<|im_end|>"))


async def test_streaming_equals_non_streaming(tok) -> None:
    long = "The answer is forty-two, and here is a long explanation of why that is. " * 3
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi"}}\n</tool_call>'
    engine = ScriptedEngine(tok)
    async with served(tok, engine) as s:
        results = []
        for stream in (False, True):
            h = s.proxy.create_session()
            engine.push(long, call, session_id=h.session_id)
            c = s.client(h.session_id)
            msgs: list = [{"role": "user", "content": "why?"}]
            got = []
            for _ in range(2):
                if stream:
                    content, calls, finish = "", {}, None
                    events = await c.chat.completions.create(
                        model="policy",
                        messages=msgs,
                        tools=TOOLS,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    usage = None
                    async for ev in events:
                        usage = ev.usage or usage
                        for ch in ev.choices:
                            content += ch.delta.content or ""
                            for tc in ch.delta.tool_calls or []:
                                calls[tc.index] = (tc.function.name, tc.function.arguments)
                            finish = ch.finish_reason or finish
                    assert usage is not None and usage.completion_tokens > 0
                    got.append((content or None, list(calls.values()), finish))
                    msgs.append({"role": "assistant", "content": content})
                else:
                    r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
                    m = r.choices[0].message
                    tcs = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
                    got.append((m.content, tcs, r.choices[0].finish_reason))
                    msgs.append({"role": "assistant", "content": m.content or ""})
                msgs.append({"role": "user", "content": "more"})
            results.append((got, s.proxy.export(h.session_id)))
    (plain, t_plain), (streamed, t_streamed) = results
    assert plain == streamed
    assert plain[0][0] == long and plain[1][2] == "tool_calls"
    assert [t.token_ids for t in t_plain] == [t.token_ids for t in t_streamed]


async def test_edited_history_starts_a_new_branch_and_owns_each_sample_once(tok) -> None:
    engine = ScriptedEngine(tok, ["one", "two", "three", "four"])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        base: list = [{"role": "user", "content": "count"}]
        r1 = await c.chat.completions.create(model="policy", messages=base)
        m1 = {"role": "assistant", "content": r1.choices[0].message.content}
        await c.chat.completions.create(
            model="policy", messages=[*base, m1, {"role": "user", "content": "next"}]
        )
        # edited: the assistant turn is rewritten by the client -> cannot extend branch 0
        edited = {"role": "assistant", "content": "uno"}
        r3 = await c.chat.completions.create(
            model="policy", messages=[*base, edited, {"role": "user", "content": "n"}]
        )
        assert r3.usage is not None and r3.usage.prompt_tokens_details.cached_tokens == 0
        # retried first request (a prefix of branch 0, not an extension): another new branch
        await c.chat.completions.create(model="policy", messages=base)
        trajs = s.proxy.export(h.session_id)
    assert [t.branch for t in trajs] == [0, 1, 2]
    assert [len(t.turns) for t in trajs] == [2, 1, 1]
    check_fidelity(trajs, engine, h.session_id)
    assert (
        "uno" in tok.decode(trajs[1].token_ids)
        and sum(trajs[1].loss_mask) == trajs[1].turns[0].completion_len
    )


async def test_length_finish_renders_the_template_close_and_bad_tool_json_is_content(tok) -> None:
    engine = ScriptedEngine(tok, ["a b c d e f g h i j", '<tool_call>{"name": oops}</tool_call>'])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "letters"}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, max_tokens=3)
        assert r1.choices[0].finish_reason == "length"
        assert r1.usage is not None and r1.usage.completion_tokens == 3
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "go"},
        ]
        r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
        assert r2.choices[0].message.content == '<tool_call>{"name": oops}</tool_call>'
        trajs = s.proxy.export(h.session_id)
    # tools changed between the requests (none -> TOOLS): the system prompt differs, so a new branch
    assert len(trajs) == 2
    text = tok.decode(trajs[0].token_ids)
    assert text.endswith("<|im_start|>assistant\na b c")
    check_fidelity(trajs, engine, h.session_id)


async def test_length_finish_then_continue_closes_the_turn(tok) -> None:
    engine = ScriptedEngine(tok, ["a b c d e f", "ok"])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "letters"}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, max_tokens=2)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "go"},
        ]
        await c.chat.completions.create(model="policy", messages=msgs)
        (t,) = s.proxy.export(h.session_id)
    # the truncated turn gets the template's full close (<|im_end|>\n) as prompt tokens, mask 0
    assert "assistant\na b<|im_end|>\n<|im_start|>user\ngo<|im_end|>" in tok.decode(t.token_ids)
    end = t.turns[0].start + t.turns[0].completion_len
    assert t.loss_mask[end] == 0 and t.token_ids[end] == engine_stop(tok)


_HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}\n<tool_call>\n{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_native_tool_template_renders_tools_and_stitches(tok) -> None:
    import copy

    ntok = copy.deepcopy(tok)
    ntok.chat_template = _HERMES_TEMPLATE
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'
    engine = ScriptedEngine(ntok, [call, "in /work"])
    async with served(ntok, engine) as s:
        assert s.proxy.renderer.native_tools
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "system", "content": "sys"}, {"role": "user", "content": "where?"}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m = r1.choices[0].message
        assert m.tool_calls and r1.choices[0].finish_reason == "tool_calls"
        msgs += [
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "/w"},
        ]
        r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r2.choices[0].message.content == "in /work"
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1
    text = ntok.decode(trajs[0].token_ids)
    assert text.startswith('<|im_start|>system\nsys\n<tools>{"type": "function"')  # rendered by the template
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n/w\n</tool_response>" in text
    check_fidelity(trajs, engine, h.session_id)


_COUNTING_TEMPLATE = (
    "<|im_start|>system\nmessages={{ messages | length }}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_template_whose_render_is_not_a_prefix_falls_back_to_new_branches(tok) -> None:
    import copy

    ctok = copy.deepcopy(tok)
    ctok.chat_template = _COUNTING_TEMPLATE  # the header changes with every message: no suffix diff exists
    engine = ScriptedEngine(ctok, ["one", "two"])
    async with served(ctok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "a"}]
        r = await c.chat.completions.create(model="policy", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "b"},
        ]
        await c.chat.completions.create(model="policy", messages=msgs)
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 2
    assert ctok.decode(trajs[1].token_ids).startswith("<|im_start|>system\nmessages=3<|im_end|>")
    check_fidelity(trajs, engine, h.session_id)


async def test_several_tool_calls_in_one_turn(tok) -> None:
    two = (
        'I will run two.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>'
    )
    engine = ScriptedEngine(tok, [two, "both done"])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "go"}]
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        assert m.content == "I will run two." and m.tool_calls is not None and len(m.tool_calls) == 2
        assert [json.loads(t.function.arguments)["command"] for t in m.tool_calls] == ["ls", "pwd"]
        assert len({t.id for t in m.tool_calls}) == 2
        msgs.append(m.model_dump(exclude_none=True))
        msgs += [
            {"role": "tool", "tool_call_id": t.id, "content": f"out{i}"} for i, t in enumerate(m.tool_calls)
        ]
        r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r2.choices[0].message.content == "both done"
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1
    check_fidelity(trajs, engine, h.session_id)


def test_public_surface_is_locked() -> None:
    import miles_env.tito as tito

    assert set(tito.__all__) == {
        "AuditReport", "Budget", "ChatRequest", "ChatResult", "Drift", "Message", "ProxyError",
        "SessionHandle", "SessionInfo", "TitoConfig", "TitoProxy", "ToolCall", "audit", "create_app",
    }  # fmt: skip
