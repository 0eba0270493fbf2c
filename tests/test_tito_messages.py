"""TITO Anthropic Messages dialect: official anthropic client (create and .stream) and Claude Code's shapes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest
from anthropic import AsyncAnthropic

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from tests.tito_support import check_fidelity, served

pytestmark = pytest.mark.anyio

BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def root(s: Any, sid: str) -> str:
    return s.proxy.endpoint(sid, s.url).root_url


@pytest.mark.parametrize("stream", [False, True])
async def test_sdk_multi_turn_with_tool_use_is_token_exact(tok, stream: bool) -> None:
    args = {"command": "ls -la", "timeout": 5}
    engine = ScriptedEngine(tok, ["Let me look.", call("Bash", args), "Two files."])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        client = AsyncAnthropic(base_url=root(s, h.session_id), api_key=h.api_key, max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
        texts, reasons = [], []
        for user in ("go on", None, None):
            kw: dict[str, Any] = dict(
                model="policy", max_tokens=64, system="Be terse.", messages=msgs, tools=[BASH]
            )
            if stream:
                async with client.messages.stream(**kw) as st:
                    deltas = [e.type async for e in st]
                    m = await st.get_final_message()
                assert deltas[0] == "message_start" and "content_block_stop" in deltas
            else:
                m = await client.messages.create(**kw)
            reasons.append(m.stop_reason)
            texts.append("".join(b.text for b in m.content if b.type == "text"))
            msgs.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
            )
            uses = [b for b in m.content if b.type == "tool_use"]
            if uses:
                assert uses[0].input == args
                res = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "a.txt\nb.txt"}
                msgs.append({"role": "user", "content": [res]})
            if user:
                msgs.append({"role": "user", "content": user})
        await client.close()
        trajs = s.proxy.export(h.session_id)
    assert reasons == ["end_turn", "tool_use", "end_turn"] and texts[2] == "Two files."
    assert len(trajs) == 1 and len(trajs[0].turns) == 3
    check_fidelity(trajs, engine, h.session_id)


async def raw(http: httpx.AsyncClient, url: str, body: dict[str, Any], key: str) -> httpx.Response:
    return await http.post(url + "/v1/messages?beta=true", json=body, headers={"x-api-key": key})


def sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def final_blocks(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Rebuild the content blocks of a streamed message the way Claude Code does."""
    blocks: list[dict[str, Any]] = []
    reason = ""
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]) | {"_json": ""})
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] += d["signature"]
        elif e["type"] == "message_delta":
            reason = e["delta"]["stop_reason"]
    for b in blocks:
        js = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = json.loads(js)
    return blocks, reason


async def test_claude_code_shape_reserialized_input_moved_cache_control_system_mid(tok) -> None:
    """tool_use.input comes back compact with its keys reordered, cache_control moves to the newest
    block, a role: system message appears mid-conversation, thinking comes back with its signature."""
    args = {"command": "cat a.txt", "timeout": 10, "description": "read"}
    replies = ["<think>read it</think>\n" + call("Bash", args), "It says hi.", "Bye."]
    engine = ScriptedEngine(tok, replies)
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = root(s, h.session_id)
        assert (await http.head(url + "/")).status_code == 200 and (
            await http.head(s.url + "/")
        ).status_code == 200
        cc = {"type": "ephemeral"}
        body: dict[str, Any] = {
            "model": "claude-sonnet-4-5",
            "max_tokens": 256,
            "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "x" * 300}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "read a.txt", "cache_control": cc}]}
            ],
            "tools": [BASH | {"cache_control": cc}, {"type": "web_search_20250305", "name": "web_search"}],
            "thinking": {"type": "adaptive"},
            "metadata": {"user_id": "u"},
            "context_management": {"edits": []},
            "output_config": {"effort": "high"},
        }
        r1 = await raw(http, url, body, h.api_key)
        assert r1.status_code == 200, r1.text
        blocks, reason = final_blocks(sse_data(r1.text))
        assert reason == "tool_use" and [b["type"] for b in blocks] == ["thinking", "tool_use"]
        use = blocks[1]
        # Claude Code's re-serialization: its own key order, compact; cache_control moved onto the newest block
        use["input"] = {"timeout": 10, "description": "read", "command": "cat a.txt"}
        body["messages"][0]["content"][0].pop("cache_control")
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": "hi", "is_error": False}
        body["messages"] += [
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [result | {"cache_control": cc}]},
        ]
        r2 = await raw(http, url, body, h.api_key)
        blocks2, reason2 = final_blocks(sse_data(r2.text))
        assert reason2 == "end_turn" and blocks2 == [{"type": "text", "text": "It says hi."}]
        body["messages"][-1]["content"][0].pop("cache_control")
        body["messages"] += [
            {"role": "assistant", "content": blocks2},
            {"role": "system", "content": "<system-reminder>be brief</system-reminder>"},
            {"role": "user", "content": [{"type": "text", "text": "bye", "cache_control": cc}]},
        ]
        body["stream"] = False
        r3 = await raw(http, url, body, h.api_key)
        assert r3.status_code == 200 and r3.json()["usage"]["cache_read_input_tokens"] > 0
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 3
    check_fidelity(trajs, engine, h.session_id)
    assert "<|im_start|>system\n<system-reminder>be brief" in tok.decode(trajs[0].token_ids)


