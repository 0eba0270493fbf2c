"""HFEngine against the real SmolLM2-135M model (fp32, CPU): numerics and behaviour.

The model is loaded once per module; generations are short (the CPU is shared).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_env.engines._kv import SessionEntry, SessionStore, common_prefix
from miles_env.engines.base import SamplingParams
from miles_env.engines.hf import HFEngine, HFEngineConfig
from miles_env.errors import EngineError

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine():
    eng = HFEngine(HFEngineConfig(seed=0))
    yield eng
    asyncio.run(eng.close())


def chat(engine: HFEngine, *contents: str) -> list[int]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    out = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def reference_logprobs(
    engine: HFEngine, prompt: list[int], output: list[int], temperature: float
) -> list[float]:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_session_store_is_bounded_lru() -> None:
    store = SessionStore(max_tokens=10, max_sessions=2)
    for name, n in [("a", 4), ("b", 4), ("c", 4)]:
        store.put(name, SessionEntry(ids=list(range(n)), kv=[]))
    assert store.get("a") is None  # evicted: 12 tokens > 10 and 3 sessions > 2
    assert store.tokens == 8 and len(store) == 2
    store.put("huge", SessionEntry(ids=list(range(11)), kv=[]))  # larger than the whole budget: not kept
    assert store.get("huge") is None
    store.remove("b")
    assert store.get("b") is None and store.tokens == 4


def test_session_store_lookup_finds_the_longest_shared_prefix() -> None:
    store = SessionStore(max_tokens=100, max_sessions=10)
    store.put("own", SessionEntry(ids=[1, 2, 3, 9], kv=[]))
    store.put("other", SessionEntry(ids=[1, 2, 3, 4, 5, 6], kv=[]))
    store.put("unrelated", SessionEntry(ids=[7, 7, 7], kv=[]))
    entry, n = store.lookup([1, 2, 3, 4, 5, 8], "own")
    assert entry is store.get("other") and n == 5
    entry, n = store.lookup([1, 2, 3, 9, 9], "own")
    assert entry is store.get("own") and n == 4
    assert store.lookup([5, 5], None) == (None, 0)
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3 and common_prefix([1, 2], [2]) == 0
    assert common_prefix(list(range(1000)), list(range(537)) + [-1]) == 537


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)]
)
async def test_logprobs_match_a_full_forward_pass(engine: HFEngine, sampling: SamplingParams) -> None:
    prompt = chat(engine, "Name three colours.")
    gen = await engine.generate(prompt, sampling)
    assert len(gen.output_ids) == len(gen.logprobs) > 0
    ref = reference_logprobs(engine, prompt, gen.output_ids, sampling.temperature)
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True)) < 1e-4
    assert gen.prompt_len == len(prompt) and gen.weight_version == engine.weight_version


@pytest.mark.slow
@pytest.mark.anyio
async def test_batched_greedy_equals_unbatched(engine: HFEngine) -> None:
    prompts = [
        chat(engine, q)
        for q in ("Hi!", "What is the capital of France?", "Write a haiku about rain.", "2+2=")
    ]
    alone = [await engine.generate(p, GREEDY) for p in prompts]
    together = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3


@pytest.mark.slow
@pytest.mark.anyio
async def test_prefix_reuse_equals_no_reuse(engine: HFEngine) -> None:
    await engine.flush_cache()  # every chat prompt shares the template's system prompt
    first = chat(engine, "Tell me a fact about cats.")
    turn1 = await engine.generate(first, GREEDY, session_id="reuse")
    assert turn1.cached_tokens == 0
    tail = "\n<|im_start|>user\nAnd about dogs?<|im_end|>\n<|im_start|>assistant\n"
    follow = first + turn1.output_ids + engine.tokenizer.encode(tail, add_special_tokens=False)
    reused = await engine.generate(follow, GREEDY, session_id="reuse")
    await engine.flush_cache()
    cold = await engine.generate(follow, GREEDY)
    assert reused.cached_tokens == len(first) + len(turn1.output_ids) - 1
    assert cold.cached_tokens == 0
    assert reused.output_ids == cold.output_ids
    # a diverging history reuses only the common prefix
    edited = first[:-3] + chat(engine, "Something else entirely?")
    partial = await engine.generate(edited, GREEDY, session_id="reuse")
    assert 0 < partial.cached_tokens <= len(first) - 3
    await engine.flush_cache()
    assert partial.output_ids == (await engine.generate(edited, GREEDY)).output_ids


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_cold_prompt_is_shared_across_sessions(engine: HFEngine) -> None:
    await engine.flush_cache()
    prompt = chat(engine, "You are a helpful assistant. Please list five fruits and their colours.")
    assert len(prompt) >= 32
    first = await engine.generate(prompt, GREEDY, session_id="group-0")
    siblings = await asyncio.gather(
        *(engine.generate(prompt, GREEDY, session_id=f"group-{i}") for i in (1, 2))
    )
    assert first.cached_tokens == 0
    for sib in siblings:
        assert sib.cached_tokens == len(prompt) - 1 and sib.output_ids == first.output_ids


@pytest.mark.slow
@pytest.mark.anyio
async def test_stop_token_ids_and_stop_strings(engine: HFEngine) -> None:
    prompt = chat(engine, "Count from one to ten in words.")
    base = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0))
    stop_id = base.output_ids[3]
    first = base.output_ids.index(stop_id)
    by_id = await engine.generate(
        prompt, SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop_id,))
    )
    assert by_id.finish_reason == "stop" and by_id.output_ids == base.output_ids[: first + 1]
    assert len(by_id.logprobs) == len(by_id.output_ids) and by_id.meta["matched"] == stop_id
    text = engine.tokenizer.decode(base.output_ids[:6])
    stop = text[-3:]
    by_str = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0, stop=(stop,)))
    out_text = engine.tokenizer.decode(by_str.output_ids)
    assert by_str.finish_reason == "stop" and stop in out_text and by_str.meta["matched"] == stop
    assert stop not in engine.tokenizer.decode(by_str.output_ids[:-1])  # the last token completes it
    assert by_str.output_ids == base.output_ids[: len(by_str.output_ids)]


@pytest.mark.slow
@pytest.mark.anyio
async def test_eos_stops_by_default_and_is_included(engine: HFEngine) -> None:
    gen = await engine.generate(
        chat(engine, "What is 2+2?"), SamplingParams(max_new_tokens=30, temperature=0.0)
    )
    assert gen.finish_reason == "stop"
    assert gen.output_ids[-1] in engine.eos_token_ids and len(gen.logprobs) == len(gen.output_ids)


@pytest.mark.slow
@pytest.mark.anyio
async def test_max_new_tokens_and_seed(engine: HFEngine) -> None:
    prompt = chat(engine, "Write a long story.")
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert gen.finish_reason == "length" and len(gen.output_ids) == 5
    hot = SamplingParams(max_new_tokens=8, temperature=1.2, seed=1234)
    a = await engine.generate(prompt, hot)
    b, c = await asyncio.gather(
        engine.generate(prompt, hot), engine.generate(prompt, hot.model_copy(update={"seed": 99}))
    )
    assert a.output_ids == b.output_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    assert c.output_ids != a.output_ids


@pytest.mark.slow
@pytest.mark.anyio
async def test_context_overflow_and_length_at_context_limit(engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="context"):
        await engine.generate([1] * engine.max_context, GREEDY)
    with pytest.raises(EngineError, match="empty"):
        await engine.generate([], GREEDY)
    small = HFEngine(HFEngineConfig(max_context=24))
    try:
        prompt = chat(small, "Hello")[:20]
        gen = await small.generate(
            prompt, SamplingParams(max_new_tokens=50, temperature=0.0, stop_token_ids=())
        )
        assert gen.finish_reason in ("length", "stop") and len(prompt) + len(gen.output_ids) <= 24
        if gen.finish_reason == "length":
            assert len(prompt) + len(gen.output_ids) == 24
    finally:
        await small.close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_weight_update_bumps_version_changes_outputs_and_restores(engine: HFEngine) -> None:
    prompt = chat(engine, "What is the weather like?")
    before = await engine.generate(prompt, GREEDY, session_id="w")
    name = "model.layers.3.mlp.down_proj.weight"
    original = engine.model.state_dict()[name].clone()
    v0 = engine.weight_version
    v1 = await engine.update_weights({name: original * 5.0})
    assert v1 == v0 + 1 and (await engine.info()).weight_version == v1
    changed = await engine.generate(prompt, GREEDY, session_id="w")
    assert changed.weight_version == v1 and changed.cached_tokens == 0  # session caches were flushed
    assert changed.logprobs != before.logprobs
    v2 = await engine.update_weights({name: original}, weight_version=10)
    assert v2 == 10
    again = await engine.generate(prompt, GREEDY)
    assert again.output_ids == before.output_ids and again.weight_version == 10
    with pytest.raises(EngineError, match="unknown parameter"):
        await engine.update_weights({"no.such.weight": original})
    with pytest.raises(EngineError, match="shape"):
        await engine.update_weights({name: original[:1]})
    assert engine.weight_version == 10


@pytest.mark.slow
@pytest.mark.anyio
async def test_update_waits_for_in_flight_generation(engine: HFEngine) -> None:
    prompt = chat(engine, "Tell me a long story about a dragon.")
    name = "model.norm.weight"
    original = engine.model.state_dict()[name].clone()
    v0 = engine.weight_version
    long = asyncio.ensure_future(
        engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=()))
    )
    await asyncio.sleep(0.3)  # the generation is running
    update = asyncio.ensure_future(engine.update_weights({name: original * 1.5}))
    later = asyncio.ensure_future(engine.generate(prompt, GREEDY))
    gen = await long
    assert gen.weight_version == v0 and len(gen.output_ids) == 24 and gen.finish_reason == "length"
    assert await update == v0 + 1
    assert (await later).weight_version == v0 + 1  # queued behind the update, run with the new weights
    await engine.update_weights({name: original})


@pytest.mark.slow
@pytest.mark.anyio
async def test_update_with_abort_in_flight_ends_running_generations(engine: HFEngine) -> None:
    prompt = chat(engine, "Tell me a long story about a knight.")
    name = "model.norm.weight"
    original = engine.model.state_dict()[name].clone()
    v0 = engine.weight_version
    sp = SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=())
    running = asyncio.ensure_future(engine.generate(prompt, sp))
    await asyncio.sleep(0.5)
    assert await engine.update_weights({name: original * 1.5}, abort_in_flight=True) == v0 + 1
    gen = await running
    assert gen.finish_reason == "abort" and gen.weight_version == v0
    assert 0 < len(gen.output_ids) < 200 and len(gen.logprobs) == len(gen.output_ids)
    await engine.update_weights({name: original})


@pytest.mark.slow
@pytest.mark.anyio
async def test_cancelled_request_leaves_the_batch(engine: HFEngine) -> None:
    prompt = chat(engine, "Describe the ocean.")
    sp = SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=())
    doomed = asyncio.ensure_future(engine.generate(prompt, sp))
    other = asyncio.ensure_future(engine.generate(prompt, GREEDY))
    await asyncio.sleep(0.3)
    doomed.cancel()
    assert (await other).finish_reason in ("stop", "length")
    for _ in range(100):  # the worker drops the cancelled row at its next step
        if not engine._batch.rows:
            break
        await asyncio.sleep(0.05)
    assert not engine._batch.rows


@pytest.mark.slow
@pytest.mark.anyio
async def test_chunked_prefill_next_to_a_decoding_row_is_exact(engine: HFEngine) -> None:
    await engine.flush_cache()
    story = " ".join(f"Line {i}: the lighthouse keeper counted {i} ships." for i in range(60))
    long_prompt = chat(engine, f"Summarise: {story}")
    assert len(long_prompt) > 1.2 * engine.config.prefill_chunk_tokens
    busy = asyncio.ensure_future(
        engine.generate(chat(engine, "Hi"), SamplingParams(max_new_tokens=30, temperature=0.0))
    )
    await asyncio.sleep(0.2)  # the short request is decoding when the long prompt arrives
    gen = await engine.generate(long_prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
    await busy
    ref = reference_logprobs(engine, long_prompt, gen.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True)) < 1e-4
    assert gen.meta["ttft_s"] > 0
