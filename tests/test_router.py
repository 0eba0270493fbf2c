"""Several engines behind one client: SGLang's real router (sglang-router) or our hash ring.

The engines are ScriptedEngines behind the embedded SGLang server, in this process (so a test
sees which engine served which session) or as subprocesses (tests/scripted_server.py) that a test
kills with SIGKILL. Every reply names the engine that served it, and `cached_tokens` is the
scripted engine's per-session prefix cache: a session that changed engine starts cold.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from pydantic import ValidationError

from miles_env.engines import SGLangEngineConfig, build_engine
from miles_env.engines.base import Generation, PrefixCacheCounter, PrefixCacheStats, SamplingParams
from miles_env.engines.router import router_workers
from miles_env.engines.scripted import ScriptedEngine
from miles_env.engines.sglang import SGLangEngine
from miles_env.engines.sglang_server import running_server
from miles_env.errors import ConfigError, EngineError
from miles_env.http import free_port
from miles_env.models import load_tokenizer
from miles_env.types import Status

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scripted_server import ScriptedServer  # noqa: E402

pytestmark = pytest.mark.anyio
SAMPLING = SamplingParams(max_new_tokens=16)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def _routed(urls: list[str], tmp_path: Path) -> SGLangEngineConfig:
    return SGLangEngineConfig(urls=urls, router="sglang-router", log_dir=str(tmp_path))


async def _turns(engine: SGLangEngine, prompts: dict[str, list[int]]) -> dict[str, Generation | EngineError]:
    """One turn of every session at once: a Generation, or the EngineError it failed with."""
    out: dict[str, Generation | EngineError] = {}

    async def one(sid: str) -> None:
        try:
            out[sid] = await engine.generate(prompts[sid], SAMPLING, session_id=sid)
        except EngineError as e:
            out[sid] = e

    async with anyio.create_task_group() as tg:
        for sid in prompts:
            tg.start_soon(one, sid)
    return out


def _served_by(tok: Any, gen: Generation | EngineError) -> str:
    assert isinstance(gen, Generation), gen
    return str(tok.decode(gen.output_ids, skip_special_tokens=True)).rsplit(" ", 1)[-1]


async def test_router_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="router"):
        SGLangEngineConfig(urls=["http://x"], router="nginx")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="engine.router"):
        await build_engine(SGLangEngineConfig(launch=True, router="sglang-router"))


async def test_sglang_router_keeps_every_session_on_one_engine(tok: Any, tmp_path: Path) -> None:
    """8 sessions x 4 turns through the real router: each session's turns all reach one engine
    (both engines used), and every turn after the first hits that engine's prefix cache."""
    engines = [ScriptedEngine(tok, echo_tokens=6, max_context=65536) for _ in range(2)]
    async with running_server(engines[0]) as a, running_server(engines[1]) as b:
        client = await build_engine(_routed([a, b], tmp_path))
        assert isinstance(client, SGLangEngine) and client.router is not None
        assert isinstance(client, PrefixCacheCounter)
        try:
            prompts = {f"s{i}": [1, 2, 3, 100 + i] for i in range(8)}
            before = client.prefix_cache_stats()
            for turn in range(4):
                done = await _turns(client, prompts)
                for sid, gen in done.items():
                    assert isinstance(gen, Generation), gen
                    assert gen.cached_tokens == (0 if turn == 0 else len(prompts[sid]) - 2)  # hf's count
                    prompts[sid] = [*prompts[sid], *gen.output_ids, 7]
            step = client.prefix_cache_stats() - before
        finally:
            await client.close()
    homes: dict[str, set[int]] = defaultdict(set)
    for i, engine in enumerate(engines):
        for call in engine.calls:
            assert call.session_id is not None  # the router forwarded the routing key as the hint
            homes[call.session_id].add(i)
    assert len(homes) == 8 and all(len(h) == 1 for h in homes.values()), dict(homes)
    assert {next(iter(h)) for h in homes.values()} == {0, 1}
    gens = [c.generation for e in engines for c in e.calls]
    assert step == PrefixCacheStats(32, sum(g.prompt_len for g in gens), sum(g.cached_tokens for g in gens))
    assert step.metrics()["prefix_cache_hit_rate"] == step.cached_tokens / step.prompt_tokens > 0.7
    assert not client.servers[0].alive()  # close() stopped the router


