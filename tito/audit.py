"""Audit a proxy store: do the stored trajectories still say exactly what the engine sampled?

Concept: `audit(store_dir)` reads every session journal (read-only: a torn last
line is skipped, never repaired) and, per session, replays its turn events
independently of `Session` into the expected ids of each branch, the position of
every sampled run and the engine's record of it (`output_ids`, `logprobs`, checked
against the `gen_digest` written when the engine returned). It then checks two
views of the samples: the export rebuilt from the journal with the session's
branch policy, and the `<sid>.export.json` snapshot of what was really handed
out, if there is one.

Drift kinds: `journal` (unreadable or inconsistent events), `record` (an engine
record no longer matches its digest or its lengths differ), `sampled_ids` and
`logprobs` (a mask-1 token or its logprob differs from the engine's record),
`delivery` (a turn the agent never received, or asked for again, has mask 1 somewhere),
`mask` (mask not 0/1, mask 1 off a sampled token, a sampled run half masked,
logprob non-zero where mask is 0), `prefix` (a branch's ids differ from its
events, or a fork's ids from its parent's prefix), `ownership` (a sampled token
with mask 1 in none or in more than one exported sample; an undelivered one is expected in
none). Undelivered turns (`UndeliveredEvent`) are counted in the report.
Logprobs are compared in their strict-JSON form (strictjson.py), so a -inf or NaN
the engine returned is equal to itself wherever it was stored.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.tito import strictjson
from miles_env.tito.journal import JournalError, JournalEvent, TurnEvent, UndeliveredEvent
from miles_env.tito.messages import digest
from miles_env.tito.store import read_events, replay

__all__ = ["Drift", "AuditReport", "audit", "resolve_store"]


@dataclass(frozen=True, slots=True)
class Drift:
    kind: str
    session_id: str
    branch: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class AuditReport:
    store_dir: Path
    sessions: int = 0
    branches: int = 0
    turns: int = 0
    sampled_tokens: int = 0
    snapshots: int = 0
    drifts: tuple[Drift, ...] = ()
    undelivered: int = 0  # turns the agent never received or asked for again (never trained)

    @property
    def ok(self) -> bool:
        return not self.drifts

    def by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(d.kind for d in self.drifts).items()))


@dataclass(slots=True)
class _Expected:
    """Branch contents replayed from the events: ids, which ids were sampled, and by which turn."""

    ids: dict[int, list[int]] = field(default_factory=dict)
    sampled: dict[int, list[bool]] = field(default_factory=dict)
    runs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # (start, turn index)
    records: list[tuple[list[int], list[float]]] = field(default_factory=list)
    undelivered: set[int] = field(default_factory=set)  # turn indices


def resolve_store(path: Path) -> Path:
    """Accept the store itself or a run dir holding it under `sessions/`."""
    return path / "sessions" if (path / "sessions").is_dir() else path


def _replay(sid: str, events: list[JournalEvent], out: list[Drift]) -> _Expected:
    exp = _Expected()
    for e in events:
        if isinstance(e, UndeliveredEvent):
            exp.undelivered.update(k for start, k in exp.runs.get(e.branch, []) if start == e.start)
        if not isinstance(e, TurnEvent):
            continue
        b, k = e.branch, len(exp.records)
        outs, lps = e.output_ids, e.logprobs
        if len(outs) != len(lps) or (e.gen_digest is not None and e.gen_digest != digest(outs, lps)):
            out.append(
                Drift("record", sid, b, f"turn {k}: output_ids/logprobs differ from the engine's record")
            )
        exp.records.append((outs, lps))
        if e.new_branch:
            p, n = e.parent, e.fork_tokens or 0
            base = exp.ids.get(p, [])[:n] if p is not None else []
            exp.ids[b], exp.sampled[b] = list(base), exp.sampled.get(p, [])[:n] if p is not None else []
            exp.runs[b] = [r for r in exp.runs.get(p, []) if r[0] < n] if p is not None else []
        ids = exp.ids.setdefault(b, [])
        sampled = exp.sampled.setdefault(b, [])
        ids.extend(e.prompt_ids)
        sampled.extend([False] * len(e.prompt_ids))
        exp.runs.setdefault(b, []).append((len(ids), k))
        ids.extend(outs)
        sampled.extend([True] * len(outs))
    return exp


def _check(sid: str, source: str, trajs: list[dict[str, Any]], exp: _Expected, out: list[Drift]) -> None:
    owned: Counter[int] = Counter()
    present: set[int] = set()
    for t in trajs:
        b = t["branch"]
        ids, mask = t["token_ids"], t["loss_mask"]
        try:
            lps = strictjson.floats(t["logprobs"])
        except (TypeError, ValueError):
            out.append(
                Drift("logprobs", sid, t["branch"], f"{source} branch {t['branch']}: unreadable logprobs")
            )
            continue
        want, sampled = exp.ids.get(b, []), exp.sampled.get(b, [])
        where = f"{source} branch {b}"
        if not (len(ids) == len(mask) == len(lps)) or len(ids) > len(want):
            out.append(Drift("prefix", sid, b, f"{where}: lengths differ from the journal"))
            continue
        for i, (x, w) in enumerate(zip(ids, want, strict=False)):
            if x != w:
                kind = "sampled_ids" if sampled[i] else "prefix"
                out.append(Drift(kind, sid, b, f"{where}: token {i} is {x}, the journal says {w}"))
                break
        bad = next((i for i, m in enumerate(mask) if m not in (0, 1) or (m == 1 and not sampled[i])), None)
        if bad is not None:
            out.append(Drift("mask", sid, b, f"{where}: loss_mask[{bad}]={mask[bad]} on a token not sampled"))
        zero = next(
            (i for i, (m, lp) in enumerate(zip(mask, lps, strict=True)) if m == 0 and lp != 0.0), None
        )
        if zero is not None:
            out.append(Drift("mask", sid, b, f"{where}: logprobs[{zero}]={lps[zero]} where loss_mask is 0"))
        for start, k in exp.runs.get(b, []):
            rec_ids, rec_lps = exp.records[k]
            end = start + len(rec_ids)
            if end > len(ids):
                continue  # the sample was exported before this turn
            present.add(k)
            m = mask[start:end]
            if k in exp.undelivered and any(m):
                out.append(Drift("delivery", sid, b, f"{where}: turn {k} was not delivered, and has mask 1"))
                continue
            if all(m) and m:
                owned[k] += 1
                if strictjson.numbers(lps[start:end]) != strictjson.numbers(rec_lps):
                    out.append(
                        Drift("logprobs", sid, b, f"{where}: turn {k} logprobs differ from the engine's")
                    )
            elif any(m):
                out.append(Drift("mask", sid, b, f"{where}: turn {k} is partly masked"))
    for k in sorted(present - exp.undelivered):
        if owned[k] != 1 and exp.records[k][0]:
            out.append(Drift("ownership", sid, None, f"{source}: turn {k} has mask 1 in {owned[k]} samples"))


def _audit_session(path: Path, out: list[Drift]) -> tuple[int, int, int, bool, int]:
    sid = path.stem
    try:
        events = read_events(path)
        session = replay(events)
        if session is None:
            raise JournalError("no events")
    except (ValueError, IndexError) as e:
        detail = str(e).removeprefix(f"{path}: ")  # a JournalError names the file already
        out.append(Drift("journal", sid, None, f"{path.name}: {type(e).__name__}: {detail}"))
        return 0, 0, 0, False, 0
    exp = _replay(sid, events, out)
    for b in session.branches:
        if b.token_ids != exp.ids.get(b.index):
            out.append(Drift("prefix", sid, b.index, "replayed branch differs from its events"))
    snap_path = path.with_name(f"{sid}.export.json")
    policy = "all"
    snap: dict[str, Any] | None = None
    if snap_path.exists():
        try:
            snap = json.loads(snap_path.read_text())
            policy = snap["policy"]
        except (ValueError, KeyError) as e:
            out.append(Drift("journal", sid, None, f"{snap_path.name}: unreadable: {e}"))
    rebuilt = [t.model_dump(mode="json") for t in session.trajectories(policy)]
    _check(sid, "journal", rebuilt, exp, out)
    if snap is not None:
        _check(sid, "export", list(snap.get("branches", [])), exp, out)
    return (
        len(session.branches),
        session.n_turns,
        session.sampled_tokens,
        snap is not None,
        len(exp.undelivered),
    )


def audit(store_dir: Path | str) -> AuditReport:
    """Re-check every stored session under `store_dir` (or `store_dir/sessions`); never writes."""
    root = resolve_store(Path(store_dir))
    drifts: list[Drift] = []
    n = branches = turns = tokens = snaps = undelivered = 0
    for path in sorted(root.glob("*.jsonl")):
        b, t, k, snap, u = _audit_session(path, drifts)
        n, branches, turns, tokens, snaps = n + 1, branches + b, turns + t, tokens + k, snaps + snap
        undelivered += u
    return AuditReport(root, n, branches, turns, tokens, snaps, tuple(drifts), undelivered)
