"""The episode table: one summary row per episode, kept in memory and grown as the run writes.

Sources, by layout (layout.py): the replay queue's `episodes` rows (train episodes; summary fields
read with SQLite's JSON functions, so the transcript and the token arrays are never parsed for the
table), the eval JSONL and a run's failed_episodes.jsonl (train episodes that failed and never
reached the queue: rolled out again or their group dropped, state `not trained`; each read from
the byte offset reached last time), and the store's journals (one row per session). `refresh()` is cheap when nothing changed (`PRAGMA data_version`, file
sizes) and reads only what is new, so a page poll during a live run costs milliseconds.

A train episode's `step` is the trainer step that trained it: from the checkpoints that still list
it (`trained_episode_ids`), else the first train step logged after its group completed (exact in
sync mode). Filtering, sorting and paging run here, server side: the browser only ever holds a page;
`flag` filters by the guards' flags (`any`, `none`, or a flag's name), `end` by the episode's end
class (`policy`: the ends that train, `infra`: every infrastructure failure, or a class's name; an
episode stored before the classes existed gets the one its status implies, types.end_of_status).
"""

from __future__ import annotations

import bisect
import json
import sqlite3
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from miles_env.types import POLICY_ENDS, EpisodeEnd, end_of_status
from miles_env.view.layout import Kind, Layout, connect_ro
from miles_env.view.metrics import MetricsLog

__all__ = ["Row", "EpisodeIndex", "Page", "SORTABLE"]


@dataclass(slots=True)
class Row:
    id: str
    task: str
    status: str
    reward: float | None
    group: str
    split: str
    step: int | None
    v_min: int | None
    v_max: int | None
    turns: int
    sampled: int
    wall_s: float | None
    state: str  # queue group state (train), "eval", or "session"
    source: str  # "queue" | "jsonl" | "failed" | "session": where the full episode is read from
    offset: int = 0  # byte offset of its line (jsonl)
    session: str = ""
    completed_at: float | None = None
    flags: tuple[str, ...] = ()  # reward-hacking flags the guards raised (miles_env/guards)
    end: str = ""  # the episode's end class (types.EpisodeEnd); "" for a bare session

    def public(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("offset", "completed_at")
        }


SORTABLE = (
    "id",
    "task",
    "status",
    "end",
    "reward",
    "group",
    "split",
    "step",
    "v_min",
    "turns",
    "sampled",
    "wall_s",
)


@dataclass(frozen=True, slots=True)
class Page:
    total: int  # rows matching the filter
    rows: list[dict[str, Any]]


def _turn_stats(samples: list[dict[str, Any]]) -> tuple[int, int, int | None, int | None]:
    turns = [t for s in samples for t in s.get("turns", [])]
    versions = [int(t.get("weight_version", 0)) for t in turns]
    sampled = sum(int(t.get("completion_len", 0)) for t in turns)
    return len(turns), sampled, (min(versions) if versions else None), (max(versions) if versions else None)


_QUEUE_SQL = (
    "SELECT e.rowid, e.id, e.group_id, json_extract(e.meta, '$.task_id'), json_extract(e.meta, '$.status'), "
    "json_extract(e.meta, '$.reward.score'), json_extract(e.meta, '$.split'), "
    "json_extract(e.meta, '$.timings.total_s'), json_extract(e.meta, '$.samples'), "
    "json_extract(e.meta, '$.metadata.session_id'), json_extract(e.meta, '$.flags'), json_extract(e.meta, '$.end') "
    "FROM episodes e WHERE e.rowid > ? ORDER BY e.rowid"
)


