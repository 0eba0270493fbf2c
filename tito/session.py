"""A session's token history: branches of (ids, mask, logprobs) and their message keys.

Concept: a session is a list of branches. A branch is one training sample: its
token ids, a loss mask (1 exactly on ids the engine sampled), logprobs (0.0 where
the mask is 0), the Turn records, and the identity keys of the messages its ids
encode (to match the next request against). A request that extends a branch's
messages appends to it; any other request starts a new branch.

Invariant: state changes only through `apply(event)`, with events built by the
proxy after a successful generation. The same events are journaled to disk and
replayed on load, so a restarted proxy holds exactly the same state. Each sampled
token is appended to exactly one branch, so it belongs to exactly one sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from miles_env.tito.config import Budget

from miles_env.types import Trajectory, Turn

__all__ = ["Branch", "Session", "SessionInfo"]


@dataclass(slots=True)
class Branch:
    index: int
    tools_key: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            turns=list(self.turns),
            branch=self.index,
        )


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A read-only snapshot of a session, for the orchestrator."""

    session_id: str
    metadata: dict[str, Any]
    budget: Budget
    created_at: float
    n_turns: int
    sampled_tokens: int
    n_branches: int
    truncated: str | None  # the budget that ended the session, if any
    closed: bool


class Session:
    def __init__(
        self, session_id: str, api_key: str, metadata: dict[str, Any], budget: Budget, created_at: float
    ) -> None:
        self.id = session_id
        self.api_key = api_key
        self.metadata = metadata
        self.budget = budget
        self.created_at = created_at
        self.branches: list[Branch] = []
        self.truncated: str | None = None
        self.closed = False
        self.n_turns = 0
        self.sampled_tokens = 0
        self.lock = anyio.Lock()  # serialises the requests of one session

    def header(self) -> dict[str, Any]:
        return {
            "kind": "session",
            "id": self.id,
            "api_key": self.api_key,
            "metadata": self.metadata,
            "budget": self.budget.model_dump(),
            "created_at": self.created_at,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Session:
        return cls(h["id"], h["api_key"], h["metadata"], Budget(**h["budget"]), h["created_at"])

    def elapsed(self) -> float:
        return time.time() - self.created_at

    def info(self) -> SessionInfo:
        return SessionInfo(
            self.id,
            dict(self.metadata),
            self.budget,
            self.created_at,
            self.n_turns,
            self.sampled_tokens,
            len(self.branches),
            self.truncated,
            self.closed,
        )

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "turn":
            self._apply_turn(event)
        elif kind == "truncated":
            self.truncated = self.truncated or event["reason"]
        elif kind == "closed":
            self.closed = True
        else:
            raise ValueError(f"session {self.id}: unknown event kind {kind!r}")

    def _apply_turn(self, e: dict[str, Any]) -> None:
        if e["new_branch"]:
            if e["branch"] != len(self.branches):
                raise ValueError(f"session {self.id}: new branch {e['branch']} out of order")
            self.branches.append(Branch(index=e["branch"], tools_key=e["tools_key"]))
        b = self.branches[e["branch"]]
        prompt = e["prompt_ids"]
        b.token_ids.extend(prompt)
        b.loss_mask.extend([0] * len(prompt))
        b.logprobs.extend([0.0] * len(prompt))
        start = len(b.token_ids)
        out, lps = e["output_ids"], e["logprobs"]
        b.token_ids.extend(out)
        b.loss_mask.extend([1] * len(out))
        b.logprobs.extend(float(x) for x in lps)
        b.keys.extend(e["keys"])
        b.turns.append(Turn(start=start, prompt_len=start, completion_len=len(out), **e["turn"]))
        self.n_turns += 1
        self.sampled_tokens += len(out)

    def trajectories(self) -> list[Trajectory]:
        return [b.to_trajectory() for b in self.branches]
