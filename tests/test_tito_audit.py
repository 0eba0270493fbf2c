"""`tito audit`: a clean store passes; each kind of planted corruption is found and named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import ChatRequest, Message, TitoProxy
from miles_env.tito.audit import audit

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def make_store(tok, root: Path) -> str:
    """A run dir layout: root/sessions holds one session with a fork (retried second turn), exported."""
    engine = ScriptedEngine(tok, ["answer one", "answer two", "answer two again"])
    p = TitoProxy(engine, tok, store_dir=root / "sessions")
    sid = p.create_session().session_id
    u1, u2 = Message("user", "q1"), Message("user", "q2")
    r = await p.chat(sid, ChatRequest(messages=(u1,)))
    a1 = Message("assistant", r.content or "")
    await p.chat(sid, ChatRequest(messages=(u1, a1, u2)))
    await p.chat(sid, ChatRequest(messages=(u1, a1, u2)))
    p.export(sid)
    return sid


def edit_journal(path: Path, fn: Callable[[list[dict[str, Any]]], None]) -> None:
    events = [json.loads(x) for x in path.read_text().splitlines()]
    fn(events)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def edit_snapshot(path: Path, fn: Callable[[list[dict[str, Any]]], None]) -> None:
    body = json.loads(path.read_text())
    fn(body["branches"])
    path.write_text(json.dumps(body))


def run_cli(run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "miles_env.cli.main", "tito", "audit", str(run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


async def test_clean_store_has_no_drift_and_the_cli_exits_zero(tok, tmp_path: Path) -> None:
    await make_store(tok, tmp_path)
    r = audit(tmp_path)  # a run dir: the store is found under sessions/
    assert r.ok and r.sessions == 1 and r.branches == 2 and r.turns == 3 and r.snapshots == 1
    cli = run_cli(tmp_path)
    assert cli.returncode == 0 and "no drift" in cli.stdout, cli.stdout + cli.stderr


def first_sampled(t: dict[str, Any]) -> int:
    return t["loss_mask"].index(1)


CORRUPTIONS: list[tuple[str, str, Callable[[Any], None]]] = [
    ("journal", "record", lambda ev: ev[1]["output_ids"].__setitem__(0, ev[1]["output_ids"][0] + 1)),
    ("journal", "record", lambda ev: ev[2]["logprobs"].__setitem__(0, -0.5)),
    ("journal", "journal", lambda ev: ev[3].__setitem__("fork_tokens", 3)),
    ("snapshot", "sampled_ids", lambda br: br[0]["token_ids"].__setitem__(first_sampled(br[0]), 7)),
    ("snapshot", "logprobs", lambda br: br[0]["logprobs"].__setitem__(first_sampled(br[0]), -9.0)),
    ("snapshot", "mask", lambda br: br[0]["loss_mask"].__setitem__(0, 1)),
    ("snapshot", "mask", lambda br: br[1]["logprobs"].__setitem__(1, -0.25)),
    ("snapshot", "prefix", lambda br: br[1]["token_ids"].__setitem__(2, br[1]["token_ids"][2] + 1)),
]


def own_inherited(br: list[dict[str, Any]]) -> None:
    """Give the child mask 1 (with the right logprobs) on the turn it shares with its parent."""
    parent, child = br
    turn = parent["turns"][0]
    s, e = turn["start"], turn["start"] + turn["completion_len"]
    child["loss_mask"][s:e] = [1] * (e - s)
    child["logprobs"][s:e] = parent["logprobs"][s:e]


@pytest.mark.parametrize(
    ("where", "kind", "corrupt"), [*CORRUPTIONS, ("snapshot", "ownership", own_inherited)]
)
async def test_planted_corruption_is_found_by_kind(
    tok, tmp_path: Path, where: str, kind: str, corrupt: Any
) -> None:
    sid = await make_store(tok, tmp_path)
    store = tmp_path / "sessions"
    if where == "journal":
        edit_journal(store / f"{sid}.jsonl", corrupt)
    else:
        edit_snapshot(store / f"{sid}.export.json", corrupt)
    r = audit(store)
    assert kind in r.by_kind(), r.drifts
    assert all(d.session_id == sid for d in r.drifts)
    cli = run_cli(store)
    assert cli.returncode == 1 and f"{kind}=" in cli.stdout, cli.stdout + cli.stderr


async def test_audit_never_writes_and_a_missing_store_exits_2(tok, tmp_path: Path) -> None:
    sid = await make_store(tok, tmp_path)
    path = tmp_path / "sessions" / f"{sid}.jsonl"
    with path.open("ab") as f:
        f.write(b'{"kind":"turn","bra')  # a torn last line: skipped, not repaired, not drift
    size = path.stat().st_size
    assert audit(tmp_path).ok and path.stat().st_size == size
    assert run_cli(tmp_path / "nowhere").returncode == 2
