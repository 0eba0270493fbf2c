"""Stitching: the branch a request extends or forks from, and the prompt ids it costs.

Concept: `make_plan` matches the request's message keys against the session's
branches (extension first, then the best fork point, else a full render) and
renders and tokenizes only what is not stored yet (see proxy.py for the rules).
It only reads the session (the caller holds the session's lock), so a large plan
runs in a worker thread while the event loop serves other sessions; a small one
runs in-line (`inline_chars`: Offload stops it before it renders more than that); `plan_turn`
makes that choice for the proxy, from the request's text sizes.

Bounded: with a context `limit`, each text is measured before it is tokenized; when
its size alone proves the prompt reaches the limit (`Renderer.min_tokens`), the
plan stops with `PromptTooLong` carrying that lower bound, so a megabyte-sized
prompt is refused in microseconds instead of tokenized for seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from miles_env.tito.messages import ChatRequest, Message, ToolCall, key_function, tools_key
from miles_env.tito.render import Renderer
from miles_env.tito.session import Branch, Session

__all__ = [
    "Plan",
    "PromptTooLong",
    "Offload",
    "Seen",
    "make_plan",
    "plan_turn",
    "full_prompt",
    "request_keys",
    "text_size",
]


class PromptTooLong(Exception):
    """The prompt has at least `tokens` tokens, which is no less than `limit`."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(tokens, limit)
        self.tokens = tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Plan:
    branch: int
    new_branch: bool
    prompt: list[int]  # the full prompt sent to the engine
    delta: list[int]  # the part of `prompt` not yet stored on the branch
    keys: list[str]  # message keys the delta adds
    tools_key: str
    parent: int | None = None  # for a fork: the parent branch, and its (keys, ids) copied
    fork_keys: int = 0
    fork_tokens: int = 0


def _encode(r: Renderer, text: str, before: int, limit: int | None) -> list[int]:
    """`text`'s ids, unless its size proves `before` + them reach `limit`."""
    if limit is not None:
        least = before + r.min_tokens(text)
        if least >= limit:
            raise PromptTooLong(least, limit)
    return r.encode(text)


def session_key(s: Session) -> Callable[[Message], str]:
    """The key scheme the session's stored keys use (messages.key_function)."""
    return key_function(s.branches[0].keys[0] if s.branches and s.branches[0].keys else None)


@dataclass(frozen=True, slots=True)
class Seen:
    """A session's previous request: its messages and their keys, by place."""

    messages: tuple[Message, ...]
    keys: list[str]
    key: Callable[[Message], str]  # the scheme they were computed with


def request_keys(s: Session, req: ChatRequest, seen: Seen | None = None) -> list[str]:
    """The keys of the request's messages (an alias the proxy handed out first). A message equal to the
    one at its place in `seen` reuses that key: an agent resends its whole history every turn, and
    comparing it (memcmp) costs a fraction of hashing it."""
    alias, key = s.aliases, session_key(s)
    old, old_keys = (seen.messages, seen.keys) if seen is not None and seen.key is key else ((), [])
    n_old = len(old)
    out: list[str] = []
    for i, m in enumerate(req.messages):
        if m.id is not None and m.id in alias:
            out.append(alias[m.id])
        elif i < n_old and old[i] == m:
            out.append(old_keys[i])
        else:
            out.append(key(m))
    return out


def _stop(r: Renderer, b: Branch, n_ids: int, stops: Collection[int]) -> str | None:
    """The text of the stop token that ends the turn at `n_ids`, if it was sampled (not cut by length)."""
    if n_ids == 0 or b.loss_mask[n_ids - 1] != 1:
        return None
    last = b.token_ids[n_ids - 1]
    return r.decode([last]) if last == r.stop_id or last in stops else None


def _calls(req: ChatRequest, n: int) -> tuple[ToolCall, ...]:
    """The tool calls of the stored turn the request's tail follows (its message `n - 1`)."""
    return req.messages[n - 1].tool_calls if n > 0 else ()


class Offload(Exception):
    """Planning in-line would render and tokenize more than `inline_chars`: redo it in a thread."""


def text_size(messages: Sequence[Message]) -> int:
    """Characters of the messages' texts (content, tool-call arguments): what rendering costs."""
    return sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)


