"""Prefix breaks become branches: forks copy the parent's ids verbatim, each sampled token is owned once,
the branch policy picks what is exported, and the journal replays all of it."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import ChatRequest, Message, TitoConfig, TitoProxy
from tests.tito_support import check_fidelity

pytestmark = pytest.mark.anyio

U1, U2 = Message("user", "first question"), Message("user", "second question")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def ask(p: TitoProxy, sid: str, *msgs: Message) -> Message:
    r = await p.chat(sid, ChatRequest(messages=msgs))
    return Message("assistant", r.content or "")


async def retried(
    tok, policy: str = "all", store: Path | None = None
) -> tuple[TitoProxy, ScriptedEngine, str]:
    """u1 -> a1, u2 -> a2, then u2 retried -> a2' (a fork of branch 0 after a1)."""
    engine = ScriptedEngine(tok, ["answer one", "answer two", "answer two again"])
    p = TitoProxy(engine, tok, TitoConfig(branch_policy=policy), store_dir=store)  # type: ignore[arg-type]
    sid = p.create_session().session_id
    a1 = await ask(p, sid, U1)
    await ask(p, sid, U1, a1, U2)
    await ask(p, sid, U1, a1, U2)
    return p, engine, sid


async def test_a_retried_turn_forks_and_shares_the_parent_ids_verbatim(tok) -> None:
    p, engine, sid = await retried(tok)
    s = p._session(sid)
    parent, child = s.branches
    assert child.parent == 0 and 0 < child.fork_tokens < len(parent.token_ids)
    assert child.token_ids[: child.fork_tokens] == parent.token_ids[: child.fork_tokens]
    a1 = engine.generations[0].output_ids
    assert (
        child.token_ids[child.fork_tokens - len(a1) : child.fork_tokens] == a1
    )  # the sampled ids, not re-encoded
    trajs = p.export(sid)
    assert [len(t.turns) for t in trajs] == [2, 1]
    # the shared a1 has mask 1 only in the earlier sample (the parent); the child masks it 0
    assert sum(trajs[1].loss_mask) == len(engine.generations[2].output_ids)
    # the agent asked for turn 2 again: the first a2 was dropped, it stays listed and never trains
    dropped = trajs[0].turns[1]
    assert dropped.delivered is False and sum(trajs[0].loss_mask) == len(a1)
    assert trajs[0].token_ids[dropped.start :] == engine.generations[1].output_ids
    assert s.info().n_undelivered == 1 and s.undelivered == {(0, dropped.start): "retried"}
    check_fidelity(trajs, engine, sid)


@pytest.mark.parametrize("policy", ["longest", "last"])
async def test_policy_exports_one_sample_that_owns_its_inherited_turns(tok, policy: str) -> None:
    p, engine, sid = await retried(tok, policy)
    (t,) = p.export(sid)
    assert t.branch == 1  # same length here; the tie goes to the later branch
    assert len(t.turns) == 2 and sum(t.loss_mask) == sum(len(g.output_ids) for g in engine.generations[0::2])
    for turn, g in zip(t.turns, (engine.generations[0], engine.generations[2]), strict=True):
        assert t.token_ids[turn.start : turn.start + turn.completion_len] == g.output_ids
        assert t.logprobs[turn.start : turn.start + turn.completion_len] == g.logprobs


async def test_longest_prefers_the_longer_branch(tok) -> None:
    engine = ScriptedEngine(tok, ["a1", "a2", "b2"])
    p = TitoProxy(engine, tok, TitoConfig(branch_policy="longest"))
    sid = p.create_session().session_id
    a1 = await ask(p, sid, U1)
    await ask(p, sid, U1, a1, Message("user", "a much longer second question " * 5))
    await ask(p, sid, U1, a1, Message("user", "short"))
    (t,) = p.export(sid)
    assert t.branch == 0 and len(p._session(sid).branches) == 2


async def test_concurrent_requests_from_one_parent_never_corrupt(tok) -> None:
    engine = ScriptedEngine(tok, ["root"], delay_s=0.001)
    p = TitoProxy(engine, tok)
    sid = p.create_session().session_id
    a1 = await ask(p, sid, U1)
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(ask, p, sid, U1, a1, Message("user", f"variant {i}"))
    trajs = p.export(sid)
    assert len(trajs) == 6 and all(b.parent in (None, 0) for b in p._session(sid).branches)
    check_fidelity(trajs, engine, sid)
    assert sum(sum(t.loss_mask) for t in trajs) == sum(len(g.output_ids) for g in engine.generations)


async def test_compaction_and_mid_history_edits_are_branches_not_failures(tok) -> None:
    engine = ScriptedEngine(tok, ["a1", "a2", "a3", "c1", "e3"])
    p = TitoProxy(engine, tok)
    sid = p.create_session().session_id
    a1 = await ask(p, sid, U1)
    a2 = await ask(p, sid, U1, a1, U2)
    await ask(p, sid, U1, a1, U2, a2, Message("user", "third"))
    # compaction: the client replaces the history with a summary -> a fresh, fully rendered branch
    await ask(p, sid, Message("system", "Summary of the conversation so far: ..."), Message("user", "third"))
    # an edit of turn 2 keeps turn 1: a fork after a1
    await ask(p, sid, U1, a1, U2, Message("assistant", "edited a2"), Message("user", "third"))
    s = p._session(sid)
    assert [(b.parent, len(b.turns)) for b in s.branches] == [(None, 3), (None, 1), (0, 2)]
    trajs = p.export(sid)
    check_fidelity(trajs, engine, sid)
    assert "edited a2" in tok.decode(trajs[2].token_ids)


async def test_forks_survive_a_restart_and_the_snapshot_matches(tok, tmp_path: Path) -> None:
    p, _, sid = await retried(tok, store=tmp_path)
    before = p.export(sid)
    again = TitoProxy(ScriptedEngine(tok), tok, store_dir=tmp_path)
    assert again.export(sid) == before
    assert (tmp_path / f"{sid}.export.json").exists()