class EpisodeIndex:
    def __init__(self, layout: Layout, metrics: MetricsLog) -> None:
        self.layout = layout
        self.metrics = metrics
        self.rows: list[Row] = []
        self.by_id: dict[str, Row] = {}
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._rowid = 0
        self._data_version: int | None = None
        self._offsets: dict[str, int] = {}  # jsonl source -> bytes read
        self._sessions: dict[str, int] = {}  # journal name -> size read
        self._trained: dict[str, int] = {}  # episode id -> step, from checkpoints
        self._ckpts: set[str] = set()
        self.changes = 0  # bumped whenever a row is added or changed (the browser's live signal)

    # -- refresh ------------------------------------------------------------------------------------
    def refresh(self) -> None:
        with self._lock:
            before = self.changes
            if self.layout.kind is Kind.TRAIN:
                self._refresh_queue()
            if self.layout.kind in (Kind.TRAIN, Kind.EVAL):
                self._refresh_jsonl(self.layout.eval_episodes, "jsonl")
            if self.layout.kind is Kind.TRAIN:
                self._refresh_jsonl(self.layout.failed_episodes, "failed")
            if self.layout.kind is Kind.STORE:
                self._refresh_store()
            if self.changes != before:
                self.rows.sort(key=lambda r: r.completed_at or 0.0)

    def _add(self, row: Row) -> None:
        old = self.by_id.get(row.id)
        if old is not None:
            self.rows.remove(old)
        self.rows.append(row)
        self.by_id[row.id] = row
        self.changes += 1

    def _queue_conn(self) -> sqlite3.Connection | None:
        if self._conn is None and self.layout.queue.is_file():
            self._conn = connect_ro(self.layout.queue)
        return self._conn

    def _refresh_queue(self) -> None:
        conn = self._queue_conn()
        if conn is None:
            return
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        steps = self._train_steps()
        if version == self._data_version and not steps:
            return
        self._data_version = version
        groups = {g: (s, t) for g, s, t in conn.execute("SELECT group_id, state, completed_at FROM groups")}
        for rowid, eid, gid, task, status, score, split, wall, samples, sid, flags, end in conn.execute(
            _QUEUE_SQL, (self._rowid,)
        ):
            self._rowid = rowid
            turns, sampled, v_min, v_max = _turn_stats(json.loads(samples or "[]"))
            row = Row(eid, task or "", status or "", score, gid, split or "train", None, v_min, v_max, turns,
                      sampled, wall, "open", "queue", session=sid or "",
                      flags=tuple(json.loads(flags or "[]")), end=end or end_of_status(status or ""))  # fmt: skip
            self._add(row)
        times = self.metrics.train_times()
        logged = [t for t, _ in times]
        for row in self.rows:
            if row.source != "queue":
                continue
            state, done = groups.get(row.group, ("open", None))
            step = self._trained.get(row.id)
            if step is None and state == "acked" and done is not None and times:
                i = bisect.bisect_left(logged, done)
                step = times[i][1] if i < len(times) else None
            if (row.state, row.step, row.completed_at) != (state, step, done):
                row.state, row.step, row.completed_at = state, step, done
                self.changes += 1

    def _train_steps(self) -> bool:
        """Read checkpoints not seen before; True when one added steps."""
        added = False
        for meta in sorted(self.layout.root.glob("checkpoints/step_*/trainer.json")):
            if meta.parent.name in self._ckpts:
                continue
            try:
                data = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue  # being written: read next time
            self._ckpts.add(meta.parent.name)
            for eid in data.get("extra", {}).get("trained_episode_ids", []):
                self._trained[eid] = int(data["step"])
                added = True
        return added

    def _refresh_jsonl(self, path: Path, source: str) -> None:
        done = self._offsets.get(source, 0)
        if not path.is_file() or path.stat().st_size <= done:
            return
        with path.open("rb") as fh:
            fh.seek(done)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        pos = 0
        while pos < end:
            nl = data.index(b"\n", pos)
            line = data[pos:nl]
            offset = done + pos
            pos = nl + 1
            if line.strip():
                self._add(self._jsonl_row(json.loads(line), offset, source))
        self._offsets[source] = done + end

    def _jsonl_row(self, ep: dict[str, Any], offset: int, source: str) -> Row:
        samples = ep.get("samples")
        sid = str(ep.get("metadata", {}).get("session_id", ""))
        if samples is None:  # a train run's eval line: the samples are in the store's export
            samples = _export_samples(self.layout.store / f"{sid}.export.json")
        turns, sampled, v_min, v_max = _turn_stats(samples)
        reward = ep.get("reward") or {}
        return Row(str(ep["id"]), str(ep.get("task_id", "")), str(ep.get("status", "")), reward.get("score"),
                   str(ep.get("group_id", "")), str(ep.get("split", "")), ep.get("step"), v_min, v_max, turns,
                   sampled, ep.get("timings", {}).get("total_s"),
                   "eval" if source == "jsonl" else "not trained", source, offset, sid, float(offset), tuple(ep.get("flags") or ()),
                   str(ep.get("end") or end_of_status(str(ep.get("status", "")))))  # fmt: skip

    def _refresh_store(self) -> None:
        from miles_env.view.sessions import session_summary

        for path in sorted(self.layout.store.glob("*.jsonl")):
            size = path.stat().st_size
            if self._sessions.get(path.name) == size:
                continue
            self._sessions[path.name] = size
            s = session_summary(path)
            if s is None:
                continue
            self._add(Row(s.session_id, s.task, s.status, None, s.group, "", None, s.v_min, s.v_max, s.turns,
                          s.sampled, s.wall_s, "session", "session", session=s.session_id,
                          completed_at=s.created_at))  # fmt: skip

    # -- query --------------------------------------------------------------------------------------
    def page(self, *, offset: int, limit: int, sort: str, desc: bool, filters: dict[str, str]) -> Page:
        with self._lock:
            rows = [r for r in self.rows if _matches(r, filters)]
        if sort in SORTABLE:
            present = [r for r in rows if getattr(r, sort) is not None]
            missing = [r for r in rows if getattr(r, sort) is None]
            present.sort(key=lambda r: getattr(r, sort), reverse=desc)
            rows = present + missing  # an unknown value sorts last either way
        return Page(len(rows), [r.public() for r in rows[offset : offset + limit]])

    def group(self, group_id: str) -> list[Row]:
        with self._lock:
            return [r for r in self.rows if r.group == group_id]

    def facets(self) -> dict[str, list[str]]:
        with self._lock:
            return {
                "status": sorted({r.status for r in self.rows}),
                "split": sorted({r.split for r in self.rows}),
                "state": sorted({r.state for r in self.rows}),
                "flag": sorted({f for r in self.rows for f in r.flags}),
                "end": sorted({r.end for r in self.rows if r.end}),
            }


