"""TITO Responses dialect: official openai client (responses.create, streaming and not) and Codex's shapes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from tests.tito_support import RecordingEngine, check_fidelity, served

pytestmark = pytest.mark.anyio

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch", "format": {"type": "text"}}
OBJ = {"type": "object", "properties": {"message": {"type": "string"}}, "additionalProperties": False}
MULTI_AGENT = {  # Codex 0.169/0.171 with multi_agent on (abridged): its sub-agent tools as one namespace
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn",
            "strict": False,
            "parameters": OBJ,
        },
        {"type": "function", "name": "wait_agent", "description": "Wait", "strict": False, "parameters": OBJ},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
async def test_sdk_multi_turn_with_tool_calls_is_token_exact(tok, stream: bool) -> None:
    engine = ScriptedEngine(tok, ["Looking.", call("exec_command", {"cmd": "ls"}), "Two files."])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        history: list[Any] = [
            {"type": "message", "role": "developer", "content": "You are Codex."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
        ]
        outputs = []
        for user in ("go on", None, None):
            if stream:
                events = []
                async with await c.responses.create(
                    model="policy", input=history, tools=[EXEC], stream=True, store=False
                ) as st:
                    async for ev in st:
                        events.append(ev)
                kinds = [e.type for e in events]
                assert kinds[:2] == ["response.created", "response.in_progress"]
                assert kinds[-1] == "response.completed"
                resp = events[-1].response
            else:
                resp = await c.responses.create(model="policy", input=history, tools=[EXEC], store=False)
            outputs.append(resp)
            assert resp.usage is not None and resp.usage.output_tokens > 0
            items = [o.model_dump(exclude_none=True) for o in resp.output]
            history += items
            for it in items:
                if it["type"] == "function_call":
                    assert json.loads(it["arguments"]) == {"cmd": "ls"} and it["id"].startswith("fc_")
                    history.append(
                        {"type": "function_call_output", "call_id": it["call_id"], "output": "a\nb"}
                    )
            if user:
                history.append({"type": "message", "role": "user", "content": user})
        assert [o.output_text for o in outputs] == ["Looking.", "", "Two files."]
        assert outputs[0].output[0].id.startswith("msg_")
        assert outputs[2].usage is not None and outputs[2].usage.input_tokens_details.cached_tokens > 0
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 3  # every turn stitched onto one branch
    check_fidelity(trajs, engine, h.session_id)
    text = tok.decode(trajs[0].token_ids)
    assert "<tool_response>\na\nb\n</tool_response>" in text and "You are Codex." in text


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any], key: str) -> httpx.Response:
    return await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def test_codex_shape_byte_prefix_history_with_reasoning_and_custom_tool(tok) -> None:
    """Codex resends request N as an exact prefix of request N+1: reasoning items with our
    encrypted_content, msg_/fc_ ids, a freeform apply_patch call; all must stitch to one branch."""
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    replies = [
        "<think>plan: patch</think>\n" + call("apply_patch", {"input": patch}),
        "<think>ok</think>Done.",
    ]
    engine = ScriptedEngine(tok, replies)
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = s.proxy.endpoint(h.session_id, s.url).base_url + "/responses"
        body: dict[str, Any] = {
            "model": "gpt-5-codex",
            "instructions": "sys",
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "x" * 200}],
                },
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add a.txt"}]},
            ],
            "tools": [EXEC, PATCH, {"type": "web_search"}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
        }
        r1 = await post(http, url, body, h.api_key)
        assert r1.status_code == 200, r1.text
        evs = sse_events(r1.text)
        kinds = [e["type"] for e in evs]
        assert "response.custom_tool_call_input.done" in kinds
        out = next(e for e in evs if e["type"] == "response.completed")["response"]["output"]
        assert [o["type"] for o in out] == ["reasoning", "custom_tool_call"]
        assert out[0]["summary"][0]["text"] == "plan: patch" and out[1]["input"] == patch
        body["input"] = [
            *body["input"],
            *out,
            {"type": "custom_tool_call_output", "call_id": out[1]["call_id"], "output": "Success"},
        ]
        r2 = await post(http, url, body, h.api_key)
        out2 = next(e for e in sse_events(r2.text) if e["type"] == "response.completed")["response"]["output"]
        assert [o["type"] for o in out2] == ["reasoning", "message"]
        assert out2[1]["content"][0]["text"] == "Done."
        body["input"] = [*body["input"], *out2, {"type": "message", "role": "user", "content": "thanks"}]
        body["stream"] = False
        r3 = await post(http, url, body, h.api_key)
        assert r3.status_code == 200 and r3.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 3
    check_fidelity(trajs, engine, h.session_id)


async def test_message_item_is_matched_by_its_id_even_if_text_differs(tok) -> None:
    engine = ScriptedEngine(tok, ["  Hello there.  ", "Again."])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = s.proxy.endpoint(h.session_id, s.url).base_url + "/responses"
        first = [{"role": "user", "content": "hi"}]
        r1 = (await post(http, url, {"input": first}, h.api_key)).json()
        msg = r1["output"][0]
        # the client keeps the id but normalises the text: identity by id still stitches
        msg["content"][0]["text"] = "Hello there (edited)."
        r2 = await post(http, url, {"input": [*first, msg, {"role": "user", "content": "more"}]}, h.api_key)
        assert r2.status_code == 200
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 2


async def test_namespace_members_are_tools_and_their_calls_name_the_namespace(tok) -> None:
    """Codex dispatches a namespaced call only when its function_call item names the namespace
    ("unsupported call: spawn_agent" without it) and sends the item back with it: one branch."""
    engine = ScriptedEngine(tok, [call("spawn_agent", {"message": "count"}), "Spawned."])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = s.proxy.endpoint(h.session_id, s.url).base_url + "/responses"
        body: dict[str, Any] = {
            "input": [{"type": "message", "role": "user", "content": "delegate"}],
            "tools": [EXEC, MULTI_AGENT, {"type": "web_search", "external_web_access": False}],
            "stream": True,
        }
        evs = sse_events((await post(http, url, body, h.api_key)).text)
        added = next(e["item"] for e in evs if e["type"] == "response.output_item.added")
        out = next(e for e in evs if e["type"] == "response.completed")["response"]["output"]
        assert added["namespace"] == out[0]["namespace"] == "multi_agent_v1"
        assert out[0]["name"] == "spawn_agent" and json.loads(out[0]["arguments"]) == {"message": "count"}
        # Codex's own serialization of the item it sends back (its field order, its output id)
        back = {k: out[0][k] for k in ("type", "status", "id", "name", "namespace", "arguments", "call_id")}
        result = {"type": "function_call_output", "id": "fco_1", "call_id": back["call_id"], "output": "{}"}
        body["input"] = [*body["input"], back, result]
        r2 = await post(http, url, body, h.api_key)
        assert r2.status_code == 200, r2.text
        trajs = s.proxy.export(h.session_id)
    prompt = tok.decode(list(engine.calls[0].input_ids))
    assert '"name": "spawn_agent"' in prompt and '"name": "wait_agent"' in prompt
    assert "multi_agent_v1" not in prompt and "web_search" not in prompt  # members by their own name
    assert len(trajs) == 1 and len(trajs[0].turns) == 2
    check_fidelity(trajs, engine, h.session_id)


@pytest.mark.parametrize(
    ("tools", "param", "named"),
    [
        ([{"type": "file_search", "vector_store_ids": ["v"]}], "tools[0].type", "'file_search'"),
        ([{"type": "local_shell"}], "tools[0].type", "'local_shell'"),
        ([{**MULTI_AGENT, "tools": [PATCH]}], "tools[0].tools[0].type", "'custom'"),
        ([{**MULTI_AGENT, "tools": [MULTI_AGENT]}], "tools[0].tools[0].type", "'namespace'"),
        ([{"type": "namespace", "name": "ns"}], "tools[0].tools", "list"),
        ([{**MULTI_AGENT, "name": 3}], "tools[0].name", "string name"),
        ([MULTI_AGENT, {**EXEC, "name": "wait_agent"}], "tools", "'wait_agent'"),
        ([MULTI_AGENT, {**MULTI_AGENT, "name": "other"}], "tools", "'spawn_agent'"),
    ],
)
async def test_a_tool_that_cannot_be_carried_is_refused_by_name(
    tok, tools: list[Any], param: str, named: str
) -> None:
    engine = ScriptedEngine(tok, ["never"])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = s.proxy.endpoint(h.session_id, s.url).base_url + "/responses"
        r = await post(http, url, {"input": "hi", "tools": tools}, h.api_key)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and named in err["message"]
    assert not engine.calls


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "bogus_item"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ],
)
async def test_bad_input_is_an_openai_400_and_loses_nothing(tok, body: dict[str, Any], param: str) -> None:
    engine = ScriptedEngine(tok, ["kept"])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = s.proxy.endpoint(h.session_id, s.url).base_url + "/responses"
        ok = await post(http, url, {"input": "first"}, h.api_key)
        assert ok.status_code == 200
        r = await post(http, url, body, h.api_key)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and str(err["param"]).startswith(param)
        bad_key = await http.post(url, json={"input": "x"}, headers={"Authorization": "Bearer nope"})
        assert bad_key.status_code == 401 and "error" in bad_key.json()
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 1


@pytest.mark.slow
@pytest.mark.model
async def test_real_hf_engine_responses_and_messages_are_token_exact(tok) -> None:
    """SmolLM2 behind the proxy: a Responses session (openai SDK) and a Messages session (anthropic SDK),
    two turns each; every sampled id is the engine's, each stitched onto one branch."""
    from anthropic import AsyncAnthropic

    from miles_env.engines import HFEngineConfig, build_engine

    engine = RecordingEngine(await build_engine(HFEngineConfig(max_batch_size=2)))
    try:
        async with served(tok, engine) as s:  # type: ignore[arg-type]
            h1, h2 = s.proxy.create_session(), s.proxy.create_session()
            c = s.client(h1.session_id)
            items: list[Any] = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
            for follow in ("And 3+3?", "Thanks."):
                r = await c.responses.create(model="policy", input=items, max_output_tokens=12, temperature=0)
                items += [o.model_dump(exclude_none=True) for o in r.output]
                items.append({"role": "user", "content": follow})
            a = AsyncAnthropic(base_url=s.proxy.endpoint(h2.session_id, s.url).root_url, api_key=h2.api_key)
            msgs: list[Any] = [{"role": "user", "content": "Name a colour."}]
            for follow in ("Another one?", "Thanks."):
                async with a.messages.stream(model="m", max_tokens=12, messages=msgs) as st:
                    m = await st.get_final_message()
                msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]}]
                msgs.append({"role": "user", "content": follow})
            await a.close()
            trajs = {h.session_id: s.proxy.export(h.session_id) for h in (h1, h2)}
    finally:
        await engine.close()
    for sid, t in trajs.items():
        assert len(t) == 1 and len(t[0].turns) == 2
        check_fidelity(t, engine, sid)
