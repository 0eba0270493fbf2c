"""TitoProxy: the dialect-neutral token-in-token-out core.

Concept: `chat(session_id, ChatRequest)` matches the request's messages against
the session's branches (`message_key` per message), reuses the stored ids of a
fully matched branch (sampled assistant turns verbatim, stop token included),
renders and tokenizes only the new tail, asks the engine to generate from the
ids, and records prompt tail (mask 0) + sampled ids (mask 1, their logprobs) as
one event. A history that repeats a branch only up to one of its assistant turns
(a retried turn, two requests from one parent) forks a child branch that copies
the parent's ids to that turn verbatim; a history that shares no turn (edited
first turn, compaction, new tools) is rendered in full onto a new branch: never
an error, never a rewrite. `export` applies the config's branch policy; shared
sampled ids get mask 1 in exactly one exported sample (see session.py).

Invariants: nothing is stored unless the engine returned a generation; every
mask-1 token is an engine output id with the engine's logprob; requests of one
session run one at a time (per-session lock), sessions share nothing.
Lifecycle: create_session -> chat* -> export -> close_session; with a store_dir
the event journal makes all of it survive a restart.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from miles_env.tito.config import Budget, TitoConfig
from miles_env.tito.errors import ProxyError, budget_exceeded, context_exceeded, not_found, unauthorized
from miles_env.tito.messages import ChatRequest, ChatResult, Message, digest, message_key, tools_key
from miles_env.tito.render import Renderer
from miles_env.tito.session import Session, SessionInfo
from miles_env.tito.store import Journal, load_sessions
from miles_env.tito.toolparse import parse_tool_calls

from miles_env.engines.base import Engine, EngineInfo, SamplingParams
from miles_env.harness import Endpoint
from miles_env.types import Trajectory

__all__ = ["TitoProxy", "SessionHandle"]


@dataclass(frozen=True, slots=True)
class SessionHandle:
    session_id: str
    api_key: str


@dataclass(frozen=True, slots=True)
class _Plan:
    branch: int
    new_branch: bool
    prompt: list[int]  # the full prompt sent to the engine
    delta: list[int]  # the part of `prompt` not yet stored on the branch
    keys: list[str]  # message keys the delta adds
    tools_key: str
    parent: int | None = None  # for a fork: the parent branch, and its (keys, ids) copied
    fork_keys: int = 0
    fork_tokens: int = 0


class TitoProxy:
    def __init__(
        self, engine: Engine, tokenizer: Any, config: TitoConfig | None = None, store_dir: Path | None = None
    ) -> None:
        self.engine = engine
        self.config = config or TitoConfig()
        self.renderer = Renderer(
            tokenizer, tool_mode=self.config.tool_mode, stop_token=self.config.stop_token
        )
        self._journal = Journal(Path(store_dir)) if store_dir is not None else None
        self._sessions: dict[str, Session] = {}
        if store_dir is not None:
            self._sessions = {k: s for k, s in load_sessions(Path(store_dir)).items() if not s.closed}
        self._info: EngineInfo | None = None

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

    def close_session(self, session_id: str) -> None:
        """Forget the session in memory; its journal stays on disk, marked closed."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            raise not_found(f"session {session_id!r} does not exist")
        s.apply({"kind": "closed"})
        if self._journal is not None:
            self._journal.append(session_id, {"kind": "closed"})

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

    # -- the core turn --------------------------------------------------------------------------------
    def _record(self, s: Session, event: dict[str, Any]) -> None:
        s.apply(event)
        if self._journal is not None:
            self._journal.append(s.id, event)

    def _truncate(self, s: Session, reason: str) -> None:
        if s.truncated is None:
            self._record(s, {"kind": "truncated", "reason": reason})

    def _check_budget(self, s: Session) -> None:
        b = s.budget
        if b.max_turns is not None and s.n_turns >= b.max_turns:
            self._truncate(s, "max_turns")
            raise budget_exceeded("max_turns", f"{s.n_turns} of {b.max_turns} turns used")
        if b.max_tokens is not None and s.sampled_tokens >= b.max_tokens:
            self._truncate(s, "max_tokens")
            raise budget_exceeded("max_tokens", f"{s.sampled_tokens} of {b.max_tokens} tokens sampled")
        if b.wall_time_s is not None and s.elapsed() >= b.wall_time_s:
            self._truncate(s, "wall_time_s")
            raise budget_exceeded("wall_time_s", f"{s.elapsed():.1f}s of {b.wall_time_s}s elapsed")

    def _keys(self, s: Session, req: ChatRequest) -> list[str]:
        alias = s.aliases
        return [alias[m.id] if m.id is not None and m.id in alias else message_key(m) for m in req.messages]

    def _plan(self, s: Session, req: ChatRequest) -> _Plan:
        keys = self._keys(s, req)
        tkey = tools_key(req.tools)
        r = self.renderer
        for b in reversed(s.branches):
            n = len(b.keys)
            if b.tools_key != tkey or n > len(keys) or keys[:n] != b.keys:
                continue
            suffix = r.render_suffix(req.messages[n:], req.tools, tkey)
            if suffix is None:
                break  # the template does not render this tail as a pure suffix: re-render on a new branch
            delta = r.encode(r.assistant_close(req.tools, tkey, self._ended(b, len(b.token_ids))) + suffix)
            return _Plan(b.index, False, b.token_ids + delta, delta, keys[n:], tkey)
        fork = self._fork_point(s, keys, tkey)
        if fork is not None:
            b, n_keys, n_ids = fork
            suffix = r.render_suffix(req.messages[n_keys:], req.tools, tkey)
            if suffix is not None:
                delta = r.encode(r.assistant_close(req.tools, tkey, self._ended(b, n_ids)) + suffix)
                prompt = b.token_ids[:n_ids] + delta
                return _Plan(
                    len(s.branches), True, prompt, delta, keys[n_keys:], tkey, b.index, n_keys, n_ids
                )
        ids = r.encode(r.render_full(req.messages, req.tools))
        return _Plan(len(s.branches), True, ids, ids, keys, tkey)

    def _ended(self, b: Any, n_ids: int) -> bool:
        return n_ids > 0 and b.loss_mask[n_ids - 1] == 1 and b.token_ids[n_ids - 1] == self.renderer.stop_id

    @staticmethod
    def _fork_point(s: Session, keys: list[str], tkey: str) -> tuple[Any, int, int] | None:
        """The branch and turn end (keys, ids) sharing the longest history with `keys`, if any."""
        best: tuple[Any, int, int] | None = None
        for b in s.branches:
            if b.tools_key != tkey:
                continue
            n, lim = 0, min(len(b.keys), len(keys))
            while n < lim and b.keys[n] == keys[n]:
                n += 1
            for n_keys, n_ids in reversed(b.marks):
                if n_keys <= n:
                    if best is None or n_keys > best[1]:
                        best = (b, n_keys, n_ids)
                    break
        return best

    def _max_new(
        self, s: Session, req: ChatRequest, prompt_len: int, info: EngineInfo
    ) -> tuple[int, str | None]:
        limits = [x for x in (s.budget.max_context, info.max_context) if x]
        limit = min(limits) if limits else None
        if limit is not None and prompt_len >= limit:
            self._truncate(s, "max_context")
            raise context_exceeded(
                f"prompt of {prompt_len} tokens leaves no room in the context of {limit} tokens "
                "(max_context: min of the session budget and the engine)"
            )
        want = req.max_tokens or self.config.default_max_tokens
        caps: list[tuple[int, str | None]] = [(want, None)]
        if limit is not None:
            caps.append((limit - prompt_len, "max_context"))
        if s.budget.max_tokens is not None:
            caps.append((s.budget.max_tokens - s.sampled_tokens, "max_tokens"))
        return min(caps, key=lambda c: c[0])

    def _sampling(self, req: ChatRequest, max_new: int, info: EngineInfo) -> SamplingParams:
        stops = tuple(dict.fromkeys((self.renderer.stop_id, *info.eos_token_ids)))
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop_token_ids=stops,
            stop=req.stop,
            seed=req.seed,
        )

    async def count_tokens(self, session_id: str, req: ChatRequest) -> int:
        """The prompt length a request would have, stitched as `chat` would; nothing is generated."""
        s = self._session(session_id)
        async with s.lock:
            return len(self._plan(s, req).prompt)

    async def _aux(self, s: Session, req: ChatRequest) -> ChatResult:
        """An auxiliary call: rendered in full, generated, answered, and not recorded anywhere."""
        info = await self.engine_info()
        ids = self.renderer.encode(self.renderer.render_full(req.messages, req.tools))
        max_new, _ = self._max_new(s, req, len(ids), info)
        try:
            gen = await self.engine.generate(ids, self._sampling(req, max_new, info), session_id=None)
        except Exception as e:
            raise ProxyError(502, f"engine failed: {e}", type="server_error", code="engine_error") from e
        out = list(gen.output_ids)
        body = out[:-1] if out and out[-1] == self.renderer.stop_id else out
        text = self.renderer.decode(body)
        content, calls = parse_tool_calls(text) if req.tools else (text, ())
        finish = "tool_calls" if calls else gen.finish_reason
        # flagged in the journal (counted in SessionInfo.n_aux), never part of a trajectory
        self._record(s, {"kind": "aux", "prompt_tokens": len(ids), "completion_tokens": len(out)})
        return ChatResult(text, content, calls, finish, len(ids), len(out), 0, -1, {"aux": True})

    async def chat(self, session_id: str, req: ChatRequest) -> ChatResult:
        s = self._session(session_id)
        async with s.lock:
            if s.closed:
                raise not_found(f"session {session_id!r} is closed")
            if req.aux:
                return await self._aux(s, req)
            self._check_budget(s)
            info = await self.engine_info()
            plan = self._plan(s, req)
            max_new, capped_by = self._max_new(s, req, len(plan.prompt), info)
            sampling = self._sampling(req, max_new, info)
            # Shielded: a client that disconnects must not lose a turn the engine has sampled.
            with anyio.CancelScope(shield=True):
                return await self._generate(s, req, plan, sampling, info, capped_by)

    async def _generate(
        self,
        s: Session,
        req: ChatRequest,
        plan: _Plan,
        sampling: SamplingParams,
        info: EngineInfo,
        capped_by: str | None,
    ) -> ChatResult:
        t0 = time.perf_counter()
        try:
            gen = await self.engine.generate(plan.prompt, sampling, session_id=s.id)
        except Exception as e:  # an engine failure is reported to the client; nothing is stored
            raise ProxyError(502, f"engine failed: {e}", type="server_error", code="engine_error") from e
        latency = time.perf_counter() - t0
        out = list(gen.output_ids)
        body = out[:-1] if out and out[-1] in sampling.stop_token_ids else out
        text = self.renderer.decode(body)
        content, calls = parse_tool_calls(text) if req.tools else (text, ())
        finish = "tool_calls" if calls else gen.finish_reason
        assistant = Message("assistant", content or "", calls)
        akey = message_key(assistant)
        lps = list(gen.logprobs)
        event: dict[str, Any] = {
            "kind": "turn",
            "branch": plan.branch,
            "new_branch": plan.new_branch,
            "tools_key": plan.tools_key,
            "prompt_ids": plan.delta,
            "output_ids": out,
            "logprobs": lps,
            "gen_digest": digest(out, lps),  # the engine's record, checked by `tito audit`
            "keys": [*plan.keys, akey],
            "turn": {
                "finish_reason": finish,
                "weight_version": gen.weight_version,
                "latency_s": latency,
                "engine": info.name,
            },
        }
        if plan.parent is not None:
            event.update(parent=plan.parent, fork_keys=plan.fork_keys, fork_tokens=plan.fork_tokens)
        if req.reply_id is not None:
            event["aliases"] = {req.reply_id: akey}
        self._record(s, event)
        if gen.finish_reason == "length" and capped_by is not None:
            self._truncate(s, capped_by)
        return ChatResult(
            text=text,
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=len(plan.prompt),
            completion_tokens=len(out),
            cached_tokens=len(plan.prompt) - len(plan.delta),
            branch=plan.branch,
        )
