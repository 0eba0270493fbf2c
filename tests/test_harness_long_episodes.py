"""Long episodes: the CLIs learn the session's context, retry engine failures, compact and finish.

Unit level: a session's `truncated` flag tells the end state (a client that recovers from a
context refusal and finishes is not truncated); each harness passes the session's max_context
to its CLI (Codex config.toml, Claude Code 2.1's context-window variable), keeps Codex's own
bounded retries and offers its multi-agent tools. End to end (real CLIs, scripted policy):
a tool output that overflows a small max_context, the CLI's compaction answered with a summary
by the policy, the task passed, every sampled token in exactly one exported sample; a Codex
sub-agent spawned by the policy, its turns one more exported sample of the same session.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy, shell_tool_call
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CLAUDE_CODE, CODEX, TESTED
from miles_env.harnesses.codex import codex_config_toml, multi_agent_for
from miles_env.models import load_tokenizer
from miles_env.tito import TitoProxy
from miles_env.tito.config import Budget
from miles_env.tito.errors import ProxyError
from miles_env.tito.messages import ChatRequest, Message
from miles_env.types import Episode, Status
from tests.cli_harness_support import TWO_STEP_POLICY, check_exact, require_cli, run_one

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def _ask(text: str) -> ChatRequest:
    return ChatRequest(messages=(Message("user", text),))


async def test_truncated_tells_the_end_state_not_the_history(tok: Any, tmp_path: Path) -> None:
    engine = ScriptedEngine(tok, max_context=4096)
    proxy = TitoProxy(engine, tok, store_dir=tmp_path)
    sid = proxy.create_session(budget=Budget(max_context=64)).session_id
    with pytest.raises(ProxyError) as refused:
        await proxy.chat(sid, _ask("word " * 100))
    assert refused.value.code == "context_length_exceeded"
    assert proxy.get_session(sid).truncated == "max_context"
    # The client recovers (compacts, asks shorter) and is answered in full: not truncated any more.
    engine.push("fine")
    assert (await proxy.chat(sid, _ask("hi"))).finish_reason == "stop"
    assert proxy.get_session(sid).truncated is None
    # A replayed journal says the same.
    assert TitoProxy(engine, tok, store_dir=tmp_path).get_session(sid).truncated is None
    # The last turn cut by the context: truncated again, and so after a replay.
    engine.push("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3)
    assert (await proxy.chat(sid, _ask("more"))).finish_reason == "length"
    assert proxy.get_session(sid).truncated == "max_context"
    assert TitoProxy(engine, tok, store_dir=tmp_path).get_session(sid).truncated == "max_context"


def test_codex_config_carries_context_retries_and_multi_agent() -> None:
    cfg = tomllib.loads(codex_config_toml("http://h/v1", "policy", context=32768, auto_compact=0.75))
    assert cfg["model_context_window"] == 32768 and cfg["model_auto_compact_token_limit"] == 24576
    provider = cfg["model_providers"]["tito"]
    assert provider["request_max_retries"] == provider["stream_max_retries"] == 4
    assert cfg["features"] == {"multi_agent": True}
    assert (
        get_harness("codex").config.multi_agent is None
    )  # on where it fits: TITO carries the namespace tools
    assert multi_agent_for(None, None) and multi_agent_for(None, 32768)
    assert not multi_agent_for(None, 8192)  # SmolLM2: the tools alone would overflow the first prompt
    assert not multi_agent_for(False, 32768) and multi_agent_for(True, 8192)
    bare = tomllib.loads(codex_config_toml("http://h/v1", "policy", retries=0, multi_agent=False))
    assert "model_context_window" not in bare and "model_auto_compact_token_limit" not in bare
    assert bare["model_providers"]["tito"]["request_max_retries"] == 0
    assert bare["features"] == {"multi_agent": False}


def test_claude_code_21_is_told_the_context_20_has_no_variable_for_it() -> None:
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x", max_context=40000)
    new, old = TESTED["claude-code"]
    env = get_harness("claude-code", version=new.version).env("http://h/s/x", ep)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "40000"
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in get_harness("claude-code", version=old.version).env(
        "http://h/s/x", ep
    )
    unknown = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in get_harness("claude-code").env("http://h/s/x", unknown)


# The CLIs' own compaction requests (the summarization instruction ends the prompt).
COMPACTION = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION",  # Codex
    "Your task is to create a detailed summary of the conversation so far",  # Claude Code
)
SUMMARY = "first.txt holds alpha; what remains: write second.txt as the content of first.txt plus ' beta'."


class CompactingEngine(ScriptedEngine):
    """The scripted policy for the agent's turns; a summary (Claude Code wants it in <summary> tags)
    for the CLI's compaction requests, which do not advance the policy."""

    def _next_ids(self, session_id: str | None, input_ids: Sequence[int] = ()) -> list[int]:
        if is_compaction(self.tokenizer.decode(list(input_ids[-1500:]))):
            return self._encode_reply(f"<analysis>Two steps.</analysis>\n<summary>{SUMMARY}</summary>")
        return super()._next_ids(session_id, input_ids)