def _matches(row: Row, filters: dict[str, str]) -> bool:
    for key, want in filters.items():
        if not want:
            continue
        if key == "q":
            needle = want.lower()
            if needle not in row.task.lower() and needle not in row.id and needle not in row.group.lower():
                return False
        elif key in ("status", "split", "state", "group", "task"):
            if getattr(row, key) != want:
                return False
        elif key == "step" and str(row.step) != want:
            return False
        elif key == "flag" and not _flagged(row, want):
            return False
        elif key == "end" and not _ended(row, want):
            return False
        elif key == "passed" and (row.reward is not None and row.reward >= 1.0) != (want == "1"):
            return False
    return True


def _flagged(row: Row, want: str) -> bool:
    """`flag=NAME`: raised NAME; `flag=any`: raised some flag; `flag=none`: raised none."""
    if want == "any":
        return bool(row.flags)
    if want == "none":
        return not row.flags
    return want in row.flags


_POLICY = {e.value for e in POLICY_ENDS}
_CLASSES = {e.value for e in EpisodeEnd}


def _ended(row: Row, want: str) -> bool:
    """`end=policy`: ended by the policy; `end=infra`: an infrastructure failure; else that class."""
    if want == "policy":
        return row.end in _POLICY
    if want == "infra":
        return row.end in _CLASSES - _POLICY
    return row.end == want


def _export_samples(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_bytes()).get("branches", []))
    except (OSError, ValueError):
        return []