async def test_sglang_router_moves_a_dead_engines_sessions(tok: Any, tmp_path: Path) -> None:
    """kill -9 an engine mid-turn: its turns in flight fail (EngineError, never a silent replay),
    the other engine's turns succeed, and the dead engine's sessions go on, cold, on the live one."""
    servers = [ScriptedServer(free_port(), delay_s=1.0) for _ in range(2)]
    client: Any = None
    try:
        client = await build_engine(_routed([s.url for s in servers], tmp_path))
        prompts = {f"s{i}": [1, 2, 3, 100 + i] for i in range(6)}
        first = await _turns(client, prompts)
        home = {sid: _served_by(tok, gen) for sid, gen in first.items()}
        victim = next(s for s in servers if str(s.port) == home["s0"])
        survivor = next(s for s in servers if s is not victim)
        prompts = {sid: [*p, *first[sid].output_ids, 7] for sid, p in prompts.items()}  # type: ignore[union-attr]
        second: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, client, prompts, second)
            await anyio.sleep(0.4)
            victim.kill()
        moved = {sid for sid, port in home.items() if port == str(victim.port)}
        assert moved and len(moved) < 6
        for sid, gen in second.items():
            if sid in moved:
                assert isinstance(gen, EngineError) and client.router in str(gen), gen
            else:
                assert isinstance(gen, Generation) and gen.cached_tokens == len(prompts[sid]) - 2
        await _until_unhealthy(client.router, victim.url)
        third = await _turns(client, {sid: [*p, 8] for sid, p in prompts.items()})
        for sid, gen in third.items():
            assert _served_by(tok, gen) == str(survivor.port)
            assert isinstance(gen, Generation) and (gen.cached_tokens == 0) == (sid in moved)
    finally:
        if client is not None:
            await client.close()
        for s in servers:
            s.kill()


async def _collect(client: SGLangEngine, prompts: dict[str, list[int]], into: dict[str, Any]) -> None:
    into.update(await _turns(client, prompts))


async def _until_unhealthy(router: str, worker: str) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        with anyio.fail_after(15):
            while (await router_workers(http, router)).get(worker, False):
                await anyio.sleep(0.1)


async def test_hash_ring_drops_a_dead_engine(tok: Any) -> None:
    """No router: the client's ring. The turn in flight on the killed engine fails; the engine
    fails its health probe and leaves the ring; its sessions go on, cold, on the live one."""
    servers = [ScriptedServer(free_port(), delay_s=1.0) for _ in range(2)]
    client = SGLangEngine([s.url for s in servers])
    try:
        prompts = {f"s{i}": [1, 2, 3, 100 + i] for i in range(6)}
        first = await _turns(client, prompts)
        home = {sid: _served_by(tok, gen) for sid, gen in first.items()}
        assert all(client.url_for(sid).endswith(port) for sid, port in home.items())
        victim = next(s for s in servers if str(s.port) == home["s0"])
        second: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, client, {"s0": [*prompts["s0"], 9]}, second)
            await anyio.sleep(0.4)
            victim.kill()
        assert isinstance(second["s0"], EngineError) and victim.url in str(second["s0"])
        assert client.down == [victim.url] and victim.url not in client.urls
        third = await _turns(client, {sid: [*p, 8] for sid, p in prompts.items()})
        assert {_served_by(tok, g) for g in third.values()} == {
            str(s.port) for s in servers if s is not victim
        }
        await client.flush_cache()  # weight updates and flushes skip the dead engine
        survivor = next(s for s in servers if s is not victim)
        fresh = SGLangEngine([victim.url, survivor.url])  # info() from the first live server
        try:
            assert (await fresh.info()).name == "sglang" and fresh.down == [victim.url]
        finally:
            await fresh.close()
    finally:
        await client.close()
        for s in servers:
            s.kill()