def is_compaction(prompt_tail: str) -> bool:
    return any(mark in prompt_tail for mark in COMPACTION)


def long_policy(*outputs: int) -> ScriptedPolicy:
    """Tool outputs of `seq 1 N` (one token per character with this tokenizer) fill the context."""
    first, *more = outputs
    return ScriptedPolicy(
        (
            PolicyRule(
                "first.txt",
                (
                    {"shell": f"seq 1 {first}; echo alpha > first.txt"},
                    *({"shell": f"seq 1 {n}"} for n in more),
                    {"shell": 'echo "$(cat first.txt) beta" > second.txt'},
                    "Both files are written.",
                ),
            ),
        )
    )


def check_compacted(ep: Episode, engine: CompactingEngine, store: Path, limit: int) -> int:
    """Passed after at least one compaction; every turn fit; exact tokens, clean audit. -> compactions."""
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    prompts = [engine.tokenizer.decode(list(c.input_ids)) for c in engine.calls]
    tails = [engine.tokenizer.decode(list(c.input_ids[-1500:])) for c in engine.calls]
    compactions = [i for i, tail in enumerate(tails) if is_compaction(tail)]
    assert compactions, [len(c.input_ids) for c in engine.calls]
    # After the first compaction the CLI goes on from the summary, on a new, shorter history.
    after = [p for i, p in enumerate(prompts) if i > compactions[0] and i not in compactions]
    assert after and any(SUMMARY in p for p in after)
    assert all(len(c.input_ids) + len(c.generation.output_ids) <= limit for c in engine.calls)
    check_exact(ep, engine, store)  # every sampled token in exactly one exported sample
    return len(compactions)


@pytest.mark.slow
async def test_codex_compacts_before_the_context_overflows(tok: Any, tmp_path: Path) -> None:
    """Codex is told the window (12k) and compacts at 80% of it. Without it, the 4k-token output
    below takes the next request past 12k and Codex ends at the proxy's context_length_exceeded:
    Codex 0.171 does not compact on that error ("Codex ran out of room in the model's context
    window"), so telling it the window is what keeps a long episode alive."""
    require_cli(CODEX)
    limit = 12000  # the first prompt is ~9.0k tokens (~6.3k without the multi-agent tools)
    engine = CompactingEngine(tok, policy=long_policy(1000), max_context=limit)
    # At Codex's own output size (the harness's window-sized cap would cut the output below the
    # compaction limit, tests/test_harness_overflow.py): here compaction itself is the point.
    ep = await run_one(
        "codex", engine, tmp_path / "store", budget_s=240, extra_config="tool_output_token_limit = 2500"
    )
    assert check_compacted(ep, engine, tmp_path / "store", limit) == 1
    assert ep.metadata["transcript"][-1] == {"role": "assistant", "content": "Both files are written."}


@pytest.mark.slow
async def test_claude_code_compacts_before_the_context_overflows(tok: Any, tmp_path: Path) -> None:
    """Claude Code 2.1 is told the window (CLAUDE_CODE_MAX_CONTEXT_TOKENS=32k, 2k-token replies):
    it compacts as the tool outputs grow (~7k, then ~24k tokens) and finishes the task."""
    require_cli(CLAUDE_CODE)
    limit = 32000  # the first prompt is ~3.2k tokens with the Bash tool only
    engine = CompactingEngine(tok, policy=long_policy(1600, 5000), max_context=limit)
    ep = await run_one(
        "claude-code", engine, tmp_path / "store", budget_s=240, tools="Bash", output_tokens=2000,
        extra_env={"BASH_MAX_OUTPUT_LENGTH": "30000"},  # Claude Code's own (the harness's would cut them)
    )  # fmt: skip
    assert check_compacted(ep, engine, tmp_path / "store", limit) >= 1
    assert ep.metadata["harness"]["output"]["result"] == "Both files are written."