def within(obj: Any, budget: int) -> bool:
    """Whether parsed JSON `obj` holds at most `budget` characters and values (stops once over)."""
    stack, n = [obj], 0
    while stack:
        v = stack.pop()
        n += 1
        kind = type(v)
        if kind is str:
            n += len(v)
        elif kind is dict:
            n += sum(len(k) for k in v)
            stack.extend(v.values())
        elif kind is list or kind is tuple:
            stack.extend(v)
        if n > budget:
            return False
    return True


def make_plan(
    s: Session,
    req: ChatRequest,
    r: Renderer,
    limit: int | None,
    *,
    keys: list[str] | None = None,
    inline_chars: int | None = None,
    stops: Collection[int] = (),
) -> Plan:
    """The plan of `req` on `s`. With `inline_chars`, raises Offload before rendering more text than that.
    `stops`: the ids the engine stops on besides the renderer's stop token (its eos ids)."""
    keys = request_keys(s, req) if keys is None else keys
    tkey = tools_key(req.tools)

    def check(messages: Sequence[Message]) -> None:
        if inline_chars is not None and text_size(messages) > inline_chars:
            raise Offload

    for b in reversed(s.branches):
        n = len(b.keys)
        if b.tools_key != tkey or n > len(keys) or keys[:n] != b.keys:
            continue
        check(req.messages[n:])
        tail, after = req.messages[n:], _calls(req, n)
        suffix = r.render_suffix(tail, req.tools, tkey, after)
        if suffix is None:
            break  # the template does not render this tail as a pure suffix: re-render on a new branch
        text = r.after_turn(suffix, req.tools, tkey, _stop(r, b, len(b.token_ids), stops), tail, after)
        delta = _encode(r, text, len(b.token_ids), limit)
        return Plan(b.index, False, b.token_ids + delta, delta, keys[n:], tkey)
    fork = fork_point(s, keys, tkey)
    if fork is not None:
        b, n_keys, n_ids = fork
        check(req.messages[n_keys:])
        tail, after = req.messages[n_keys:], _calls(req, n_keys)
        suffix = r.render_suffix(tail, req.tools, tkey, after)
        if suffix is not None:
            text = r.after_turn(suffix, req.tools, tkey, _stop(r, b, n_ids, stops), tail, after)
            delta = _encode(r, text, n_ids, limit)
            prompt = b.token_ids[:n_ids] + delta
            return Plan(len(s.branches), True, prompt, delta, keys[n_keys:], tkey, b.index, n_keys, n_ids)
    check(req.messages)
    ids = _encode(r, r.render_full(req.messages, req.tools), 0, limit)
    return Plan(len(s.branches), True, ids, ids, keys, tkey)


# In-line planning (no thread hop, ~40 us and more under GIL contention) when hashing the texts
# costs about as much (sha256, ~0.1 ms for 128K characters) and the tail to render and tokenize
# is short (tokenizing 4K characters, ~1K tokens, holds the GIL anyway: render.py).
INLINE_KEY_CHARS = 128 * 1024
_INLINE_RENDER_CHARS = 4096


async def plan_turn(
    s: Session,
    req: ChatRequest,
    r: Renderer,
    limit: int | None,
    stops: Collection[int],
    seen: MutableMapping[str, Seen],
) -> Plan:
    """`make_plan` in-line when the request is small enough that a thread hop would cost more than
    the work (measured from its texts' sizes before hashing, and from the tail's before rendering);
    otherwise, or as soon as planning finds more to render, in a worker thread. `seen` (session id
    -> its last small request) is updated: a large request is hashed in full, and not kept."""
    keys = None
    if text_size(req.messages) <= INLINE_KEY_CHARS and within(req.tools, INLINE_KEY_CHARS):
        keys = request_keys(s, req, seen.get(s.id))
        seen[s.id] = Seen(req.messages, keys, session_key(s))
        try:
            return make_plan(s, req, r, limit, keys=keys, inline_chars=_INLINE_RENDER_CHARS, stops=stops)
        except Offload:
            pass
    else:
        seen.pop(s.id, None)
    return await anyio.to_thread.run_sync(lambda: make_plan(s, req, r, limit, keys=keys, stops=stops))


def full_prompt(req: ChatRequest, r: Renderer, limit: int | None) -> list[int]:
    """The fully rendered prompt of an auxiliary request (never stitched)."""
    return _encode(r, r.render_full(req.messages, req.tools), 0, limit)


def fork_point(s: Session, keys: list[str], tkey: str) -> tuple[Any, int, int] | None:
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
