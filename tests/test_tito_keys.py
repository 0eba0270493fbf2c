"""Message keys: scheme 2 (sha256 of raw fields), scheme 1 kept for journals written with it, and
in-line versus threaded planning (a small request skips the thread hop, a large one takes it)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import TitoConfig, TitoProxy, messages
from miles_env.tito.config import Budget
from miles_env.tito.messages import ChatRequest, Message, ToolCall, message_key, message_key_v1
from miles_env.tito.plan import Seen, request_keys, session_key
from miles_env.tito.session import Session

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_scheme_2_keys_separate_their_fields() -> None:
    keys = {
        message_key(Message("user", "a\x00b")),
        message_key(Message("user", "b", tool_call_id="a")),
        message_key(Message("tool", "", tool_call_id="")),
        message_key(Message("tool", "")),
        message_key(Message("assistant", " x ")),
        message_key(Message("user", " x ")),
        message_key(Message("assistant", "", (ToolCall("c1", "f", '{"a": 1}'),))),
    }
    assert len(keys) == 7 and {len(k) for k in keys} == {64}
    assert message_key(Message("assistant", " x\n")) == message_key(Message("assistant", "x"))
    same = (ToolCall("c1", "f", '{"b":2, "a": 1}'),), (ToolCall("c1", "f", '{"a":1,"b":2}'),)
    assert message_key(Message("assistant", "", same[0])) == message_key(Message("assistant", "", same[1]))
    assert len(message_key_v1(Message("user", "x"))) == 32


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=300), st.integers(1, 40), st.integers(1, 64))
def test_scheme_2_keys_of_long_texts_do_not_depend_on_the_slicing(text: str, reps: int, chunk: int) -> None:
    big = text * reps
    whole = message_key(Message("user", big))
    with mock.patch.object(messages, "_CHUNK", chunk):  # long strings are hashed in slices of `chunk`
        assert message_key(Message("user", big)) == whole


async def _turn(proxy: TitoProxy, sid: str, conv: list[Message], text: str) -> int:
    conv.append(Message("user", text))
    r = await proxy.chat(sid, ChatRequest(tuple(conv)))
    conv.append(Message("assistant", r.text))
    return r.cached_tokens


async def test_a_journal_written_with_scheme_1_keys_keeps_stitching_after_a_restart(
    tok, tmp_path: Path
) -> None:
    engine = ScriptedEngine(tok)
    with mock.patch.object(messages, "message_key", message_key_v1):  # the proxy as it was before scheme 2
        old = TitoProxy(engine, tok, TitoConfig(), store_dir=tmp_path)
        h = old.create_session()
        conv: list[Message] = []
        await _turn(old, h.session_id, conv, "first")
        await _turn(old, h.session_id, conv, "second")
    events = [json.loads(x) for x in (tmp_path / f"{h.session_id}.jsonl").read_text().splitlines()]
    assert {len(k) for e in events if e["kind"] == "turn" for k in e["keys"]} == {32}

    new = TitoProxy(engine, tok, TitoConfig(), store_dir=tmp_path)  # scheme 2 now; the journal reloaded
    assert await _turn(new, h.session_id, conv, "third") > 0  # extends the stored branch
    assert new.get_session(h.session_id).n_branches == 1
    retried = conv[:-2]  # the second turn again: a fork at a scheme-1 turn end
    assert await _turn(new, h.session_id, retried, "second, retried") > 0
    assert new.get_session(h.session_id).n_branches == 2
    events = [json.loads(x) for x in (tmp_path / f"{h.session_id}.jsonl").read_text().splitlines()]
    # one scheme per session: the fork's keys are scheme 1 too
    assert {len(k) for e in events if e["kind"] == "turn" for k in e["keys"]} == {32}

    fresh = new.create_session()
    conv2: list[Message] = []
    await _turn(new, fresh.session_id, conv2, "first")
    assert await _turn(new, fresh.session_id, conv2, "second") > 0
    events = [json.loads(x) for x in (tmp_path / f"{fresh.session_id}.jsonl").read_text().splitlines()]
    assert {len(k) for e in events if e["kind"] == "turn" for k in e["keys"]} == {64}


async def test_small_requests_are_planned_in_line_and_large_ones_in_a_thread(tok) -> None:
    proxy = TitoProxy(ScriptedEngine(tok, max_context=65536), tok, TitoConfig())
    h = proxy.create_session()
    hops: list[int] = []
    real = anyio.to_thread.run_sync

    async def counted(fn, *args, **kw):  # type: ignore[no-untyped-def]
        hops.append(1)
        return await real(fn, *args, **kw)

    conv: list[Message] = []
    with mock.patch.object(anyio.to_thread, "run_sync", counted):
        await _turn(proxy, h.session_id, conv, "hello")
        await _turn(proxy, h.session_id, conv, "a short tail")
        assert hops == []
        await _turn(proxy, h.session_id, conv, "word " * 2000)  # a 10K-character tail: rendered off the loop
        assert len(hops) == 1
        big = proxy.create_session()  # 200K characters of history: hashed off the loop
        await _turn(proxy, big.session_id, [Message("user", "word " * 40_000)], "go")
        assert len(hops) == 2


def test_keys_reused_from_the_previous_request_are_the_keys_themselves() -> None:
    s = Session("sid", "key", {}, Budget(), 0.0)
    first = ChatRequest((Message("system", "be brief"), Message("user", "hi"), Message("assistant", "hello")))
    seen = Seen(first.messages, request_keys(s, first), session_key(s))
    edited = (
        Message("system", "be brief"),
        Message("user", "hi!"),
        Message("assistant", "hello"),
        Message("user", "go"),
    )
    s.aliases["msg_1"] = "k-alias"
    with_id = (*edited[:2], Message("assistant", "hello", id="msg_1"), edited[3])
    for msgs in (first.messages, edited, edited[:1], with_id, (*edited, *edited)):
        req = ChatRequest(msgs)
        assert request_keys(s, req, seen) == request_keys(s, req)
    assert request_keys(s, ChatRequest(with_id), seen)[2] == "k-alias"
