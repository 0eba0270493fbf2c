"""A session's token history: branches of (ids, mask, logprobs) and their message keys.

Concept: a session is a list of branches. A branch is one training sample: its
token ids, a loss mask (1 exactly on ids the engine sampled), logprobs (0.0 where
the mask is 0), the Turn records, and the identity keys of the messages its ids
encode (to match the next request against). A request that extends a branch's
messages appends to it; any other request starts a new branch.

Invariant: state changes only through `apply(event)`, with events (journal.py) built by
the proxy after a successful generation. The same events are journaled to disk and
replayed on load, so a restarted proxy holds exactly the same state. Each sampled
token is appended to exactly one branch, so it belongs to exactly one sample.

Forks: a request that repeats a branch's history only up to one of its assistant
turns (a retried turn, two requests from one parent) starts a child branch that
copies the parent's ids up to that turn verbatim (no re-rendering) and goes on
from there. The copy keeps the parent's masks internally; `export` decides
ownership: a sampled token has mask 1 only in the *earliest exported* branch that
holds it (with keep-all: the branch where it was sampled) and mask 0, logprob 0.0
in every later branch that shares it by prefix.

Delivery: a turn whose response never reached the agent (the client left before or during
it) or whose request the agent sent again (a retry: it dropped the reply) is marked by an
`UndeliveredEvent`. Its ids stay where they were sampled (journal, audit, the branch's
prefix); in every exported sample its tokens have mask 0 and logprob 0.0, and its Turn is
listed once, in the sample that would have owned it, with `delivered=False`: it never trains.

Faults: `fault` is the class (miles_env.types.EpisodeEnd) of the session's last request when
the proxy failed or refused it for a reason that is no budget (engine_error, proxy_refusal);
a later turn answered clears it. It lives in memory only (not journaled): the rollout reads it
to classify the episode once its harness has ended.

Routing (MoE): a turn's `routed_experts` (the engine's, one row per sampled id) is kept per turn
and copied into a fork with the turns it copies; an exported sample carries the rows of exactly its
mask-1 tokens (the turns it owns, in order), or None when one of those turns has no record.

Truncation: `truncated` names the budget that cut the session's latest turn or
refused a request after it; a later turn answered in full (the client compacted
or retried shorter) clears it, so it reports the end state, not the history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, assert_never

import anyio

from miles_env.tito.config import Budget
from miles_env.tito.journal import (
    AuxEvent,
    ClosedEvent,
    SessionEvent,
    SessionHeader,
    TruncatedEvent,
    TurnEvent,
    UndeliveredEvent,
)
from miles_env.types import EpisodeEnd, RoutedExperts, Trajectory, Turn

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
    parent: int | None = None  # the branch this one forked from
    fork_tokens: int = 0  # ids copied from the parent (a prefix of both)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (n keys, n ids) after each turn
    routed: dict[int, RoutedExperts] = field(default_factory=dict)  # MoE: turn start -> its routing

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
    truncated: str | None  # the budget that cut the session's last turn or refused its last request
    closed: bool
    n_aux: int = 0  # auxiliary requests served (title generation, ...): never trained on
    fault: EpisodeEnd | None = None  # the last request failed, and why (never a budget): see Faults
    n_undelivered: int = 0  # turns the agent never received or asked for again: never trained on
    # tokens of the session's first request: its first turn's prompt, or what the proxy counted when
    # it refused that request for the context (a lower bound when its size alone proved it too long)
    first_prompt: int | None = None


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
        self.n_aux = 0
        self.fault: EpisodeEnd | None = None
        # (branch the turn was sampled on, its start) -> why it was not delivered (journal.py)
        self.undelivered: dict[tuple[int, int], str] = {}
        self.first_prompt: int | None = None  # SessionInfo.first_prompt (a refusal's: memory only)
        self.aliases: dict[str, str] = {}  # client-visible item id -> stored message key
        self.lock = anyio.Lock()  # serialises the requests of one session

    def header(self) -> SessionHeader:
        return SessionHeader(
            id=self.id,
            api_key=self.api_key,
            metadata=self.metadata,
            budget=self.budget,
            created_at=self.created_at,
        )

    @classmethod
    def from_header(cls, h: SessionHeader) -> Session:
        return cls(h.id, h.api_key, h.metadata, h.budget, h.created_at)

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
            self.n_aux,
            self.fault,
            len(self.undelivered),
            first_prompt=self.first_prompt,
        )

    def note_first(self, tokens: int) -> None:
        """The size of the session's first request, as soon as it is planned (answered, refused for
        the context, or abandoned by its client): SessionInfo.first_prompt. A harness whose first
        prompt cannot fit the model fails its episode saying so, with that size (rollout.py)."""
        if self.first_prompt is None and self.n_turns == 0:
            self.first_prompt = tokens

    def apply(self, event: SessionEvent) -> None:
        match event:
            case TurnEvent():
                # A client that recovers (compacts, retries shorter) and is answered in full is not
                # cut: the flag tells the end state. A turn the proxy cuts is followed by its own marker.
                self._apply_turn(event)
                self.truncated = None
                self.fault = None
            case UndeliveredEvent(branch=branch, start=start, reason=reason):
                self._apply_undelivered(branch, start, reason)
            case TruncatedEvent(reason=reason):
                self.truncated = self.truncated or reason
            case ClosedEvent():
                self.closed = True
            case AuxEvent():
                self.n_aux += 1
            case _:
                assert_never(event)

    def _apply_turn(self, e: TurnEvent) -> None:
        if e.new_branch:
            if e.branch != len(self.branches):
                raise ValueError(f"session {self.id}: new branch {e.branch} out of order")
            self.branches.append(self._new_branch(e))
        b = self.branches[e.branch]
        prompt = e.prompt_ids
        b.token_ids.extend(prompt)
        b.loss_mask.extend([0] * len(prompt))
        b.logprobs.extend([0.0] * len(prompt))
        start = len(b.token_ids)
        out = e.output_ids
        b.token_ids.extend(out)
        b.loss_mask.extend([1] * len(out))
        b.logprobs.extend(e.logprobs)
        b.keys.extend(e.keys)
        t = e.turn
        b.turns.append(
            Turn(
                start=start,
                prompt_len=start,
                completion_len=len(out),
                finish_reason=t.finish_reason,
                weight_version=t.weight_version,
                latency_s=t.latency_s,
                engine=t.engine,
            )
        )
        b.marks.append((len(b.keys), len(b.token_ids)))
        if e.routed_experts is not None and out:
            b.routed[start] = e.routed_experts
        if e.aliases:
            self.aliases.update(e.aliases)
        if self.first_prompt is None:
            self.first_prompt = start
        self.n_turns += 1
        self.sampled_tokens += len(out)

    def _apply_undelivered(self, branch: int, start: int, reason: str) -> None:
        if branch >= len(self.branches) or not any(t.start == start for t in self.branches[branch].turns):
            raise ValueError(f"session {self.id}: undelivered turn at {start} of branch {branch} is no turn")
        self.undelivered.setdefault((self.origin(branch, start), start), reason)

    def retried(self, keys: list[str], tools_key: str) -> list[tuple[int, int]]:
        """(branch, start) of each delivered tip turn whose prompt was exactly `keys` (the messages
        before its reply): a request asking for it again, so the agent dropped that reply."""
        out = []
        for b in self.branches:
            if b.tools_key != tools_key or not b.turns or b.keys[:-1] != keys:
                continue
            start = b.turns[-1].start
            if (self.origin(b.index, start), start) not in self.undelivered:
                out.append((b.index, start))
        return out

    def _new_branch(self, e: TurnEvent) -> Branch:
        b = Branch(index=e.branch, tools_key=e.tools_key)
        if e.parent is None:
            return b
        p = self.branches[e.parent]
        n_keys, n_ids = e.fork_keys or 0, e.fork_tokens or 0
        if (n_keys, n_ids) not in p.marks:
            raise ValueError(
                f"session {self.id}: fork of branch {p.index} at ({n_keys}, {n_ids}) is no turn end"
            )
        b.parent, b.fork_tokens = p.index, n_ids
        b.token_ids, b.loss_mask, b.logprobs = p.token_ids[:n_ids], p.loss_mask[:n_ids], p.logprobs[:n_ids]
        b.keys = p.keys[:n_keys]
        b.turns = [t for t in p.turns if t.start + t.completion_len <= n_ids]
        b.marks = [m for m in p.marks if m[1] <= n_ids]
        b.routed = {t.start: p.routed[t.start] for t in b.turns if t.start in p.routed}
        return b

    def origin(self, branch: int, pos: int) -> int:
        """The branch where the token at `pos` of `branch` was written first."""
        b = self.branches[branch]
        while b.parent is not None and pos < b.fork_tokens:
            b = self.branches[b.parent]
        return b.index

    def selected(self, policy: str) -> list[int]:
        """Branch indices exported under a branch policy: all | longest | last."""
        if not self.branches or policy == "all":
            return [b.index for b in self.branches]
        if policy == "last":
            return [self.branches[-1].index]
        if policy == "longest":  # most ids; on a tie the later branch
            return [max(self.branches, key=lambda b: (len(b.token_ids), b.index)).index]
        raise ValueError(f"unknown branch policy {policy!r}")

    def trajectories(self, policy: str = "all") -> list[Trajectory]:
        """One Trajectory per exported branch: each delivered sampled token has mask 1 in exactly
        one of them (the earliest exported that holds it); an undelivered one in none."""
        claimed: set[tuple[int, int]] = set()  # (origin branch, start) of turns already listed
        out = []
        for i in self.selected(policy):
            b = self.branches[i]
            mask, lps = list(b.loss_mask), list(b.logprobs)
            turns, owned = [], []
            for t in b.turns:
                key = (self.origin(i, t.start), t.start)
                undelivered = key in self.undelivered
                if key in claimed or undelivered:
                    end = t.start + t.completion_len
                    mask[t.start : end] = [0] * t.completion_len
                    lps[t.start : end] = [0.0] * t.completion_len
                elif t.completion_len:
                    owned.append(b.routed.get(t.start))
                if key not in claimed:
                    claimed.add(key)
                    turns.append(t.model_copy(update={"delivered": False}) if undelivered else t)
                elif t.completion_len == 0:
                    turns.append(t)
            have = [r for r in owned if r is not None]  # MoE: every owned turn's routing, or none
            routed = RoutedExperts.concat(have) if have and len(have) == len(owned) else None
            out.append(
                Trajectory(
                    token_ids=list(b.token_ids),
                    loss_mask=mask,
                    logprobs=lps,
                    turns=turns,
                    branch=i,
                    routed_experts=routed,
                )
            )
        return out