async def test_title_request_is_served_flagged_and_not_trained_on(tok) -> None:
    engine = ScriptedEngine(tok, ['{"title": "List files"}', "real answer"])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = root(s, h.session_id)
        fmt = {"type": "json_schema", "schema": {"type": "object"}}
        title = {
            "model": "m",
            "max_tokens": 32,
            "tools": [],
            "messages": [{"role": "user", "content": "list files"}],
            "output_config": {"format": fmt},
        }
        r = await raw(http, url, title, h.api_key)
        assert r.status_code == 200 and r.headers["x-tito-aux"] == "1"
        assert r.json()["content"][0]["text"] == '{"title": "List files"}'
        n = await http.post(
            url + "/v1/messages/count_tokens",
            json={"model": "m", "messages": [{"role": "user", "content": "list files"}]},
            headers={"Authorization": f"Bearer {h.api_key}"},
        )
        assert n.status_code == 200 and n.json()["input_tokens"] > 5
        main = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "list files"}]}
        assert (await raw(http, url, main, h.api_key)).status_code == 200
        info = s.proxy.get_session(h.session_id)
        trajs = s.proxy.export(h.session_id)
    assert info.n_aux == 1 and info.n_turns == 1
    assert len(trajs) == 1 and "title" not in tok.decode(trajs[0].token_ids)


class StopStringEngine(ScriptedEngine):
    """ScriptedEngine plus stop strings the way real engines report them: finish "stop", text kept."""

    async def generate(self, input_ids: Any, sampling: Any, *, session_id: str | None = None) -> Any:
        gen = await super().generate(input_ids, sampling, session_id=session_id)
        text = self.tokenizer.decode(gen.output_ids)
        hit = any(text.endswith(x) for x in sampling.stop)
        return dataclasses.replace(gen, finish_reason="stop") if hit else gen


async def test_stop_reasons_max_tokens_and_stop_sequence(tok) -> None:
    engine = StopStringEngine(tok, ["one two three four five", tok.encode("a END", add_special_tokens=False)])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        client = AsyncAnthropic(base_url=root(s, h.session_id), api_key=h.api_key, max_retries=0)
        m1 = await client.messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "count"}]
        )
        m2 = await client.messages.create(
            model="m", max_tokens=50, stop_sequences=["END"], messages=[{"role": "user", "content": "again"}]
        )
        await client.close()
    assert m1.stop_reason == "max_tokens" and m2.stop_reason == "stop_sequence" and m2.stop_sequence == "END"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "tool_use_id",
        ),
    ],
)
async def test_bad_input_is_an_anthropic_400_and_loses_nothing(
    tok, body: dict[str, Any], needle: str
) -> None:
    engine = ScriptedEngine(tok, ["kept"])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = root(s, h.session_id)
        ok = await raw(
            http, url, {"max_tokens": 5, "messages": [{"role": "user", "content": "a"}]}, h.api_key
        )
        assert ok.status_code == 200
        r = await raw(http, url, body, h.api_key)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and needle in r.json()["error"]["message"]
        bad = await raw(http, url, body | {"max_tokens": 5}, "wrong")
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        not_json = await http.post(url + "/v1/messages", content=b"{", headers={"x-api-key": h.api_key})
        assert not_json.status_code == 400 and not_json.json()["type"] == "error"
        trajs = s.proxy.export(h.session_id)
    assert len(trajs) == 1 and len(trajs[0].turns) == 1


async def test_models_list_parses_in_both_sdks_and_head_answers(tok) -> None:
    async with served(tok) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        a = AsyncAnthropic(base_url=root(s, h.session_id), api_key=h.api_key, max_retries=0)
        page = await a.models.list()
        await a.close()
        listed = await s.client(h.session_id).models.list()
        assert [m.id for m in page.data] == ["policy"] == [m.id for m in listed.data]
        for url in (s.url + "/", root(s, h.session_id), root(s, h.session_id) + "/"):
            assert (await http.head(url)).status_code == 200
        wrong = await http.get(root(s, h.session_id) + "/v1/models", headers={"x-api-key": "no"})
        assert wrong.status_code == 401


async def test_same_tool_use_id_with_other_input_is_an_edit_not_a_match(tok) -> None:
    engine = ScriptedEngine(tok, [call("Bash", {"command": "ls", "timeout": 1}), "a", "b"])
    async with served(tok, engine) as s, httpx.AsyncClient() as http:
        h = s.proxy.create_session()
        url = root(s, h.session_id)
        body: dict[str, Any] = {
            "max_tokens": 100,
            "tools": [BASH],
            "messages": [{"role": "user", "content": "go"}],
        }
        blocks = (await raw(http, url, body, h.api_key)).json()["content"]
        use = blocks[0]
        for inp in ({"timeout": 1, "command": "ls"}, {"command": "rm -rf /", "timeout": 1}):
            res = {"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}
            hist = [*body["messages"], {"role": "assistant", "content": [use | {"input": inp}]}]
            r = await raw(
                http, url, body | {"messages": [*hist, {"role": "user", "content": [res]}]}, h.api_key
            )
            assert r.status_code == 200
        trajs = s.proxy.export(h.session_id)
    # reordered keys: the same turn (stitched); changed values: an edit (a new, fully rendered branch)
    assert [len(t.turns) for t in trajs] == [2, 1]
    assert "rm -rf" in tok.decode(trajs[1].token_ids) and "rm -rf" not in tok.decode(trajs[0].token_ids)
    check_fidelity(trajs, engine, h.session_id)
