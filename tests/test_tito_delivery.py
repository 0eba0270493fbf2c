"""A token the agent never received never trains (INVARIANTS.md, "Token fidelity").

With the official clients on a served proxy (uvicorn on loopback), in all three dialects,
streaming and not: a turn held past the client's timeout is sampled and stored, the client gives
up and retries, and the first sampling is marked undelivered (`client_gone`, or `retried` when the
retry is planned first): it stays in the journal and `tito audit` (which counts it and finds no
drift), and it has mask 0 and logprob 0.0 in every exported sample, its Turn listed with
`delivered=False`; the retry's turn trains. A client that leaves mid-stream (an ASGI server
double that reports the disconnect after the first body chunk, as uvicorn does) leaves its turn
`stream_cut`. A served reply that reaches its client is delivered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from miles_env.engines.base import Generation, SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import TitoConfig, TitoProxy, create_app
from miles_env.tito.audit import audit
from tests.tito_support import check_fidelity, served

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("smollm2")


class _Held(ScriptedEngine):
    """Holds its first generation `hold_s` (past the client's timeout), then answers at once."""

    hold_s = 2.0

    async def generate(
        self, input_ids: Any, sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if not self.generations:
            await anyio.sleep(self.hold_s)
        return await super().generate(input_ids, sampling, session_id=session_id)


async def _chat(url: str, key: str, stream: bool) -> str:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key=key, timeout=1.0, max_retries=1) as c:
        msgs: Any = [{"role": "user", "content": "say hi"}]
        if not stream:
            r = await c.chat.completions.create(model="policy", messages=msgs)
            return r.choices[0].message.content or ""
        parts = [ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
            model="policy", messages=msgs, stream=True) if ch.choices]  # fmt: skip
        return "".join(parts)


async def _responses(url: str, key: str, stream: bool) -> str:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key=key, timeout=1.0, max_retries=1) as c:
        if not stream:
            return (await c.responses.create(model="policy", input="say hi")).output_text
        done = [e async for e in await c.responses.create(model="policy", input="say hi", stream=True)]
        return "".join(e.delta for e in done if e.type == "response.output_text.delta")


async def _messages(root: str, key: str, stream: bool) -> str:
    from anthropic import AsyncAnthropic

    async with AsyncAnthropic(base_url=root, api_key=key, timeout=1.0, max_retries=1) as c:
        msgs: Any = [{"role": "user", "content": "say hi"}]
        if not stream:
            r = await c.messages.create(model="policy", max_tokens=32, messages=msgs)
            return "".join(b.text for b in r.content if b.type == "text")
        async with c.messages.stream(model="policy", max_tokens=32, messages=msgs) as s:
            return "".join([t async for t in s.text_stream])


CLIENTS = {"chat": _chat, "responses": _responses, "messages": _messages}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_turn_held_past_the_clients_timeout_is_kept_and_never_trains(
    tok: Any, tmp_path: Path, stream: bool
) -> None:
    """Each dialect's official client, once in one test per mode: first sampling held, retried."""
    engine = _Held(tok, default_reply="hello there")
    async with served(tok, engine, store_dir=tmp_path) as s:
        sids = []
        for dialect, ask in CLIENTS.items():
            sid = s.proxy.create_session(metadata={"dialect": dialect}).session_id
            ep = s.proxy.endpoint(sid, s.url)
            engine.generations.clear()  # hold each dialect's first generation again
            got = await ask(ep.root_url if dialect == "messages" else ep.base_url, ep.api_key, stream)
            assert got == "hello there", dialect
            with anyio.fail_after(5):
                while s.proxy.get_session(sid).n_undelivered == 0:  # the held reply's send comes after
                    await anyio.sleep(0.02)
            sids.append(sid)
            first, retry = s.proxy.export(sid)
            assert [t.delivered for t in first.turns] == [False] and sum(first.loss_mask) == 0, dialect
            assert [t.delivered for t in retry.turns] == [True] and sum(retry.loss_mask) > 0, dialect
            reason = s.proxy._session(sid).undelivered[(0, first.turns[0].start)]
            assert reason in ("client_gone", "retried"), (dialect, reason)
            check_fidelity([first, retry], engine, sid)
    report = audit(tmp_path)
    assert report.ok, report.drifts
    assert report.sessions == 3 and report.undelivered == 3 and report.turns == 6


