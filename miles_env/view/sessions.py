"""Read-only views of a proxy store's sessions: a table summary, the samples, the audit's drift.

The journal (`<sid>.jsonl`) is read as bytes; a torn last line is skipped, never truncated (the
proxy's own loader repairs it, the viewer must not write). The samples are the export snapshot
(`<sid>.export.json`, exactly what was handed to the trainer) when there is one, else the branches
the journal replays to. Drift comes from `tito audit` run on this one session (a private folder of
links to its two files), with the token where it starts when the audit's message names one.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_env.tito import strictjson

__all__ = ["SessionSummary", "session_summary", "session_samples", "session_drift"]


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session_id: str
    task: str
    group: str
    status: str
    turns: int
    sampled: int
    v_min: int | None
    v_max: int | None
    wall_s: float | None
    created_at: float | None


def _events(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]  # the piece after the last newline is torn or empty
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def session_summary(path: Path) -> SessionSummary | None:
    try:
        events = _events(path)
    except OSError:
        return None
    if not events or events[0].get("kind") != "session":
        return None
    head = events[0]
    meta = head.get("metadata") or {}
    turns = [e for e in events[1:] if e.get("kind") == "turn"]
    versions = [int((e.get("turn") or {}).get("weight_version", 0)) for e in turns]
    kinds = {e.get("kind") for e in events[1:]}
    status = "truncated" if "truncated" in kinds else "closed" if "closed" in kinds else "open"
    wall = sum(float((e.get("turn") or {}).get("latency_s", 0.0)) for e in turns)
    return SessionSummary(
        session_id=str(head.get("id", path.stem)),
        task=str(meta.get("task_id", "")),
        group=str(meta.get("group_id", meta.get("episode_id", ""))),
        status=status,
        turns=len(turns),
        sampled=sum(len(e.get("output_ids", [])) for e in turns),
        v_min=min(versions) if versions else None,
        v_max=max(versions) if versions else None,
        wall_s=wall if turns else None,
        created_at=head.get("created_at"),
    )


def session_samples(store: Path, session_id: str) -> list[dict[str, Any]]:
    """The exported samples (token_ids, loss_mask, logprobs as floats, turns, branch)."""
    snap = store / f"{session_id}.export.json"
    if snap.is_file():
        try:
            branches = list(json.loads(snap.read_bytes()).get("branches", []))
        except ValueError:
            branches = []
        for b in branches:
            b["logprobs"] = strictjson.floats(b["logprobs"])
        return branches
    path = store / f"{session_id}.jsonl"
    if not path.is_file():
        return []
    from miles_env.tito.store import read_events, replay

    session = replay(read_events(path))  # read-only; a bad line is a ValueError (JournalError)
    return [t.model_dump(mode="python") for t in session.trajectories("all")] if session else []


_TOKEN = re.compile(r"(?:token |\[)(\d+)\]?")
_TURN = re.compile(r"turn (\d+)")
_BRANCH = re.compile(r"branch (\d+)")


def session_drift(store: Path, session_id: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tito audit` on this session: [{kind, branch, detail, token}] (token: where the drift starts,
    or None when the audit's message names no position)."""
    from miles_env.tito.audit import audit

    journal = store / f"{session_id}.jsonl"
    if not journal.is_file():
        return []
    with tempfile.TemporaryDirectory(prefix="miles-view-audit-") as tmp:
        for name in (journal.name, f"{session_id}.export.json"):
            if (store / name).exists():
                (Path(tmp) / name).symlink_to((store / name).resolve())
        report = audit(Path(tmp))
    out = []
    for d in report.drifts:
        branch = d.branch
        if branch is None and (m := _BRANCH.search(d.detail)):
            branch = int(m.group(1))
        out.append(
            {
                "kind": d.kind,
                "branch": branch,
                "detail": d.detail,
                "token": _position(d.detail, branch, samples),
            }
        )
    return out


def _position(detail: str, branch: int | None, samples: list[dict[str, Any]]) -> int | None:
    if m := _TOKEN.search(detail):
        return int(m.group(1))
    if (m := _TURN.search(detail)) is not None:
        k = int(m.group(1))
        for s in samples:
            turns = s.get("turns", [])
            if (branch is None or s.get("branch") == branch) and k < len(turns):
                return int(turns[k]["start"])
    return None
