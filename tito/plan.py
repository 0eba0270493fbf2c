"""Stitching: the branch a request extends or forks from, and the prompt ids it costs.

Concept: `make_plan` matches the request's message keys against the session's
branches (extension first, then the best fork point, else a full render) and
renders and tokenizes only what is not stored yet (see proxy.py for the rules).
It only reads the session, so it runs in a worker thread while the event loop
serves other sessions (the session's lock is held by the caller).

Bounded: with a context `limit`, each text is measured before it is tokenized; when
its size alone proves the prompt reaches the limit (`Renderer.min_tokens`), the
plan stops with `PromptTooLong` carrying that lower bound, so a megabyte-sized
prompt is refused in microseconds instead of tokenized for seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_env.tito.messages import ChatRequest, message_key, tools_key
from miles_env.tito.render import Renderer
from miles_env.tito.session import Branch, Session

__all__ = ["Plan", "PromptTooLong", "make_plan", "full_prompt"]


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


def _keys(s: Session, req: ChatRequest) -> list[str]:
    alias = s.aliases
    return [alias[m.id] if m.id is not None and m.id in alias else message_key(m) for m in req.messages]


def _ended(r: Renderer, b: Branch, n_ids: int) -> bool:
    return n_ids > 0 and b.loss_mask[n_ids - 1] == 1 and b.token_ids[n_ids - 1] == r.stop_id


def make_plan(s: Session, req: ChatRequest, r: Renderer, limit: int | None) -> Plan:
    keys = _keys(s, req)
    tkey = tools_key(req.tools)
    for b in reversed(s.branches):
        n = len(b.keys)
        if b.tools_key != tkey or n > len(keys) or keys[:n] != b.keys:
            continue
        suffix = r.render_suffix(req.messages[n:], req.tools, tkey)
        if suffix is None:
            break  # the template does not render this tail as a pure suffix: re-render on a new branch
        close = r.assistant_close(req.tools, tkey, _ended(r, b, len(b.token_ids)))
        delta = _encode(r, close + suffix, len(b.token_ids), limit)
        return Plan(b.index, False, b.token_ids + delta, delta, keys[n:], tkey)
    fork = fork_point(s, keys, tkey)
    if fork is not None:
        b, n_keys, n_ids = fork
        suffix = r.render_suffix(req.messages[n_keys:], req.tools, tkey)
        if suffix is not None:
            delta = _encode(r, r.assistant_close(req.tools, tkey, _ended(r, b, n_ids)) + suffix, n_ids, limit)
            prompt = b.token_ids[:n_ids] + delta
            return Plan(len(s.branches), True, prompt, delta, keys[n_keys:], tkey, b.index, n_keys, n_ids)
    ids = _encode(r, r.render_full(req.messages, req.tools), 0, limit)
    return Plan(len(s.branches), True, ids, ids, keys, tkey)


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
