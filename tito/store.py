"""Durable session state: one append-only JSON-lines journal per session.

Concept: `<store_dir>/<session_id>.jsonl` holds the session header, then one
event per line (turn, truncated, aux, closed: the models of journal.py), exactly the
events `Session.apply` consumes; every line is validated as it is read. Each event is
written with a single `write` on an O_APPEND descriptor after its turn, so the cost per
turn is proportional to the turn, not to the history; a torn last line (crash
mid-write, so no trailing newline) is cut off on load.
Lifecycle: written by the proxy as it goes, replayed by `load_sessions` at start (which
cuts a torn last line off); `read_events` + `replay` read one read-only (`tito audit`, the viewer).
`<session_id>.export.json` holds the samples last exported (for `tito audit`).
Both are strict JSON (strictjson.py): a non-finite logprob is the string
"-Infinity" (etc.), read back as the float; an event that cannot be written as
strict JSON raises before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles_env.tito import strictjson
from miles_env.tito.journal import JournalError, JournalEvent, SessionHeader, read_event
from miles_env.tito.session import Session

__all__ = ["Journal", "load_sessions", "read_events", "replay", "export_body"]


def export_body(traj: Any) -> dict[str, Any]:
    """A Trajectory as strict-JSON-ready data (non-finite logprobs as sentinel strings)."""
    body: dict[str, Any] = traj.model_dump(mode="json")
    body["logprobs"] = strictjson.numbers(body["logprobs"])
    return body


class Journal:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, session_id: str) -> Path:
        return self.root / f"{session_id}.jsonl"

    def append(self, session_id: str, event: JournalEvent) -> None:
        line = strictjson.encode(event.wire()) + b"\n"
        fd = os.open(self.path(session_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def write_export(self, session_id: str, policy: str, trajs: list[Any]) -> None:
        """Replace `<sid>.export.json` with the samples just exported (atomic rename)."""
        body = {
            "session_id": session_id,
            "policy": policy,
            "branches": [export_body(t) for t in trajs],
        }
        tmp = self.root / f".{session_id}.export.tmp"
        tmp.write_bytes(strictjson.encode(body))
        os.replace(tmp, self.root / f"{session_id}.export.json")

    def delete(self, session_id: str) -> None:
        self.path(session_id).unlink(missing_ok=True)


def _load_one(path: Path) -> Session | None:
    data = path.read_bytes()
    session: Session | None = None
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # a torn last line (crash mid-write): never acknowledged, so cut it off
            with path.open("r+b") as f:
                f.truncate(pos)  # the next append then starts on a clean line
            break
        try:
            session = _step(session, read_event(data[pos:end]))
        except ValueError as e:  # JournalError, or an event that does not fit the session (apply)
            raise JournalError(f"{path}: byte {pos}: {e}") from None
        pos = end + 1
    return session


def _step(session: Session | None, event: JournalEvent) -> Session:
    """`session` after `event`; the header, and only the header, comes first."""
    if isinstance(event, SessionHeader):
        if session is not None:
            raise JournalError(f"session {session.id}: a second session header")
        return Session.from_header(event)
    if session is None:
        raise JournalError(f"a {event.kind} event before the session header")
    session.apply(event)
    return session


def read_events(path: Path) -> list[JournalEvent]:
    """A journal's events, read-only: a torn last line (no newline yet) is left out, never cut off.
    Raises JournalError naming the byte offset of a line that is no event."""
    data = path.read_bytes()
    events, pos = [], 0
    while (end := data.find(b"\n", pos)) >= 0:
        try:
            events.append(read_event(data[pos:end]))
        except JournalError as e:
            raise JournalError(f"{path}: byte {pos}: {e}") from None
        pos = end + 1
    return events


def replay(events: Iterable[JournalEvent]) -> Session | None:
    """The session `events` describe (None when there are none); raises ValueError when they do
    not fit together (no header first, a fork at no turn end, a branch out of order)."""
    session: Session | None = None
    for event in events:
        session = _step(session, event)
    return session


def load_sessions(root: Path) -> dict[str, Session]:
    out: dict[str, Session] = {}
    if not root.is_dir():
        return out
    for path in sorted(root.glob("*.jsonl")):
        s = _load_one(path)
        if s is not None:
            out[s.id] = s
    return out
