"""TITO chat completions end to end: official openai client -> uvicorn -> TitoProxy -> ScriptedEngine."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from tests.test_tito_support import TOOLS, check_fidelity, served

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def client(url: str, proxy, sid: str) -> AsyncOpenAI:
    ep = proxy.endpoint(sid, url)
    return AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)


async def test_multi_turn_tool_session_is_token_exact(tok) -> None:
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    engine = ScriptedEngine(tok, ["Let me look.", call, "There are two files."])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = client(s.url, s.proxy, h.session_id)
        msgs: list = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "list files"}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r1.choices[0].message.content == "Let me look."
        assert r1.choices[0].finish_reason == "stop"
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
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
    # the engine saw exactly the stored prefix each time: stitched ids are what the model was fed
    for call_, turn in zip(engine.calls, t.turns, strict=True):
        assert list(call_.input_ids) == t.token_ids[: turn.start]
    text = tok.decode(t.token_ids)
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in text
    assert text.endswith("There are two files.<|im_end|>")