SUB_TASK = "Sub-task: write alpha into first.txt."


class SubAgentEngine(ScriptedEngine):
    """Plays both sides of a Codex sub-agent episode in one session, by prompt (turns interleave):
    the parent (offered spawn_agent) spawns a sub-agent, waits for it, writes second.txt and
    finishes; the sub-agent (no spawn_agent: Codex gives sub-agents no multi-agent tools) writes
    first.txt and reports."""

    def _next_ids(self, session_id: str | None, input_ids: Sequence[int] = ()) -> list[int]:
        prompt = self.tokenizer.decode(list(input_ids))
        turn = prompt.count("<|im_start|>assistant") - 1  # the prompt ends opening the reply
        if '"name": "spawn_agent"' not in prompt:
            sub = (shell_tool_call("echo alpha > first.txt", prompt), "first.txt holds alpha.")
            return self._encode_reply(sub[min(turn, 1)])
        agent = re.search(r'"agent_id":\s*"([^"]+)"', prompt)
        replies = (
            _call("spawn_agent", {"message": SUB_TASK}),
            _call("wait_agent", {"targets": [agent.group(1) if agent else "?"], "timeout_ms": 60000}),
            shell_tool_call('echo "$(cat first.txt) beta" > second.txt', prompt),
            "Both files are written.",
        )
        return self._encode_reply(replies[min(turn, 3)])


def _call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.slow
async def test_codex_sub_agent_episode_is_exact(tok: Any, tmp_path: Path) -> None:
    """Codex's multi-agent tools (on by default): the policy spawns a sub-agent, which writes
    first.txt in the same sandbox; the parent waits for it and finishes the task. The sub-agent's
    turns are a branch of the same session: every sampled token in exactly one exported sample."""
    require_cli(CODEX)
    engine = SubAgentEngine(tok, max_context=1 << 20)
    ep = await run_one("codex", engine, tmp_path / "store", budget_s=180)
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    collab = [
        e["item"]
        for e in ep.metadata["harness"]["output"]
        if e.get("type") == "item.completed" and e["item"]["type"] == "collab_tool_call"
    ]
    assert [c["tool"] for c in collab] == ["spawn_agent", "wait"] and collab[0]["prompt"] == SUB_TASK
    assert [s["status"] for s in collab[1]["agents_states"].values()] == ["completed"]
    prompts = [tok.decode(list(c.input_ids)) for c in engine.calls]
    subs = [p for p in prompts if '"name": "spawn_agent"' not in p]
    assert len(engine.calls) == 6 and len(subs) == 2 and all(SUB_TASK in p for p in subs)
    assert len(ep.samples) == 2  # the parent's branch and the sub-agent's
    check_exact(ep, engine, tmp_path / "store")


class FlakyEngine(ScriptedEngine):
    """Fails its `fail_at`-th generation once (a transient error: the proxy answers 502)."""

    def __init__(self, *args: Any, fail_at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.attempts = fail_at, 0

    async def generate(
        self, input_ids: Sequence[int], sampling: Any, *, session_id: str | None = None
    ) -> Any:
        self.attempts += 1
        if self.attempts == self.fail_at:
            raise RuntimeError("injected engine failure")
        return await super().generate(input_ids, sampling, session_id=session_id)


@pytest.mark.slow
async def test_codex_retries_a_transient_engine_failure(tok: Any, tmp_path: Path) -> None:
    """The engine fails the second turn once: Codex retries it (its own bounded retries) and the
    episode passes, with the retried turn stored once."""
    require_cli(CODEX)
    engine = FlakyEngine(tok, policy=TWO_STEP_POLICY, max_context=1 << 20, fail_at=2)
    ep = await run_one("codex", engine, tmp_path / "store", budget_s=150)
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    assert engine.attempts == 4 and len(engine.generations) == 3
    check_exact(ep, engine, tmp_path / "store")
