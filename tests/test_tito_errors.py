"""Bad inputs, auth, budgets and disconnects: clear 4xx errors, nothing stored lost, the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import Budget
from tests.tito_support import ADMIN, served

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _chat(sid: str) -> str:
    return f"/s/{sid}/v1/chat/completions"


OK_BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def _err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_bad_requests_get_openai_errors_and_nothing_is_lost(tok) -> None:
    async with served(tok) as s, httpx.AsyncClient(base_url=s.url) as http:
        h = s.proxy.create_session()
        auth = {"Authorization": f"Bearer {h.api_key}"}
        r = await http.post(_chat(h.session_id), json=OK_BODY, headers=auth)
        assert r.status_code == 200
        before = s.proxy.export(h.session_id)

        _err(await http.post(_chat(h.session_id), content=b"{not json", headers=auth), 400, "invalid_json")
        _err(await http.post(_chat(h.session_id), json=[1, 2], headers=auth), 400, "invalid_request")
        e = _err(
            await http.post(_chat(h.session_id), json={"model": "m"}, headers=auth), 400, "invalid_request"
        )
        assert e["param"] == "messages"
        bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
        e = _err(await http.post(_chat(h.session_id), json=bad_role, headers=auth), 400)
        assert e["param"].startswith("messages.0.role")
        image = {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        }
        e = _err(await http.post(_chat(h.session_id), json=image, headers=auth), 400)
        assert e["param"] == "messages[0].content[0]"
        _err(await http.post(_chat(h.session_id), json={**OK_BODY, "max_tokens": 0}, headers=auth), 400)
        _err(await http.post(_chat("nope"), json=OK_BODY, headers=auth), 404, "not_found")
        _err(
            await http.post(_chat(h.session_id), json=OK_BODY, headers={"x-api-key": "wrong"}),
            401,
            "invalid_api_key",
        )
        _err(await http.post(_chat(h.session_id), json=OK_BODY), 401)
        _err(await http.get("/no/such/route"), 404)

        assert s.proxy.export(h.session_id) == before
        r = await http.post(_chat(h.session_id), json=OK_BODY, headers={"x-api-key": h.api_key})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "OK"
        r = await http.get(f"/s/{h.session_id}/v1/models", headers=auth)
        assert r.json()["data"][0]["id"] == "policy"


async def test_openai_client_sees_typed_errors(tok) -> None:
    async with served(tok) as s:
        h = s.proxy.create_session()
        good = s.client(h.session_id)
        wrong = openai.AsyncOpenAI(base_url=good.base_url, api_key="bad", max_retries=0)
        try:
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "x"}]
                )
        finally:
            await wrong.close()
        gone = openai.AsyncOpenAI(base_url=f"{s.url}/s/missing/v1", api_key=h.api_key, max_retries=0)
        try:
            with pytest.raises(openai.NotFoundError):
                await gone.models.list()
        finally:
            await gone.close()
        models = await good.models.list()
        assert [m.id for m in models.data] == ["policy"]


async def test_budgets_tell_the_client_and_truncate_the_session(tok) -> None:
    engine = ScriptedEngine(tok, max_context=4096)
    async with served(tok, engine) as s, httpx.AsyncClient(base_url=s.url) as http:
        # max_turns
        h = s.proxy.create_session(budget=Budget(max_turns=1))
        hdr = {"x-api-key": h.api_key}
        assert (await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr)).status_code == 200
        e = _err(await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr), 400, "budget_exceeded")
        assert "max_turns" in e["message"] and s.proxy.get_session(h.session_id).truncated == "max_turns"
        assert len(s.proxy.export(h.session_id)[0].turns) == 1

        # max_tokens: cut mid-generation with finish_reason "length", then refused
        h = s.proxy.create_session(budget=Budget(max_tokens=5))
        hdr = {"x-api-key": h.api_key}
        engine.push("one two three four five six seven eight", session_id=h.session_id)
        r = await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 5
        assert s.proxy.get_session(h.session_id).truncated == "max_tokens"
        e = _err(await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr), 400, "budget_exceeded")
        assert "max_tokens" in e["message"]

        # context: a prompt that leaves no room is refused; one that leaves a little is capped
        h = s.proxy.create_session(budget=Budget(max_context=64))
        hdr = {"x-api-key": h.api_key}
        long = {"messages": [{"role": "user", "content": "word " * 100}]}
        e = _err(await http.post(_chat(h.session_id), json=long, headers=hdr), 400, "context_length_exceeded")
        assert "64" in e["message"] and s.proxy.get_session(h.session_id).truncated == "max_context"
        assert s.proxy.export(h.session_id) == []
        engine.push("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, session_id=h.session_id)
        r = await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr)
        (t,) = s.proxy.export(h.session_id)
        assert r.json()["choices"][0]["finish_reason"] == "length" and len(t.token_ids) == 64

        # wall time
        h = s.proxy.create_session(budget=Budget(wall_time_s=0.01))
        import anyio

        await anyio.sleep(0.05)
        e = _err(await http.post(_chat(h.session_id), json=OK_BODY, headers={"x-api-key": h.api_key}), 400)
        assert e["code"] == "budget_exceeded" and "wall_time_s" in e["message"]


class _FailingEngine(ScriptedEngine):
    """Failure injection: the engine dies on demand."""

    fail = False

    async def generate(self, input_ids, sampling, *, session_id=None):
        if self.fail:
            raise RuntimeError("engine went away")
        return await super().generate(input_ids, sampling, session_id=session_id)


async def test_engine_failure_is_a_5xx_and_stores_nothing(tok) -> None:
    engine = _FailingEngine(tok)
    async with served(tok, engine) as s, httpx.AsyncClient(base_url=s.url) as http:
        h = s.proxy.create_session()
        hdr = {"x-api-key": h.api_key}
        assert (await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr)).status_code == 200
        engine.fail = True
        _err(await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr), 502, "engine_error")
        engine.fail = False
        assert len(s.proxy.export(h.session_id)[0].turns) == 1
        assert (await http.post(_chat(h.session_id), json=OK_BODY, headers=hdr)).status_code == 200


async def test_client_disconnect_mid_stream_keeps_the_turn(tok) -> None:
    engine = ScriptedEngine(tok, ["word " * 200, "after"])
    async with served(tok, engine) as s:
        h = s.proxy.create_session()
        hdr = {"x-api-key": h.api_key}
        body = {**OK_BODY, "stream": True}
        async with httpx.AsyncClient(base_url=s.url) as http:
            async with http.stream("POST", _chat(h.session_id), json=body, headers=hdr) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # hang up after the first event
        (t,) = s.proxy.export(h.session_id)
        assert t.turns[0].completion_len == len(engine.generations[0].output_ids) > 200
        c = s.client(h.session_id)
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]
        r2 = await c.chat.completions.create(
            model="policy", messages=[*msgs, {"role": "user", "content": "x"}]
        )
        assert r2.choices[0].message.content == "after"
        assert len(s.proxy.export(h.session_id)) == 1  # the resent history extended the kept turn


async def test_admin_api(tok) -> None:
    async with served(tok) as s, httpx.AsyncClient(base_url=s.url) as http:
        _err(await http.post("/admin/sessions", json={}), 401)
        _err(await http.post("/admin/sessions", json={}, headers={"Authorization": "Bearer nope"}), 401)
        adm = {"Authorization": f"Bearer {ADMIN}"}
        _err(await http.post("/admin/sessions", json={"budget": {"max_turns": 0}}, headers=adm), 400)
        _err(await http.post("/admin/sessions", json={"extra": 1}, headers=adm), 400)
        r = await http.post(
            "/admin/sessions", json={"metadata": {"task": "t1"}, "budget": {"max_turns": 3}}, headers=adm
        )
        assert r.status_code == 200
        info = r.json()
        assert info["base_url"] == f"{s.url}/s/{info['session_id']}/v1"
        oa = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0)
        try:
            await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        finally:
            await oa.close()
        sid = info["session_id"]
        _err(await http.get(f"/admin/sessions/{sid}/trajectory"), 401)
        tr = (await http.get(f"/admin/sessions/{sid}/trajectory", headers=adm)).json()
        assert tr["metadata"] == {"task": "t1"} and len(tr["branches"]) == 1
        b = tr["branches"][0]
        assert (
            len(b["token_ids"]) == len(b["loss_mask"]) == len(b["logprobs"])
            and b["turns"][0]["completion_len"] == 2
        )
        assert s.proxy.get_session(sid).budget.max_turns == 3
        assert (await http.delete(f"/admin/sessions/{sid}", headers=adm)).status_code == 200
        _err(await http.get(f"/admin/sessions/{sid}/trajectory", headers=adm), 404)
        _err(await http.post(_chat(sid), json=OK_BODY, headers={"x-api-key": info["api_key"]}), 404)