class _AsgiServer:
    """An ASGI server double: the request, then the client leaves once `leave_after` body chunks
    were sent (its `receive` says http.disconnect from then on; what is sent after is dropped, as
    uvicorn drops it)."""

    def __init__(self, body: dict[str, Any], leave_after: int) -> None:
        self.body, self.leave_after = json.dumps(body).encode(), leave_after
        self.read, self.chunks = False, 0
        self.sent: list[dict[str, Any]] = []
        self.left = anyio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self.left.is_set():  # as uvicorn: a disconnect it has seen is returned at once
            await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.left.is_set():
            return
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.chunks += 1
            if self.chunks >= self.leave_after:
                self.left.set()

    async def call(self, app: Any, path: str, key: str) -> None:
        headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
        await app(scope, self.receive, self.send)


async def test_a_client_that_leaves_mid_stream_cuts_its_turn(tok: Any) -> None:
    engine = ScriptedEngine(tok, default_reply="a long answer " * 20)
    proxy = TitoProxy(engine, tok, TitoConfig())
    app = create_app(proxy)
    msg = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    outcomes = {}
    for leave_after, stream in ((2, True), (10_000, True), (10_000, False)):
        sid = proxy.create_session().session_id
        server = _AsgiServer({**msg, "stream": stream}, leave_after)
        await server.call(app, f"/s/{sid}/v1/chat/completions", proxy.endpoint(sid, "http://x").api_key)
        (t,) = proxy.export(sid)
        outcomes[(leave_after, stream)] = (
            t.turns[0].delivered,
            proxy._session(sid).undelivered,
            server.chunks,
        )
    cut, whole, json_reply = outcomes.values()
    assert cut[0] is False and list(cut[1].values()) == ["stream_cut"] and cut[2] == 2
    assert whole[0] is True and not whole[1] and whole[2] > 2  # read to the end: delivered
    assert json_reply[0] is True and not json_reply[1] and json_reply[2] == 1


async def test_a_client_gone_before_the_reply_is_client_gone_and_stores_the_turn(tok: Any) -> None:
    """The raw way a held turn ends: the client hangs up while the engine samples; the turn is
    still stored (shielded), marked client_gone, and the session goes on."""
    engine = _Held(tok, default_reply="late")
    engine.hold_s = 0.5
    async with served(tok, engine) as s:
        sid = s.proxy.create_session().session_id
        ep = s.proxy.endpoint(sid, s.url)
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"authorization": f"Bearer {ep.api_key}"}
        async with httpx.AsyncClient(timeout=0.1) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(f"{ep.base_url}/chat/completions", json=body, headers=headers)
        with anyio.fail_after(5):
            while not s.proxy._session(sid).undelivered:
                await anyio.sleep(0.02)
        assert list(s.proxy._session(sid).undelivered.values()) == ["client_gone"]
        async with httpx.AsyncClient(timeout=5) as c:  # a different question: no retry, delivered
            body["messages"] = [{"role": "user", "content": "hello"}]
            r = await c.post(f"{ep.base_url}/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        a, b = s.proxy.export(sid)
        assert (a.turns[0].delivered, b.turns[0].delivered) == (False, True)
        assert s.proxy.get_session(sid).n_undelivered == 1


@pytest.mark.slow
async def test_claude_code_retries_a_held_turn_and_the_first_sampling_never_trains(
    tok: Any, tmp_path: Path
) -> None:
    """The real Claude Code CLI (its pinned version, in the bwrap sandbox): its first turn is held
    past the CLI's request timeout (API_TIMEOUT_MS), the CLI gives up and sends the same request
    again; the held sampling stays in the journal and the audit and has mask 1 in no sample, the
    retry's turn ends the episode and trains."""
    from miles_env.harnesses._cli import CLAUDE_CODE
    from tests.cli_harness_support import require_cli, run_one, task_for

    require_cli(CLAUDE_CODE)
    engine = _Held(tok, default_reply="Done.", max_context=1 << 20)
    engine.hold_s = 6.0
    store = tmp_path / "store"
    ep = await run_one(
        "claude-code",
        engine,
        store,
        task_for(CLAUDE_CODE),
        budget_s=120,
        extra_env={"API_TIMEOUT_MS": "3000"},
    )
    assert ep.end.value == "completed", (ep.end, ep.error)
    turns = [t for s in ep.samples for t in s.turns]
    held, trained = [t for t in turns if not t.delivered], [t for t in turns if t.delivered]
    # the held one (and any retry that came back after the CLI gave up on it too) is kept, untrained
    assert held and held[0].latency_s >= engine.hold_s and len(turns) == len(engine.generations)
    assert len(trained) == 1 and sum(s.n_sampled for s in ep.samples) == trained[0].completion_len
    report = audit(store)
    assert report.ok and report.undelivered == len(held), report.drifts
    reasons = [
        json.loads(x)["reason"]
        for x in next(store.glob("*.jsonl")).read_text().splitlines()
        if '"undelivered"' in x
    ]
    assert set(reasons) <= {"client_gone", "retried"} and len(reasons) == len(held), reasons
