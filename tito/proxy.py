"""TitoProxy: the dialect-neutral token-in-token-out core.

Concept: `chat(session_id, ChatRequest)` matches the request's messages against
the session's branches (`message_key` per message), reuses the stored ids of a
fully matched branch (sampled assistant turns verbatim, stop token included),
renders and tokenizes only the new tail (plan.py), asks the engine to generate
from the ids, and records prompt tail (mask 0) + sampled ids (mask 1, their
logprobs) as one event. A history that repeats a branch only up to one of its
assistant turns (a retried turn, two requests from one parent) forks a child
branch that copies the parent's ids to that turn verbatim; a history that shares
no turn (edited first turn, compaction, new tools) is rendered in full onto a new
branch: never an error, never a rewrite. `export` applies the config's branch
policy; shared sampled ids get mask 1 in exactly one exported sample (see session.py).

Invariants: a turn is stored only once the engine returned a generation *and*
the caller's `respond` turned it into a response (`serve`): a response that
cannot be serialized stores nothing. Every mask-1 token is an engine output id
with the engine's logprob. Requests of one session run one at a time
(per-session lock), sessions share nothing; rendering and tokenizing run in a
worker thread, so a huge prompt never stalls the event loop (other sessions),
except a small request's, which is planned in-line (cheaper than the thread hop).
Engine refusals (EngineRefused) are the client's 400, other engine failures a 502.
Delivery: a request that asks for a tip turn again (its messages are exactly that turn's
prompt: a retry) marks that turn undelivered before it is served; the HTTP layer marks a
turn whose response did not reach the client (`undelivered`). Neither turn ever trains
(session.py). Faults: a request that fails leaves its class on the session (`fault`).
Lifecycle: create_session -> chat* -> export -> close_session; with a store_dir
the event journal makes all of it survive a restart.

Homes: this module holds the sessions, their locks and the journal writes; what a turn computes
from values alone (context limit, budget breach, max_new, sampling, parsing the generation, the
TurnEvent) is turn.py's; stitching is plan.py's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.errors import EngineRefused
from miles_env.harness import Endpoint
from miles_env.tito.config import Budget, TitoConfig
from miles_env.tito.errors import (
    ProxyError,
    bad_request,
    budget_exceeded,
    context_exceeded,
    engine_failed,
    engine_refused,
    not_found,
    unauthorized,
)
from miles_env.tito.journal import (
    AuxEvent,
    ClosedEvent,
    SessionEvent,
    TruncatedEvent,
    UndeliveredEvent,
)
from miles_env.tito.messages import ChatRequest, ChatResult
from miles_env.tito.parsers import build_parsers
from miles_env.tito.plan import Plan, PromptTooLong, Seen, full_prompt, plan_turn
from miles_env.tito.render import Renderer, TemplateRefused
from miles_env.tito.session import Session, SessionInfo
from miles_env.tito.store import Journal, load_sessions
from miles_env.tito.turn import (
    budget_breach,
    context_limit,
    max_new,
    parse,
    sampling,
    stop_ids,
    turn_event,
)
from miles_env.types import Trajectory

__all__ = ["TitoProxy", "SessionHandle"]

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionHandle:
    session_id: str
    api_key: str


class TitoProxy:
    def __init__(
        self, engine: Engine, tokenizer: Any, config: TitoConfig | None = None, store_dir: Path | None = None
    ) -> None:
        self.engine = engine
        self.config = config or TitoConfig()
        self.renderer = Renderer(
            tokenizer, tool_mode=self.config.tool_mode, stop_token=self.config.stop_token
        )
        self.parsers = build_parsers(
            tokenizer,
            self.config.tool_parser,
            self.config.reasoning_parser,
            native_tools=self.renderer.native_tools,
        )
        self._journal = Journal(Path(store_dir)) if store_dir is not None else None
        self._sessions: dict[str, Session] = {}
        if store_dir is not None:
            self._sessions = {k: s for k, s in load_sessions(Path(store_dir)).items() if not s.closed}
        self._info: EngineInfo | None = None
        # session id -> its last small request's messages and keys (plan.Seen): the next request
        # compares its resent history instead of hashing it; at most ~plan.INLINE_KEY_CHARS of text
        # each, a fraction of the memory of the session's own ids
        self._seen: dict[str, Seen] = {}

    # -- sessions -----------------------------------------------------------------------------------
    def create_session(
        self, metadata: dict[str, Any] | None = None, budget: Budget | None = None
    ) -> SessionHandle:
        sid = secrets.token_hex(8)
        key = "tito-" + secrets.token_urlsafe(24)
        s = Session(sid, key, dict(metadata or {}), self.config.budget.merged(budget), time.time())
        self._sessions[sid] = s
        if self._journal is not None:
            self._journal.append(sid, s.header())
        return SessionHandle(sid, key)

    def _session(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise not_found(f"session {session_id!r} does not exist")
        return s

    def get_session(self, session_id: str) -> SessionInfo:
        return self._session(session_id).info()

    def authenticate(self, session_id: str, api_key: str | None) -> None:
        s = self._session(session_id)
        if api_key is None or not secrets.compare_digest(api_key.encode(), s.api_key.encode()):
            raise unauthorized()

    def export(self, session_id: str) -> list[Trajectory]:
        """One Trajectory per branch kept by `config.branch_policy`, in branch order.

        With a store, the exported samples are also written to `<sid>.export.json`
        (what `tito audit` compares against the journal)."""
        trajs = self._session(session_id).trajectories(self.config.branch_policy)
        if self._journal is not None:
            self._journal.write_export(session_id, self.config.branch_policy, trajs)
        return trajs

    def undelivered(self, session_id: str, branch: int, start: int, reason: str) -> bool:
        """Mark the turn at `start` of `branch` as not received by the agent (`reason`: client_gone |
        stream_cut | retried); it stays stored and never trains. False when the session is gone
        (closed: it was exported before; nothing can train from it any more) or it is marked already."""
        s = self._sessions.get(session_id)
        if s is None or s.closed or (s.origin(branch, start), start) in s.undelivered:
            return False
        self._record(s, UndeliveredEvent.model_validate({"branch": branch, "start": start, "reason": reason}))
        return True

    def note_fault(self, session_id: str, error: ProxyError) -> None:
        """The session's last request failed with `error` (before or outside `serve`, e.g. its body)."""
        s = self._sessions.get(session_id)
        if s is not None:
            s.fault = error.fault

    def close_session(self, session_id: str) -> None:
        """Forget the session in memory; its journal stays on disk, marked closed."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            raise not_found(f"session {session_id!r} does not exist")
        self._seen.pop(session_id, None)
        closed = ClosedEvent()
        s.apply(closed)
        if self._journal is not None:
            self._journal.append(session_id, closed)

    def endpoint(self, session_id: str, base_url: str) -> Endpoint:
        s = self._session(session_id)
        root = f"{base_url.rstrip('/')}/s/{session_id}"
        return Endpoint(f"{root}/v1", s.api_key, session_id, self.config.model_name, root)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    async def engine_info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self.engine.info()
        return self._info

    async def context_limit(self, session_id: str) -> int | None:
        """max_context as `chat` enforces it: the min of the session budget's and the engine's."""
        s = self._session(session_id)
        try:
            info = await self.engine_info()
        except Exception:  # an engine that cannot describe itself fails the first turn, with its error
            return s.budget.max_context
        return context_limit(s, info)

    # -- the core turn --------------------------------------------------------------------------------
    def _record(self, s: Session, event: SessionEvent) -> None:
        """Journal `event` (strict JSON, one write), then apply it: memory never runs ahead of the disk."""
        if self._journal is not None:
            self._journal.append(s.id, event)
        s.apply(event)

    def _truncate(self, s: Session, reason: str) -> None:
        if s.truncated is None:
            self._record(s, TruncatedEvent(reason=reason))

    def _check_budget(self, s: Session) -> None:
        if (breach := budget_breach(s)) is not None:
            self._truncate(s, breach[0])
            raise budget_exceeded(*breach)

    async def _described(self) -> EngineInfo:
        try:
            return await self.engine_info()
        except Exception as e:  # an engine that cannot even describe itself is a transient failure
            raise engine_failed(e) from e

    @contextmanager
    def _refusals(self, s: Session, mark: bool) -> Iterator[None]:
        """Planning's refusals as 400s: a prompt proven too long is a context refusal (marking `s`
        truncated unless `mark` is False), a template that raises is the client's mistake."""
        try:
            yield
        except PromptTooLong as e:
            if mark:
                self._truncate(s, "max_context")
                s.note_first(e.tokens)
            raise context_exceeded(e.tokens, e.limit) from None
        except TemplateRefused as e:
            raise bad_request(f"the chat template refused these messages: {e}", param="messages") from None

    async def _off_loop(self, s: Session, fn: Callable[[], T], *, mark: bool = True) -> T:
        """Run stitching/rendering/tokenizing in a worker thread, its refusals translated to 400s."""
        with self._refusals(s, mark):
            return await anyio.to_thread.run_sync(fn)

    async def _plan(
        self, s: Session, req: ChatRequest, info: EngineInfo, limit: int | None, *, mark: bool = True
    ) -> Plan:
        """Stitch the request (plan.py: in-line when small, else in a worker thread), its refusals
        translated to 400s."""
        _require_messages(req)
        with self._refusals(s, mark):
            return await plan_turn(s, req, self.renderer, limit, stop_ids(self.renderer, info), self._seen)

    def _max_new(
        self, s: Session, req: ChatRequest, prompt_len: int, limit: int | None
    ) -> tuple[int, str | None]:
        if not req.aux:
            s.note_first(prompt_len)
        if limit is not None and prompt_len >= limit:
            self._truncate(s, "max_context")
            raise context_exceeded(prompt_len, limit)
        return max_new(s, req, prompt_len, limit, self.config.default_max_tokens)

    def _sampling(self, req: ChatRequest, max_new_tokens: int, info: EngineInfo) -> SamplingParams:
        return sampling(req, max_new_tokens, stop_ids(self.renderer, info))

    async def _engine(
        self, s: Session, ids: list[int], sampling: SamplingParams, limit: int | None, sid: str | None
    ) -> Generation:
        try:
            return await self.engine.generate(ids, sampling, session_id=sid)
        except EngineRefused as e:  # deterministic: the dialect's own 400, nothing stored
            if e.reason == "context_length":
                self._truncate(s, "max_context")
            raise engine_refused(e, len(ids), limit) from e
        except Exception as e:  # transient: a 5xx the client may retry, nothing stored
            raise engine_failed(e) from e

    def _parse(self, gen: Generation, params: SamplingParams, req: ChatRequest) -> ChatResult:
        return parse(self.renderer, self.parsers, gen, params, req)

    async def count_tokens(self, session_id: str, req: ChatRequest) -> int:
        """The prompt length a request would have, stitched as `chat` would; nothing is generated.

        A prompt whose size alone proves it exceeds max_context is refused like `chat` refuses it
        (context_length_exceeded) rather than tokenized; the session is not marked."""
        s = self._session(session_id)
        async with s.lock:
            info = await self._described()
            return len((await self._plan(s, req, info, context_limit(s, info), mark=False)).prompt)

    async def chat(self, session_id: str, req: ChatRequest) -> ChatResult:
        return await self.serve(session_id, req, _same)

    async def serve(self, session_id: str, req: ChatRequest, respond: Callable[[ChatResult], R]) -> R:
        """One turn: generate, build the client's response with `respond`, only then store the turn.

        `respond` runs under the session lock; when it raises (a response that cannot be
        serialized), nothing is stored and the error propagates."""
        s = self._session(session_id)
        async with s.lock:
            try:
                reply = await self._serve(s, req, respond)
            except ProxyError as e:
                s.fault = e.fault  # None for a budget: the agent's own end
                raise
        return reply

    async def _serve(self, s: Session, req: ChatRequest, respond: Callable[[ChatResult], R]) -> R:
        if s.closed:
            raise not_found(f"session {s.id!r} is closed")
        if not req.aux:
            self._check_budget(s)
        info = await self._described()
        limit = context_limit(s, info)
        if req.aux:
            return await self._aux(s, req, info, limit, respond)
        plan = await self._plan(s, req, info, limit)
        self._mark_retried(s, plan)
        max_new, capped_by = self._max_new(s, req, len(plan.prompt), limit)
        sampling = self._sampling(req, max_new, info)
        # Shielded: a client that disconnects must not lose a turn the engine has sampled.
        with anyio.CancelScope(shield=True):
            reply = await self._generate(s, req, plan, sampling, limit, capped_by, info, respond)
        return reply

    def _mark_retried(self, s: Session, plan: Plan) -> None:
        """A request on a new branch whose messages are exactly a tip turn's prompt asks for that
        turn again: the agent dropped its reply (a retry), which is marked undelivered. An extension
        cannot be one (it carries the reply)."""
        if not plan.new_branch:
            return
        parent = s.branches[plan.parent].keys[: plan.fork_keys] if plan.parent is not None else []
        for branch, start in s.retried([*parent, *plan.keys], plan.tools_key):
            self._record(s, UndeliveredEvent(branch=branch, start=start, reason="retried"))

    async def _aux(
        self,
        s: Session,
        req: ChatRequest,
        info: EngineInfo,
        limit: int | None,
        respond: Callable[[ChatResult], R],
    ) -> R:
        """An auxiliary call: rendered in full, generated, answered, and not recorded anywhere."""
        _require_messages(req)
        ids = await self._off_loop(s, lambda: full_prompt(req, self.renderer, limit))
        max_new, _ = self._max_new(s, req, len(ids), limit)
        sampling = self._sampling(req, max_new, info)
        gen = await self._engine(s, ids, sampling, limit, None)
        r = self._parse(gen, sampling, req)
        reply = respond(replace(r, prompt_tokens=len(ids), branch=-1, meta={**r.meta, "aux": True}))
        # flagged in the journal (counted in SessionInfo.n_aux), never part of a trajectory
        self._record(s, AuxEvent(prompt_tokens=len(ids), completion_tokens=r.completion_tokens))
        return reply

    async def _generate(
        self,
        s: Session,
        req: ChatRequest,
        plan: Plan,
        sampling: SamplingParams,
        limit: int | None,
        capped_by: str | None,
        info: EngineInfo,
        respond: Callable[[ChatResult], R],
    ) -> R:
        t0 = time.perf_counter()
        gen = await self._engine(s, plan.prompt, sampling, limit, s.id)
        latency = time.perf_counter() - t0
        r = self._parse(gen, sampling, req)
        event = turn_event(s, req, plan, gen, r, latency, info.name)
        result = replace(
            r,
            prompt_tokens=len(plan.prompt),
            cached_tokens=len(plan.prompt) - len(plan.delta),
            branch=plan.branch,
            start=len(plan.prompt),  # the completion follows the whole prompt on its branch
        )
        reply = respond(result)  # a response that cannot be built (serialized) stores nothing
        self._record(s, event)
        if gen.finish_reason == "length" and capped_by is not None:
            self._truncate(s, capped_by)
        return reply


def _same(result: ChatResult) -> ChatResult:
    return result


def _require_messages(req: ChatRequest) -> None:
    if not req.messages:  # e.g. only an empty final assistant message: nothing a template can render
        raise bad_request("messages: there is no message with content", param="messages")
