"""The journal's events: one pydantic model per kind, read back as a discriminated union.

Concept: a session journal (store.py) is a header line (`SessionHeader`), then one event
per line: `TurnEvent` (one generation: the prompt tail, the sampled ids and their
logprobs, the keys of the messages they encode), `UndeliveredEvent` (a turn's response
never reached the agent, or the agent asked for that turn again: the turn stays, and
never trains), `TruncatedEvent` (a budget cut the session), `AuxEvent` (an auxiliary
request was served; never trained on) and `ClosedEvent`. The JSON key `kind` is the tag. `Session.apply` consumes the events,
`tito audit` replays them; both `match` on the model, never on a string.

Wire form (unchanged since the first journal, so every journal on disk still loads and
the bytes written stay the same): `wire()` is the dict `strictjson.encode` writes
(compact `json.dumps`; pydantic's own JSON writer spells floats its way, `1e-5` for
`1e-05`, so it is not used). A turn's optional fields (`parent`, `fork_keys`,
`fork_tokens` of a fork, `aliases`, `gen_digest`, a MoE engine's `routed_experts`) are absent
rather than null when unset.
Logprobs are floats in memory and a non-finite one is its sentinel string on the wire
("-Infinity"), read back as the float.

Speed: a turn is journaled on the per-turn path, from values our own code built, so the
proxy builds its `TurnEvent` with `model_construct` (no validation, and no copy of the id
lists, which validation would make: ~0.3 ms for a 16K-token prompt) and `TurnEvent.wire`
is written by hand for the same reason; the rarer events are validated when built.
`read_event` validates every line it reads (types, no extra keys, a known kind).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_serializer

from miles_env.tito import strictjson
from miles_env.tito.config import Budget
from miles_env.types import RoutedExperts

__all__ = [
    "AuxEvent",
    "ClosedEvent",
    "JournalError",
    "JournalEvent",
    "SessionEvent",
    "SessionHeader",
    "TruncatedEvent",
    "TurnEvent",
    "UndeliveredEvent",
    "UNDELIVERED_REASONS",
    "TurnRecord",
    "read_event",
]


class JournalError(ValueError):
    """A journal line that is not a known event; the message names the kind or the field."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The event as strict-JSON-ready data, in the journal's key order; unset options left out."""
        return self.model_dump(exclude_none=True)


class SessionHeader(_Event):
    """The first line of a journal: who the session is and what it may spend."""

    kind: Literal["session"] = "session"
    id: str
    api_key: str
    metadata: dict[str, Any]
    budget: Budget
    created_at: float

    def wire(self) -> dict[str, Any]:
        return self.model_dump()  # null budget limits and metadata values are written as they are


class TurnRecord(_Event):
    """A turn's engine facts, as `miles_env.types.Turn` stores them."""

    finish_reason: str
    weight_version: int = 0
    latency_s: float = 0.0
    engine: str = ""


class TurnEvent(_Event):
    """One generation on `branch`: `prompt_ids` (mask 0) then `output_ids` (mask 1) appended."""

    kind: Literal["turn"] = "turn"
    branch: int
    new_branch: bool
    tools_key: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # the engine's, one per output id
    gen_digest: str | None = None  # digest(output_ids, logprobs); absent in journals older than audit
    keys: list[str]  # identity keys of the messages the appended ids encode, the reply's last
    turn: TurnRecord
    parent: int | None = None  # a fork: the parent branch, and the (keys, ids) copied from it
    fork_keys: int | None = None
    fork_tokens: int | None = None
    aliases: dict[str, str] | None = None  # client-visible item id of the reply -> its key
    routed_experts: RoutedExperts | None = None  # MoE: the engine's routing, one row per output id

    @field_serializer("logprobs")
    def _strict(self, lps: list[float]) -> list[float | str]:
        return strictjson.numbers(lps)  # -inf as "-Infinity": strict JSON that round-trips

    def wire(self) -> dict[str, Any]:
        # By hand: `model_dump` copies every id list (~0.3 ms for a 16K-token prompt), on the turn's
        # path. Equal to `model_dump(exclude_none=True)` (tests/test_tito_journal.py checks it).
        out: dict[str, Any] = {
            "kind": self.kind,
            "branch": self.branch,
            "new_branch": self.new_branch,
            "tools_key": self.tools_key,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "logprobs": strictjson.numbers(self.logprobs),
        }
        if self.gen_digest is not None:
            out["gen_digest"] = self.gen_digest
        out["keys"] = self.keys
        out["turn"] = self.turn.model_dump()
        options = (
            ("parent", self.parent),
            ("fork_keys", self.fork_keys),
            ("fork_tokens", self.fork_tokens),
            ("aliases", self.aliases),
            ("routed_experts", self.routed_experts.model_dump() if self.routed_experts else None),
        )
        out.update((name, value) for name, value in options if value is not None)
        return out


UNDELIVERED_REASONS = ("client_gone", "stream_cut", "retried")


class UndeliveredEvent(_Event):
    """The turn of `branch` whose completion starts at `start` was not received by the agent:
    `client_gone` (the client left before the response was sent), `stream_cut` (it left, or the
    send failed, mid-response), `retried` (a later request asked for that same turn again, so the
    agent dropped the reply). Written after the turn's own event; the turn's ids stay as sampled
    and its tokens have mask 0 in every exported sample (session.py)."""

    kind: Literal["undelivered"] = "undelivered"
    branch: int
    start: int  # offset of the turn's first completion token in its branch (Turn.start)
    reason: Literal["client_gone", "stream_cut", "retried"]


class TruncatedEvent(_Event):
    kind: Literal["truncated"] = "truncated"
    reason: str  # the budget: max_turns | max_tokens | wall_time_s | max_context


class AuxEvent(_Event):
    kind: Literal["aux"] = "aux"
    prompt_tokens: int
    completion_tokens: int


class ClosedEvent(_Event):
    kind: Literal["closed"] = "closed"


SessionEvent = TurnEvent | UndeliveredEvent | TruncatedEvent | AuxEvent | ClosedEvent  # after the header
JournalEvent = Annotated[SessionHeader | SessionEvent, Field(discriminator="kind")]
_EVENTS: TypeAdapter[JournalEvent] = TypeAdapter(JournalEvent)
_KINDS = "aux, closed, session, truncated, turn, undelivered"


def read_event(line: bytes) -> JournalEvent:
    """One journal line, validated; raises JournalError naming the unknown kind or the bad field."""
    try:
        return _EVENTS.validate_json(line)
    except ValidationError as e:
        raise JournalError(_explain(e)) from None


def _explain(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return "a journal line is not JSON"
    if kind == "union_tag_invalid":
        return f"unknown event kind {err['ctx']['tag']!r} (known: {_KINDS})"
    if kind == "union_tag_not_found":
        return f"an event without 'kind' (known: {_KINDS})"
    if not err["loc"]:
        return f"an event must be a JSON object: {err['msg']}"
    tag, *loc = err["loc"]
    where = ".".join(str(x) for x in loc) or "event"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{tag} event: {where}: {err['msg']}{more}"
