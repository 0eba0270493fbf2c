"""One turn's engine side, from values alone: what it may sample, how, and what it records.

Concept: the proxy (proxy.py) holds the sessions, their locks and the journal; what a turn
computes from its session, request and engine alone lives here: the context limit
(`context_limit`: the min of the session budget's and the engine's), the budget a session has
spent (`budget_breach`: which limit ends it), how many tokens a turn may sample and what caps them
(`max_new`), its SamplingParams (`sampling`: stopping on the configured stop token and the
engine's eos ids, `stop_ids`), the generation as a ChatResult (`parse`: the stop token cut,
reasoning split off, tool calls parsed) and the TurnEvent the journal stores (`turn_event`: with a
MoE engine's per-token routing, `Generation.meta["routed_experts"]`, packed, when it has one row per
sampled id; a record of another length is not kept).

Invariant: nothing here writes or raises a client error: a breach or a cap comes back with its
reason, and the proxy marks the session truncated with that reason before it raises, so the
journal always says why a session ended.
"""

from __future__ import annotations

from miles_env.engines.base import EngineInfo, Generation, SamplingParams
from miles_env.tito.journal import TurnEvent, TurnRecord
from miles_env.tito.messages import ChatRequest, ChatResult, Message, digest
from miles_env.tito.parsers import Parsers
from miles_env.tito.plan import Plan, session_key
from miles_env.tito.render import Renderer
from miles_env.tito.session import Session
from miles_env.types import RoutedExperts

__all__ = ["budget_breach", "context_limit", "max_new", "parse", "sampling", "stop_ids", "turn_event"]


def context_limit(s: Session, info: EngineInfo) -> int | None:
    """max_context: the min of the session budget's and the engine's (None: neither has one)."""
    limits = [x for x in (s.budget.max_context, info.max_context) if x]
    return min(limits) if limits else None


def budget_breach(s: Session) -> tuple[str, str] | None:
    """The first spent budget as (its name, what was used), or None while turns may still run."""
    b = s.budget
    if b.max_turns is not None and s.n_turns >= b.max_turns:
        return "max_turns", f"{s.n_turns} of {b.max_turns} turns used"
    if b.max_tokens is not None and s.sampled_tokens >= b.max_tokens:
        return "max_tokens", f"{s.sampled_tokens} of {b.max_tokens} tokens sampled"
    if b.wall_time_s is not None and s.elapsed() >= b.wall_time_s:
        return "wall_time_s", f"{s.elapsed():.1f}s of {b.wall_time_s}s elapsed"
    return None


def max_new(
    s: Session, req: ChatRequest, prompt_len: int, limit: int | None, default: int
) -> tuple[int, str | None]:
    """The tokens a turn may sample after a prompt that fits `limit`, and the budget that caps them
    (None: the request's own max_tokens, or `default`)."""
    caps: list[tuple[int, str | None]] = [(req.max_tokens or default, None)]
    if limit is not None:
        caps.append((limit - prompt_len, "max_context"))
    if s.budget.max_tokens is not None:
        caps.append((s.budget.max_tokens - s.sampled_tokens, "max_tokens"))
    return min(caps, key=lambda c: c[0])


def stop_ids(renderer: Renderer, info: EngineInfo) -> tuple[int, ...]:
    """The ids a turn ends on: the configured stop token and the engine's eos ids (GLM's several)."""
    return tuple(dict.fromkeys((renderer.stop_id, *info.eos_token_ids)))


def sampling(req: ChatRequest, max_new_tokens: int, stops: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop_token_ids=stops,
        stop=req.stop,
        seed=req.seed,
    )


def parse(
    renderer: Renderer, parsers: Parsers, gen: Generation, params: SamplingParams, req: ChatRequest
) -> ChatResult:
    """The generation as text, content and tool calls (prompt counts left 0 for the caller)."""
    out = list(gen.output_ids)
    body = out[:-1] if out and out[-1] in params.stop_token_ids else out
    text = renderer.decode(body)
    p = parsers.parse(text, req.tools)  # reasoning split off, tool calls parsed (tito/parsers)
    finish = "tool_calls" if p.tool_calls else gen.finish_reason
    return ChatResult(text, p.content, p.tool_calls, finish, 0, len(out), 0, -1, p.meta())


def turn_event(
    s: Session, req: ChatRequest, plan: Plan, gen: Generation, r: ChatResult, latency: float, engine: str
) -> TurnEvent:
    """What the journal stores of a turn: the prompt tail and the sampled ids with their logprobs,
    the message keys that find the branch again, for a fork its parent and shared part, and a MoE
    engine's routing of each sampled id."""
    out, lps = list(gen.output_ids), list(gen.logprobs)
    rows = gen.meta.get("routed_experts")
    akey = session_key(s)(Message("assistant", r.content or "", r.tool_calls))
    fork = plan.parent is not None
    # built from our own values on the turn's path: not validated, and its id lists not copied
    return TurnEvent.model_construct(
        branch=plan.branch,
        new_branch=plan.new_branch,
        tools_key=plan.tools_key,
        prompt_ids=plan.delta,
        output_ids=out,
        logprobs=lps,
        gen_digest=digest(out, lps),  # the engine's record, checked by `tito audit`
        keys=[*plan.keys, akey],
        turn=TurnRecord(
            finish_reason=r.finish_reason,
            weight_version=gen.weight_version,
            latency_s=latency,
            engine=engine,
        ),
        parent=plan.parent,
        fork_keys=plan.fork_keys if fork else None,
        fork_tokens=plan.fork_tokens if fork else None,
        aliases={req.reply_id: akey} if req.reply_id is not None else None,
        routed_experts=RoutedExperts.pack(rows) if rows and len(rows) == len(out) else None,
    )
