"""ScriptedEngine: an Engine with zero model cost, for tests, demos and benchmarks.

Concept: replies are queued (per session, or globally) as text or as raw ids. A
text reply is encoded with the real tokenizer and ends with the stop token
(`<|im_end|>` for chatml models); an id reply is emitted verbatim, which is how a
test produces ids that would not survive a decode/encode round trip. With no
queued reply the engine falls back to `echo_tokens` filler tokens (benchmarks) or
to `default_reply`.

A scripted *policy* (`ScriptedPolicy`, loaded from JSON with `load_policy`)
plays a fixed script per session instead: rule = (match, replies); a session's
first prompt picks the first rule whose `match` occurs in the decoded prompt,
then its i-th generation is the rule's i-th reply. A reply `{"shell": CMD}`
becomes a `<tool_call>` block for whichever shell tool the prompt offers
(Claude Code `Bash.command`, Codex `exec_command.cmd`, `shell.command`), so one
script drives any harness; past the end of the script the default reply is used.

Invariant: every Generation returned is also appended to `generations` (and the
full call to `calls`), so tests can compare a proxy's trajectory with what the
engine really produced. Logprobs are a deterministic function of (position, id).
`score` (PromptScorer) gives a token that value at its position, as if it had been sampled there;
the calls numbered in `fail_score_calls` (1-based) raise EngineError instead (failure injection).
`cached_tokens` is what a per-session prefix cache would hold, as hf counts it: the
prompt's common prefix with the session's previous prompt + output on this engine,
less the last sampled id (never fed), at most the prompt less one token; a session
that changed engine starts cold, so routing can be checked by it.
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from miles_env.engines.base import EngineInfo, Generation, PrefixCacheStats, SamplingParams
from miles_env.errors import ConfigError, EngineError

__all__ = [
    "ScriptedEngine",
    "ScriptedCall",
    "ScriptedPolicy",
    "PolicyRule",
    "load_policy",
    "oracle_policy",
    "pseudo_logprob",
    "shell_tool_call",
]

Reply = str | Sequence[int]
_PREFIX_SESSIONS = 4096  # sessions whose ids the simulated prefix cache keeps (LRU)
# A policy reply: plain text, or {"shell": CMD, "text": optional prose before the call}.
PolicyReply = str | Mapping[str, str]

# (tool name, argument name) of the shell tool of each harness, most specific first.
SHELL_TOOLS: tuple[tuple[str, str], ...] = (
    ("exec_command", "cmd"),
    ("Bash", "command"),
    ("shell", "command"),
)


@dataclass(frozen=True, slots=True)
class PolicyRule:
    match: str | None  # substring of the decoded first prompt; None matches anything
    replies: tuple[PolicyReply, ...]


@dataclass(frozen=True, slots=True)
class ScriptedPolicy:
    rules: tuple[PolicyRule, ...]

    def pick(self, prompt: str) -> PolicyRule | None:
        return next((r for r in self.rules if r.match is None or r.match in prompt), None)


def load_policy(path: str | Path) -> ScriptedPolicy:
    """Read a policy file: {"rules": [{"match": str|null, "replies": [str | {"shell": str}]}]}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"scripted policy {path}: {e}") from e
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list) or not rules:
        raise ConfigError(f"scripted policy {path}: 'rules' must be a non-empty list")
    out = []
    for i, rule in enumerate(rules):
        replies = rule.get("replies") if isinstance(rule, dict) else None
        if not isinstance(replies, list) or not all(
            isinstance(r, str) or (isinstance(r, dict) and isinstance(r.get("shell"), str)) for r in replies
        ):
            raise ConfigError(
                f"scripted policy {path}: rules[{i}].replies must be strings or {{'shell': str}}"
            )
        out.append(PolicyRule(rule.get("match"), tuple(replies)))
    return ScriptedPolicy(tuple(out))


def shell_tool_call(command: str, prompt: str) -> str:
    """A `<tool_call>` block for the shell tool named in `prompt` (the rendered tool schemas)."""
    name, arg = next(
        ((n, a) for n, a in SHELL_TOOLS if f'"name": "{n}"' in prompt or f'"name":"{n}"' in prompt),
        SHELL_TOOLS[-1],
    )
    body = json.dumps({"name": name, "arguments": {arg: command}}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case (a turn extends the last one), at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])


def pseudo_logprob(position: int, token_id: int) -> float:
    """A deterministic value in [-1.0, -0.001]; distinct enough to catch misalignment."""
    return -(((token_id * 2654435761 + position * 40503) % 1000) + 1) / 1000.0


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str | None
    generation: Generation


