"""The SGLang native API server over HFEngine, and the SGLangEngine client against it.

Fast tests cover routing and error mapping; slow ones run the real SmolLM2
model behind a uvicorn server on a free loopback port.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from pathlib import Path

import httpx
import pytest

from miles_env.engines import ScriptedEngineConfig, SGLangEngineConfig, build_engine
from miles_env.engines._ring import HashRing
from miles_env.engines.base import SamplingParams
from miles_env.engines.hf import HFEngine, HFEngineConfig
from miles_env.engines.sglang import SGLangEngine
from miles_env.engines.sglang_server import WireSamplingParams, running_server
from miles_env.errors import ConfigError, EngineError

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine():
    eng = HFEngine(HFEngineConfig(seed=0))
    yield eng
    asyncio.run(eng.close())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hash_ring_is_sticky_and_spreads() -> None:
    urls = [f"http://10.0.0.{i}:30000" for i in range(4)]
    ring = HashRing(urls)
    picks = {f"s{i}": ring.pick(f"s{i}") for i in range(400)}
    assert all(ring.pick(k) == v for k, v in picks.items())
    assert min(Counter(picks.values()).values()) > 40
    smaller = HashRing(urls[:3])  # removing a server moves only its own sessions
    assert all(smaller.pick(k) == v for k, v in picks.items() if v != urls[3])


def test_wire_sampling_params_accept_neutral_values_only() -> None:
    sp = WireSamplingParams(max_new_tokens=3, stop="x", top_k=-1, sampling_seed=5, repetition_penalty=1.0)
    sp.verify()
    assert sp.unsupported() is None
    assert sp.to_sampling(3) == SamplingParams(max_new_tokens=3, stop=("x",), top_k=-1, seed=5)
    assert "frequency_penalty" in (WireSamplingParams(frequency_penalty=0.5).unsupported() or "")
    with pytest.raises(ValueError, match="top_k must be -1"):
        WireSamplingParams(top_k=0).verify()  # SGLang refuses 0
    with pytest.raises(ValueError, match="unknown_field"):
        WireSamplingParams(unknown_field=1)


@pytest.mark.anyio
async def test_client_maps_connection_errors_to_engine_error() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    client = SGLangEngine(url, timeout_s=5)
    try:
        with pytest.raises(EngineError, match=url):
            await client.generate([1, 2, 3], GREEDY)
    finally:
        await client.close()
    with pytest.raises(ConfigError, match="url"):
        await build_engine(SGLangEngineConfig())


@pytest.mark.anyio
async def test_client_maps_http_errors_to_engine_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:  # failure injection
        return httpx.Response(503, text="overloaded")

    client = SGLangEngine("http://sglang.test", transport=httpx.MockTransport(handler))
    try:
        with pytest.raises(EngineError, match=r"http://sglang.test/generate: HTTP 503: overloaded"):
            await client.generate([1], GREEDY)
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_generate_response_has_sglang_shape(engine: HFEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    async with running_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
        }
        resp = await http.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        meta = data["meta_info"]
        assert set(data) == {"text", "output_ids", "meta_info"}
        assert [p[1] for p in meta["output_token_logprobs"]] == data["output_ids"]
        assert all(len(p) == 3 and p[2] is None for p in meta["output_token_logprobs"])
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 4
        version = "default" if engine.weight_version == 0 else str(engine.weight_version)  # as SGLang
        assert meta["weight_version"] == version and "cached_tokens" in meta
        assert data["text"] == engine.tokenizer.decode(data["output_ids"], skip_special_tokens=True)
        bad = await http.post("/generate", json={"input_ids": [1] * engine.max_context})
        assert bad.status_code == 400 and "context" in bad.json()["error"]["message"]
        info = (await http.get("/get_model_info")).json()
        assert info["is_generation"] is True and info["model_path"] == str(engine.model_path)
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/health_generate")).status_code == 200
        assert (await http.post("/flush_cache")).status_code == 200


@pytest.mark.slow
@pytest.mark.anyio
async def test_client_matches_in_process_engine(engine: HFEngine) -> None:
    prompts = [
        engine.tokenizer.encode(q) for q in ("The capital of France is", "1, 2, 3,", "Once upon a time")
    ]
    direct = [await engine.generate(p, GREEDY) for p in prompts]
    async with running_server(engine) as url:
        client = SGLangEngine([url])
        try:
            remote = await asyncio.gather(
                *(client.generate(p, GREEDY, session_id=f"s{i}") for i, p in enumerate(prompts))
            )
            info = await client.info()
            stop = await client.generate(
                prompts[0], GREEDY.model_copy(update={"stop_token_ids": (direct[0].output_ids[1],)})
            )
        finally:
            await client.close()
    for d, r in zip(direct, remote, strict=True):
        assert r.output_ids == d.output_ids and r.finish_reason == d.finish_reason
        assert r.logprobs == pytest.approx(d.logprobs, abs=1e-4)
        assert r.weight_version == d.weight_version
    assert stop.finish_reason == "stop" and stop.output_ids == direct[0].output_ids[:2]
    assert info.name == "sglang" and info.max_context == engine.max_context - 1  # SGLang's strict rule
    assert info.eos_token_ids == engine.eos_token_ids


@pytest.mark.slow
@pytest.mark.anyio
async def test_update_weights_from_disk_through_the_api(engine: HFEngine, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    name = "model.layers.5.self_attn.o_proj.weight"
    original = engine.model.state_dict()[name].clone()
    save_file({name: original * 4.0}, str(tmp_path / "scaled.safetensors"))
    save_file({name: original}, str(tmp_path / "original.safetensors"))
    prompt = engine.tokenizer.encode("The quick brown fox")
    async with running_server(engine) as url:
        client = SGLangEngine(url)
        try:
            before = await client.generate(prompt, GREEDY)
            version = await client.update_weights_from_disk(
                tmp_path / "scaled.safetensors", weight_version=before.weight_version + 1
            )
            after = await client.generate(prompt, GREEDY)
            assert after.weight_version == version == engine.weight_version
            assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)
            with pytest.raises(EngineError, match="does not exist"):
                await client.update_weights_from_disk(tmp_path / "missing.safetensors")
            await client.update_weights_from_disk(
                tmp_path, weight_version=version + 5
            )  # a directory of files
            assert engine.weight_version == version + 5
            restored = await client.update_weights_from_disk(tmp_path / "original.safetensors")
            assert restored == version + 6
            assert (await client.generate(prompt, GREEDY)).output_ids == before.output_ids
        finally:
            await client.close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_build_engine_kinds() -> None:
    hf = await build_engine(HFEngineConfig(max_batch_size=2, max_context=256))
    try:
        info = await hf.info()
        assert isinstance(hf, HFEngine) and info.name == "hf" and info.max_context == 256
        assert (await hf.generate([1, 2, 3], GREEDY)).output_ids
    finally:
        await hf.close()
    with pytest.raises(EngineError, match="closed"):
        await hf.generate([1, 2, 3], GREEDY)
    client = await build_engine(SGLangEngineConfig(urls=["http://a:1", "http://b:2"]))
    assert isinstance(client, SGLangEngine) and client.urls == ["http://a:1", "http://b:2"]
    await client.close()
    scripted = await build_engine(ScriptedEngineConfig())
    assert (await scripted.info()).name == "scripted"
    await scripted.close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_generate_text_input_stop_trim_and_validation(engine: HFEngine) -> None:
    async with running_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        base = (
            await http.post(
                "/generate",
                json={"text": "1, 2, 3, 4,", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
            )
        ).json()
        stop = base["text"][2:5]
        body = {
            "text": "1, 2, 3, 4,",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": stop},
        }
        cut = (await http.post("/generate", json=body)).json()
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in cut["text"] and base["text"].startswith(cut["text"])
        assert stop in engine.tokenizer.decode(cut["output_ids"])  # the ids keep the completing token
        assert "output_token_logprobs" not in cut["meta_info"]  # return_logprob defaults to false
        bad = {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}  # not honoured here
        resp = await http.post("/generate", json=bad)
        assert resp.status_code == 400 and "frequency_penalty" in resp.json()["error"]["message"]
        unknown = {"input_ids": [1, 2], "sampling_params": {"no_such_param": 1}}  # SGLang's TypeError: 500
        assert (await http.post("/generate", json=unknown)).status_code == 500
        assert (await http.post("/generate", json={"sampling_params": {}})).status_code == 400
