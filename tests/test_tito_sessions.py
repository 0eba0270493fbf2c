"""Session isolation under concurrency, persistence across restarts, and the real HF engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.http import free_port
from miles_env.models import load_tokenizer
from miles_env.tito import TitoConfig, TitoProxy
from tests.tito_support import ADMIN, TOOLS, RecordingEngine, check_fidelity, served

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_sixteen_concurrent_sessions_never_see_each_other(tok) -> None:
    engine = ScriptedEngine(tok, delay_s=0.002)
    async with served(tok, engine) as s:
        handles = [s.proxy.create_session(metadata={"i": i}) for i in range(16)]
        for i, h in enumerate(handles):
            call = f'<tool_call>{{"name": "bash", "arguments": {{"command": "echo {i}"}}}}</tool_call>'
            engine.push(f"session {i} first", call, f"session {i} done", session_id=h.session_id)

        async def run(i: int) -> None:
            h = handles[i]
            c = s.client(h.session_id)
            msgs: list = [{"role": "user", "content": f"task {i}"}]
            for _ in range(3):
                r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
                m = r.choices[0].message
                msgs.append(m.model_dump(exclude_none=True))
                if m.tool_calls:
                    msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"out {i}"})
                else:
                    msgs.append({"role": "user", "content": f"continue {i}"})
            assert msgs[-2]["content"] == f"session {i} done"

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(run, i)
        for i, h in enumerate(handles):
            trajs = s.proxy.export(h.session_id)
            assert len(trajs) == 1 and len(trajs[0].turns) == 3
            check_fidelity(trajs, engine, h.session_id)
            text = tok.decode(trajs[0].token_ids)
            others = [j for j in range(16) if j != i]
            assert f"task {i}<" in text and f"out {i}\n" in text
            assert not any(f"session {j} " in text or f"task {j}<" in text for j in others)


async def test_state_survives_a_restart_and_the_session_continues(tok, tmp_path: Path) -> None:
    engine = ScriptedEngine(tok, ["first", "second", "third"])
    async with served(tok, engine, store_dir=tmp_path) as s:
        h = s.proxy.create_session(metadata={"k": "v"})
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "a"}]
        r = await c.chat.completions.create(model="policy", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "b"},
        ]
        r = await c.chat.completions.create(model="policy", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "c"},
        ]
        before = s.proxy.export(h.session_id)
    # a new proxy process-equivalent on the same store: same trajectory, same key, stitching continues
    async with served(tok, engine, store_dir=tmp_path) as s2:
        assert s2.proxy.export(h.session_id) == before
        assert s2.proxy.get_session(h.session_id).metadata == {"k": "v"}
        async with httpx.AsyncClient(base_url=s2.url) as http:
            tr = await http.get(
                f"/admin/sessions/{h.session_id}/trajectory", headers={"Authorization": f"Bearer {ADMIN}"}
            )
        assert [b["token_ids"] for b in tr.json()["branches"]] == [t.token_ids for t in before]
        r = await s2.client(h.session_id).chat.completions.create(model="policy", messages=msgs)
        assert r.usage is not None and r.usage.prompt_tokens_details.cached_tokens == len(before[0].token_ids)
        after = s2.proxy.export(h.session_id)
    assert len(after) == 1 and after[0].token_ids[: len(before[0].token_ids)] == before[0].token_ids
    check_fidelity(after, engine, h.session_id)


async def test_a_torn_last_journal_line_is_dropped(tok, tmp_path: Path) -> None:
    engine = ScriptedEngine(tok, ["x", "y"])
    proxy = TitoProxy(engine, tok, TitoConfig(), store_dir=tmp_path)
    h = proxy.create_session()
    from miles_env.tito.messages import ChatRequest, Message

    await proxy.chat(h.session_id, ChatRequest((Message("user", "q"),)))
    good = proxy.export(h.session_id)
    journal = tmp_path / f"{h.session_id}.jsonl"
    with journal.open("ab") as f:
        f.write(b'{"kind":"turn","branch":0,"new_br')  # a crash mid-write
    reloaded = TitoProxy(engine, tok, TitoConfig(), store_dir=tmp_path)
    assert reloaded.export(h.session_id) == good
    proxy.close_session(h.session_id)
    assert h.session_id not in TitoProxy(engine, tok, TitoConfig(), store_dir=tmp_path).session_ids()


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"proxy serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        import time

        time.sleep(0.1)
    raise AssertionError("proxy serve did not come up")


@pytest.mark.slow
def test_proxy_serve_cli_keeps_trajectories_across_a_restart(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "miles_env.cli.main", "proxy", "serve", "--engine", "scripted"]
    cmd += ["--port", str(port), "--store", str(tmp_path)]
    env = {**os.environ, "MILES_ENV_ADMIN_TOKEN": ADMIN}
    adm = {"Authorization": f"Bearer {ADMIN}"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_up(url, proc)
        info = httpx.post(f"{url}/admin/sessions", json={}, headers=adm).json()
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(
            f"{info['base_url']}/chat/completions", json=body, headers={"x-api-key": info["api_key"]}
        )
        assert r.status_code == 200, r.text
        first = httpx.get(f"{url}/admin/sessions/{info['session_id']}/trajectory", headers=adm).json()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_up(url, proc)
        again = httpx.get(f"{url}/admin/sessions/{info['session_id']}/trajectory", headers=adm).json()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert again == first and json.dumps(first["branches"][0]["loss_mask"]).count("1") > 0


@pytest.mark.slow
@pytest.mark.model
async def test_real_hf_engine_session_is_token_exact(tok) -> None:
    from miles_env.engines import HFEngineConfig, build_engine

    inner = await build_engine(HFEngineConfig(max_batch_size=2))
    engine = RecordingEngine(inner)
    try:
        async with served(tok, engine) as s:  # type: ignore[arg-type]
            h = s.proxy.create_session()
            c = s.client(h.session_id)
            msgs: list = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
            for follow in ("And 3+3?", "Thanks."):
                r = await c.chat.completions.create(
                    model="policy", messages=msgs, max_tokens=12, temperature=0
                )
                msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""}]
                msgs += [{"role": "user", "content": follow}]
            trajs = s.proxy.export(h.session_id)
    finally:
        await engine.close()
    assert len(trajs) == 1 and len(trajs[0].turns) == 2
    check_fidelity(trajs, engine, h.session_id)


async def test_aux_requests_are_served_but_never_stored_and_count_tokens_matches(tok) -> None:
    from miles_env.tito.messages import ChatRequest, Message

    engine = ScriptedEngine(tok, ["real answer", "A title", "next"])
    proxy = TitoProxy(engine, tok, TitoConfig())
    h = proxy.create_session()
    first = (Message("user", "q"),)
    await proxy.chat(h.session_id, ChatRequest(first))
    title = await proxy.chat(h.session_id, ChatRequest((Message("user", "title this"),), aux=True))
    assert title.text == "A title" and title.meta == {"aux": True}
    before = proxy.export(h.session_id)
    assert len(before) == 1 and len(before[0].turns) == 1
    nxt = ChatRequest((*first, Message("assistant", "real answer"), Message("user", "more")))
    n = await proxy.count_tokens(h.session_id, nxt)
    res = await proxy.chat(h.session_id, nxt)
    assert res.prompt_tokens == n and res.cached_tokens == len(before[0].token_ids)
    assert len(proxy.export(h.session_id)) == 1 and proxy.get_session(h.session_id).n_turns == 2
