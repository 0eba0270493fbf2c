"""Weight sync to several engines (issue 17, part 4): `SGLangEngine.update_weights_from_disk` over two
embedded SGLang-compatible servers, each over its own hf engine on the tiny model.

What is proved: every server loads the update (in parallel, each timed); a generation in flight
while the update lands finishes on the OLD weights and records the old version (its logprobs are
those of a forward pass of the old weights, not of the new); later generations get the new
version and the new weights; a live server that fails the load is an EngineError naming it; a
dead one leaves the ring with the reason; the job's step metrics carry each server's part.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from miles_env.engines import HFEngineConfig, build_engine
from miles_env.engines.base import Engine, Generation, SamplingParams
from miles_env.engines.sglang import SGLangEngine
from miles_env.engines.sglang_server import running_server
from miles_env.errors import EngineError

PROMPT = [1, 504, 3458, 314, 260, 1838, 30]
LONG = 300  # new tokens: long enough that the update arrives mid-generation


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def new_weights(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model re-initialised with another seed: same shapes, clearly different outputs."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_model))
    path = tmp_path_factory.mktemp("new") / "model"
    model.save_pretrained(str(path))
    return path


def _logprobs(model_dir: Path, prompt: Sequence[int], output: Sequence[int]) -> list[float]:
    """Greedy logprobs of `output` after `prompt` under the weights of `model_dir` (one forward)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[at, torch.tensor(output)].tolist()


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@asynccontextmanager
async def _servers(model: Path, n: int) -> AsyncIterator[tuple[list[Engine], list[str]]]:
    cfg = HFEngineConfig(model=str(model), dtype="float32", device="cpu", threads=1)
    async with AsyncExitStack() as stack:
        engines = [await build_engine(cfg) for _ in range(n)]
        for e in engines:
            stack.push_async_callback(e.close)
        urls = [await stack.enter_async_context(running_server(e)) for e in engines]
        yield engines, urls


def _session_for(client: SGLangEngine, url: str) -> str:
    return next(sid for sid in (f"s{i}" for i in range(1000)) if client.url_for(sid) == url)


async def _in_flight(engines: Sequence[Any]) -> None:
    """Until every engine decodes a row (the hf engine's running batch: a test-only peek)."""
    with anyio.fail_after(60):
        while not all(e._batch.rows for e in engines):
            await anyio.sleep(0.005)


@pytest.mark.anyio
async def test_update_reaches_every_server_and_in_flight_turns_keep_the_old_version(
    tiny_model: Path, new_weights: Path
) -> None:
    greedy = SamplingParams(max_new_tokens=LONG, temperature=0.0, top_p=1.0, top_k=-1)
    async with _servers(tiny_model, 2) as (engines, urls):
        client = SGLangEngine(urls, model_dir=tiny_model)
        try:
            sessions = [_session_for(client, u) for u in urls]
            gens: dict[str, Generation] = {}

            async def turn(sid: str) -> None:
                gens[sid] = await client.generate(PROMPT, greedy, session_id=sid)

            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(turn, sid)
                await _in_flight(engines)
                assert await client.update_weights_from_disk(new_weights, weight_version=1) == 1
            parts = client.last_sync()
            assert [p.url for p in parts] == urls and all(p.seconds > 0 for p in parts)
            for sid in sessions:
                old = gens[sid]
                assert old.weight_version == 0 and len(old.output_ids) == LONG
                assert _max_diff(old.logprobs, _logprobs(tiny_model, PROMPT, old.output_ids)) < 1e-3
                assert _max_diff(old.logprobs, _logprobs(new_weights, PROMPT, old.output_ids)) > 0.1
            for e in engines:
                assert (await e.info()).weight_version == 1
            for sid in sessions:
                new = await client.generate(
                    PROMPT, greedy.model_copy(update={"max_new_tokens": 16}), session_id=sid
                )
                assert new.weight_version == 1
                assert _max_diff(new.logprobs, _logprobs(new_weights, PROMPT, new.output_ids)) < 1e-3
        finally:
            await client.close()


@pytest.mark.anyio
async def test_a_server_that_fails_the_load_is_an_error_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": torch.ones(7)}, str(bad))  # a shape no server accepts
    async with _servers(tiny_model, 2) as (_, urls):
        client = SGLangEngine(urls, model_dir=tiny_model)
        try:
            with pytest.raises(EngineError, match="update_weights_from_disk") as err:
                await client.update_weights_from_disk(bad, weight_version=1)
            assert any(u in str(err.value) for u in urls)
            assert client.weight_version == 0 and client.down == []  # alive: refused, not dropped
        finally:
            await client.close()


@pytest.mark.anyio
async def test_a_dead_server_leaves_the_ring_with_the_reason(tiny_model: Path, new_weights: Path) -> None:
    from miles_env.job.sync import _per_server

    async with _servers(tiny_model, 1) as (_, live):
        async with _servers(tiny_model, 1) as (_, gone):
            pass  # its server stopped: nothing listens there any more
        client = SGLangEngine([*live, *gone], model_dir=tiny_model)
        try:
            assert await client.update_weights_from_disk(new_weights, weight_version=3) == 3
            assert client.urls == live and client.down == gone
            assert "update_weights_from_disk" in client.down_reasons[gone[0]]
            assert [p.url for p in client.last_sync()] == live
            metrics: dict[str, Any] = _per_server(client, {"sync_s": 1.0, "sync_bytes": 10.0})
            assert metrics["sync_engines"] == 1.0 and metrics["sync_bytes_engine0"] == 10.0
            assert (
                metrics["sync_s_engine0"] == client.last_sync()[0].seconds and "sync_s_engine1" not in metrics
            )
        finally:
            await client.close()
