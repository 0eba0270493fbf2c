"""The journal's event union (tito/journal.py): every kind round-trips, an unknown kind is refused on
read, and a journal written before the union (tests/journals/pre_union.jsonl) loads, audits clean and
is what today's proxy writes, byte for byte."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.base import Generation, SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import Budget, ChatRequest, Message, TitoConfig, TitoProxy, strictjson
from miles_env.tito.audit import audit
from miles_env.tito.journal import (
    AuxEvent,
    ClosedEvent,
    JournalError,
    SessionHeader,
    TruncatedEvent,
    TurnEvent,
    TurnRecord,
    read_event,
)
from miles_env.tito.store import load_sessions, read_events, replay
from miles_env.types import RoutedExperts

pytestmark = pytest.mark.anyio
FIXTURE = Path(__file__).parent / "journals"
OLD = "pre_union"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _turn(**over: Any) -> TurnEvent:
    base: dict[str, Any] = dict(
        branch=1,
        new_branch=True,
        tools_key="t",
        prompt_ids=[1, 2],
        output_ids=[3, 4, 5],
        logprobs=[float("-inf"), -1e-05, -0.5],
        gen_digest="ab",
        keys=["k1", "k2"],
        turn=TurnRecord(finish_reason="stop", weight_version=2, latency_s=0.25, engine="scripted"),
    )
    return TurnEvent(**{**base, **over})


EVENTS = [
    SessionHeader(
        id="s", api_key="k", metadata={"a": None, "b": "é"}, budget=Budget(max_turns=3), created_at=1.5
    ),
    _turn(),
    _turn(parent=0, fork_keys=2, fork_tokens=7, aliases={"msg_1": "k2"}),
    _turn(gen_digest=None, new_branch=False),  # a journal older than `tito audit`
    _turn(routed_experts=RoutedExperts.pack([[[0, 1]], [[1, 3]], [[2, 3]]])),  # a MoE engine's routing
    TruncatedEvent(reason="max_tokens"),
    AuxEvent(prompt_tokens=4, completion_tokens=2),
    ClosedEvent(),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_every_kind_round_trips_through_its_line(event: Any) -> None:
    line = strictjson.encode(event.wire())
    back = read_event(line)
    assert type(back) is type(event)
    assert back.wire() == event.wire() and strictjson.encode(back.wire()) == line
    if isinstance(event, TurnEvent):  # the hand-written wire form is pydantic's own, minus unset options
        assert event.wire() == event.model_dump(exclude_none=True)
        assert back.logprobs[0] == float("-inf") and b'"-Infinity"' in line
        assert (b'"parent"' in line) is (event.parent is not None) and b"null" not in line


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"kind":"rollback","branch":0}', "unknown event kind 'rollback' (known: aux, closed, session"),
        (b'{"reason":"max_turns"}', "an event without 'kind'"),
        (b'{"kind":"closed","why":"x"}', "closed event: why: Extra inputs are not permitted"),
        (b'{"kind":"aux","prompt_tokens":"many","completion_tokens":1}', "aux event: prompt_tokens: "),
        (b'{"kind":"turn","branch":0}', "turn event: new_branch: Field required (and 6 more)"),
        (b'{"kind":"truncated","reas', "a journal line is not JSON"),
        (b"[1, 2]", "an event must be a JSON object"),
    ],
)
def test_a_bad_line_is_refused_with_a_one_line_reason(line: bytes, message: str) -> None:
    with pytest.raises(JournalError) as info:
        read_event(line)
    assert message in str(info.value) and "\n" not in str(info.value)


def _store(tmp_path: Path) -> Path:
    for suffix in (".jsonl", ".export.json"):
        shutil.copy(FIXTURE / f"{OLD}{suffix}", tmp_path / f"{OLD}{suffix}")
    return tmp_path


def test_an_unknown_kind_in_a_store_names_the_file_and_the_place(tmp_path: Path) -> None:
    store = _store(tmp_path)
    journal = store / f"{OLD}.jsonl"
    good = journal.read_bytes()
    journal.write_bytes(good + b'{"kind":"rollback"}\n')
    with pytest.raises(JournalError, match=rf"{OLD}\.jsonl: byte {len(good)}: unknown event kind 'rollback'"):
        load_sessions(store)
    report = audit(store)  # the audit reports it as drift instead of raising
    assert report.by_kind() == {"journal": 1} and "unknown event kind" in report.drifts[0].detail


def test_the_pre_union_journal_loads_and_audits_clean(tmp_path: Path) -> None:
    store = _store(tmp_path)
    lines = (store / f"{OLD}.jsonl").read_bytes().splitlines()
    events = [read_event(x) for x in lines]
    kinds = "session turn turn turn aux turn truncated closed"
    assert [e.kind for e in events] == kinds.split()
    assert [strictjson.encode(e.wire()) for e in events] == lines  # read back, written again: same bytes
    s = load_sessions(store)["145d05ffc3899418"]
    i = s.info()
    assert (i.n_turns, i.n_branches, i.n_aux, i.truncated, i.closed) == (4, 3, 1, "max_turns", True)
    assert s.branches[1].parent == 0 and s.aliases == {"msg_0123abcd": s.branches[1].keys[-1]}
    assert s.branches[0].logprobs[s.branches[0].turns[0].start] == float("-inf")
    report = audit(store)
    assert report.ok and (report.turns, report.snapshots) == (4, 1), report.drifts


def test_a_turn_without_gen_digest_still_loads(tmp_path: Path) -> None:
    """Journals written before `tito audit` have no gen_digest: loaded, and their record is not checked."""
    store = _store(tmp_path)
    journal = store / f"{OLD}.jsonl"
    journal.write_bytes(re.sub(rb',"gen_digest":"[0-9a-f]+"', b"", journal.read_bytes()))
    assert b"gen_digest" not in journal.read_bytes()
    assert audit(store).ok and load_sessions(store)["145d05ffc3899418"].n_turns == 4


def test_read_events_leaves_a_torn_line_alone_and_load_cuts_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    journal = store / f"{OLD}.jsonl"
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"kind":"turn","bra')  # a crash mid-write
    session = replay(read_events(journal))  # the viewer's and the audit's way: read-only
    assert session is not None and session.n_turns == 4 and journal.read_bytes().endswith(b'"bra')
    assert load_sessions(store)[session.id].n_turns == 4 and journal.read_bytes() == whole  # the proxy's way


class _OddLogprobs(ScriptedEngine):
    """The engine the fixture was written with: a -inf and a 1e-05 logprob in every turn."""

    async def generate(
        self, input_ids: Any, sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        g = await super().generate(input_ids, sampling, session_id=session_id)
        lps = [float("-inf"), -1e-05, *g.logprobs[2:]][: len(g.logprobs)]
        return replace(g, logprobs=lps)


async def test_the_proxy_writes_the_pre_union_bytes(tok: Any, tmp_path: Path) -> None:
    """The fixture's scenario again: the same lines but for the session's id, key, time and latencies."""
    engine = _OddLogprobs(tok, ["answer one", "answer two", "answer two again", "a title", "three"])
    p = TitoProxy(engine, tok, TitoConfig(budget=Budget(max_turns=4)), store_dir=tmp_path)
    h = p.create_session(metadata={"task_id": "t1", "note": "é ✓", "n": None})
    u1, u2 = Message("user", "q1"), Message("user", "q2")
    r = await p.chat(h.session_id, ChatRequest(messages=(u1,)))
    a1 = Message("assistant", r.content or "")
    await p.chat(h.session_id, ChatRequest(messages=(u1, a1, u2)))
    await p.chat(h.session_id, ChatRequest(messages=(u1, a1, u2), reply_id="msg_0123abcd"))  # fork + alias
    await p.chat(h.session_id, ChatRequest(messages=(Message("user", "title?"),), aux=True))
    await p.chat(h.session_id, ChatRequest(messages=(u1,)))
    with pytest.raises(Exception, match="max_turns"):
        await p.chat(h.session_id, ChatRequest(messages=(u1,)))
    p.close_session(h.session_id)

    old = (FIXTURE / f"{OLD}.jsonl").read_bytes()
    new = (tmp_path / f"{h.session_id}.jsonl").read_bytes()
    old_header = read_event(old.split(b"\n", 1)[0])
    assert isinstance(old_header, SessionHeader)
    new = new.replace(h.session_id.encode(), old_header.id.encode()).replace(
        h.api_key.encode(), old_header.api_key.encode()
    )
    new = re.sub(rb'"created_at":[0-9.e+-]+', f'"created_at":{old_header.created_at!r}'.encode(), new)
    latencies = iter(re.findall(rb'"latency_s":[0-9.e+-]+', old))
    new = re.sub(rb'"latency_s":[0-9.e+-]+', lambda _: next(latencies), new)
    # the one event kind the first journals did not have: the retried turn 2 (a request asking for
    # it again) is marked undelivered, between the turns; every other line is byte for byte the same
    lines = new.splitlines()
    assert lines.pop(3) == b'{"kind":"undelivered","branch":0,"start":47,"reason":"retried"}'
    assert lines == old.splitlines()