class ScriptedEngine:
    """An Engine that emits scripted replies; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any = None,
        replies: Iterable[Reply] = (),
        *,
        echo_tokens: int | None = None,
        default_reply: str = "OK",
        max_context: int = 8192,
        weight_version: int = 0,
        stop_token: str = "<|im_end|>",
        delay_s: float = 0.0,
        record: bool = True,
        policy: ScriptedPolicy | None = None,
        fail_score_calls: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.fail_score_calls, self.score_calls = fail_score_calls, 0
        self.max_context = max_context
        self.weight_version = weight_version
        self.echo_tokens = echo_tokens
        self.default_reply = default_reply
        self.delay_s = delay_s
        self.record = record
        self.stop_id: int | None = None
        if tokenizer is not None:
            sid = tokenizer.convert_tokens_to_ids(stop_token)
            self.stop_id = sid if isinstance(sid, int) and sid >= 0 else tokenizer.eos_token_id
        self._global: deque[Reply] = deque(replies)
        self._per_session: dict[str, deque[Reply]] = defaultdict(deque)
        self.generations: list[Generation] = []
        self.calls: list[ScriptedCall] = []
        self._filler: list[int] = self._make_filler()
        self.policy = policy
        # session id -> (rule picked on its first prompt, replies served so far)
        self._played: dict[str | None, tuple[PolicyRule | None, int]] = {}
        self._prefixes: OrderedDict[str, list[int]] = OrderedDict()  # session -> ids its KV would hold
        self._cache = PrefixCacheStats()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._cache

    def _cached(self, session_id: str | None, input_ids: Sequence[int], output_ids: list[int]) -> int:
        if session_id is None:
            return 0
        held = self._prefixes.pop(session_id, None)
        cached = min(_common_prefix(held, input_ids), len(input_ids) - 1) if held else 0
        self._prefixes[session_id] = [*input_ids, *output_ids][:-1]  # the last sampled id was never fed
        if len(self._prefixes) > _PREFIX_SESSIONS:
            self._prefixes.popitem(last=False)
        return max(cached, 0)

    def _make_filler(self) -> list[int]:
        if self.tokenizer is None:
            return list(range(100, 164))
        ids = self.tokenizer.encode(
            "the quick brown fox jumps over the lazy dog and keeps running ", add_special_tokens=False
        )
        return list(ids)

    def push(self, *replies: Reply, session_id: str | None = None) -> None:
        """Queue replies; with `session_id` they are served only to that session."""
        queue = self._global if session_id is None else self._per_session[session_id]
        queue.extend(replies)

    def _encode_reply(self, reply: Reply) -> list[int]:
        if isinstance(reply, str):
            if self.tokenizer is None or self.stop_id is None:
                raise ValueError("ScriptedEngine: a text reply needs a tokenizer")
            return [*self.tokenizer.encode(reply, add_special_tokens=False), self.stop_id]
        return [int(i) for i in reply]

    def _policy_reply(self, session_id: str | None, input_ids: Sequence[int]) -> str | None:
        if self.policy is None or self.tokenizer is None:
            return None
        prompt = self.tokenizer.decode(list(input_ids))
        rule, step = self._played.get(session_id) or (self.policy.pick(prompt), 0)
        self._played[session_id] = (rule, step + 1)
        if rule is None or step >= len(rule.replies):
            return None
        reply = rule.replies[step]
        if isinstance(reply, str):
            return reply
        text = reply.get("text", "")
        return (text + "\n" if text else "") + shell_tool_call(reply["shell"], prompt)

    def _next_ids(self, session_id: str | None, input_ids: Sequence[int] = ()) -> list[int]:
        queue = self._per_session.get(session_id) if session_id is not None else None
        if queue:
            return self._encode_reply(queue.popleft())
        if self._global:
            return self._encode_reply(self._global.popleft())
        scripted = self._policy_reply(session_id, input_ids)
        if scripted is not None:
            return self._encode_reply(scripted)
        if self.echo_tokens is not None:
            n = max(self.echo_tokens - 1, 0)
            filler = (self._filler * (n // len(self._filler) + 1))[:n]
            return filler + ([self.stop_id] if self.stop_id is not None else [self._filler[0]])
        return self._encode_reply(self.default_reply)

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if self.delay_s > 0:
            await anyio.sleep(self.delay_s)
        else:
            await anyio.lowlevel.checkpoint()
        ids = self._next_ids(session_id, input_ids)
        stops = set(sampling.stop_token_ids)
        if self.stop_id is not None:
            stops.add(self.stop_id)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        if cut is not None:
            ids = ids[:cut]
        finish = "stop" if cut is not None else "length"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        start = len(input_ids)
        gen = Generation(
            output_ids=ids,
            logprobs=[pseudo_logprob(start + i, t) for i, t in enumerate(ids)],
            finish_reason=finish,
            weight_version=self.weight_version,
            prompt_len=len(input_ids),
            cached_tokens=self._cached(session_id, input_ids, ids),
            meta={"matched": ids[-1]} if finish == "stop" else {},  # the stop id, as engines report it
        )
        self._cache = self._cache.add(gen)
        if self.record:
            self.generations.append(gen)
            self.calls.append(ScriptedCall(tuple(input_ids), sampling, session_id, gen))
        return gen

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """PromptScorer, consistent with generate: token t of a sequence scores
        `pseudo_logprob(t, id)`, what it would have been recorded with when sampled there."""
        await anyio.lowlevel.checkpoint()
        self.score_calls += 1
        if self.score_calls in self.fail_score_calls:
            raise EngineError(f"scripted: score call {self.score_calls} fails (fail_score_calls)")
        return [[0.0, *(pseudo_logprob(t, i) for t, i in enumerate(s) if t > 0)][: len(s)] for s in sequences]

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
        return self.weight_version

    async def info(self) -> EngineInfo:
        eos = (self.stop_id,) if self.stop_id is not None else ()
        return EngineInfo("scripted", "scripted", self.weight_version, self.max_context, eos)

    async def close(self) -> None:
        return None


def oracle_policy(pairs: Iterable[tuple[str, str]], check: str = "ls -la") -> dict[str, Any]:
    """A policy file's JSON for (instruction, shell solution) pairs: run it, look, say done.

    Two tool calls per task (the solution, then `check`), matched on the instruction
    text, so one file drives a whole split through any harness with a shell tool.
    """
    ordered = sorted(pairs, key=lambda p: -len(p[0]))  # a longer instruction may contain a shorter one
    rules = [{"match": i, "replies": [{"shell": s}, {"shell": check}, "Done."]} for i, s in ordered]
    return {"rules": rules}