async def test_episode_on_a_killed_engine_is_recorded_aborted(tmp_path: Path) -> None:
    """A whole episode (TITO proxy, builtin harness, sandbox) through the router: the engine
    serving it dies mid-turn -> the episode ends ABORTED with the router's error, and the next
    episode runs on the live engine."""
    from miles_env.harnesses import get_harness
    from miles_env.registry import load_environment
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    reply = "```sh\nls\n```"
    servers = [ScriptedServer(free_port(), delay_s=1.5, reply=reply) for _ in range(2)]
    env = load_environment("terminal-basics")
    task = env.tasks()[0]
    try:
        async with open_stack(StackConfig(engine=_routed([s.url for s in servers], tmp_path))) as stack:
            ctx = stack.rollout_context(env, get_harness("builtin", max_turns=2))
            router = stack.engine.router  # type: ignore[attr-defined]
            first: dict[str, Any] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(_episode, ctx, task, first)
                victim = await _busy_worker(router, servers)
                victim.kill()
            ep = first["ep"]
            assert ep.status is Status.ABORTED and "model call failed" in (ep.error or ""), ep.error
            await _until_unhealthy(router, victim.url)
            after = await run_episode(ctx, task)
            assert after.status is Status.TRUNCATED and after.error == "max turns reached", after.error
            assert sum(len(s.token_ids) for s in after.samples) > 0
    finally:
        for s in servers:
            s.kill()


async def _episode(ctx: Any, task: Any, into: dict[str, Any]) -> None:
    from miles_env.rollout import run_episode

    into["ep"] = await run_episode(ctx, task)


async def _busy_worker(router: str, servers: list[ScriptedServer]) -> ScriptedServer:
    """The server the router has a request in flight on (its /workers load)."""
    async with httpx.AsyncClient(timeout=5) as http:
        with anyio.fail_after(30):
            while True:
                body = (await http.get(f"{router}/workers")).json()
                busy = {w["url"] for w in body["workers"] if w.get("load", 0) > 0}
                for s in servers:
                    if s.url in busy:
                        return s
                await anyio.sleep(0.05)


@pytest.mark.slow
async def test_sglang_router_over_hf_engines_reports_their_kv_hits(tmp_path: Path) -> None:
    """Two real SmolLM2 engines (hf) behind the embedded server and the router: the routing key
    reaches the engine as the session's KV hint, so a session's second turn reuses its first turn's
    KV there, and `cached_tokens` is the hf engine's own count (prompt + output less one)."""
    from miles_env.engines.hf import HFEngine, HFEngineConfig

    engines = [HFEngine(HFEngineConfig(seed=0, threads=1)) for _ in range(2)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    try:
        async with running_server(engines[0]) as a, running_server(engines[1]) as b:
            client = await build_engine(_routed([a, b], tmp_path))
            assert isinstance(client, SGLangEngine)
            try:
                tok = engines[0].tokenizer
                for sid in ("cats", "dogs", "owls", "bees"):
                    first = tok.encode(
                        f"<|im_start|>user\nA fact about {sid}?<|im_end|>\n<|im_start|>assistant\n"
                    )
                    await client.flush_cache()  # on every worker: the sessions share the template's start
                    one = await client.generate(first, greedy, session_id=sid)
                    two = await client.generate([*first, *one.output_ids, 198], greedy, session_id=sid)
                    assert (one.cached_tokens, two.cached_tokens) == (0, len(first) + len(one.output_ids) - 1)
                    holders = [e for e in engines if e.sessions.get(sid) is not None]
                    assert len(holders) == 1, sid  # both turns on one engine: only it holds the session
            finally:
                await client.close()
    finally:
        for e in engines:
            await e.close()
