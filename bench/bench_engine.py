"""Embedded engine benchmark: batching throughput and KV prefix reuse.

Run: python bench/bench_engine.py [--model smollm2] [--sessions 8] [--new-tokens 48] [--history 1500]

1. Throughput: the same N greedy requests run one after another (single
   stream) and then all at once from N sessions (continuous batching); the
   outputs are identical, so tokens/s compare like for like. Target >= 3x.
2. Time to first token of a follow-up turn over a ~1.5k-token history: with
   the session's cached KV prefix (only the new tail is prefilled) vs a cold
   prefill of the same ids. Target <= 0.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from miles_env.engines.base import SamplingParams
from miles_env.engines.hf import HFEngine, HFEngineConfig

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


def chat_ids(engine: HFEngine, messages: list[dict[str, str]]) -> list[int]:
    out = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def throughput(engine: HFEngine, sessions: int, new_tokens: int) -> tuple[float, float, int]:
    prompts = [
        chat_ids(engine, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(sessions)
    ]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    await engine.flush_cache()
    t0 = time.perf_counter()
    single = [await engine.generate(p, sp) for p in prompts]
    t_single = time.perf_counter() - t0
    await engine.flush_cache()  # no prompt KV carried over from the single-stream pass
    t0 = time.perf_counter()
    batched = await asyncio.gather(
        *(engine.generate(p, sp, session_id=f"tp{i}") for i, p in enumerate(prompts))
    )
    t_batched = time.perf_counter() - t0
    same = sum(a.output_ids == b.output_ids for a, b in zip(single, batched, strict=True))
    tokens = sum(len(g.output_ids) for g in single)
    return tokens / t_single, sum(len(g.output_ids) for g in batched) / t_batched, same


async def follow_up_ttft(
    engine: HFEngine, history_tokens: int, repeats: int
) -> tuple[float, float, int, int]:
    filler = "The museum keeps old maps, letters and tools from the harbour town. "
    words = filler * max(1, history_tokens // 14)
    first = chat_ids(engine, [{"role": "user", "content": f"Read this and remember it: {words}"}])[
        :history_tokens
    ]
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    warm: list[float] = []
    cold: list[float] = []
    cached = 0
    for r in range(repeats):
        sid = f"ttft{r}"
        turn1 = await engine.generate(
            first, SamplingParams(max_new_tokens=8, temperature=0.0), session_id=sid
        )
        tail = engine.tokenizer.encode(
            f"\n<|im_start|>user\nWhat did I say ({r})?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        follow = first + turn1.output_ids + tail
        reused = await engine.generate(follow, one, session_id=sid)
        await engine.flush_cache()  # a truly cold prefill: no prefix of any session is reused
        fresh = await engine.generate(follow, one)
        warm.append(reused.meta["ttft_s"])
        cold.append(fresh.meta["ttft_s"])
        cached = reused.cached_tokens
    return statistics.median(warm), statistics.median(cold), len(follow), cached


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--history", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    engine = HFEngine(
        HFEngineConfig(model=args.model, max_batch_size=max(8, args.sessions), threads=args.threads)
    )
    try:
        await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
        single, batched, same = await throughput(engine, args.sessions, args.new_tokens)
        warm, cold, n_ids, cached = await follow_up_ttft(engine, args.history, args.repeats)
    finally:
        await engine.close()
    print(f"model={engine.model_path.name} device={engine.device} dtype={engine.model.dtype}")
    print(f"{'metric':<44}{'baseline':>12}{'engine':>12}{'ratio':>9}{'target':>9}")
    print(
        f"{f'tokens/s: 1 stream vs {args.sessions} sessions':<44}{single:>12.1f}{batched:>12.1f}"
        f"{batched / single:>8.2f}x{'>= 3x':>9}"
    )
    print(
        f"{f'follow-up TTFT s ({n_ids} ids, {cached} cached)':<44}{cold:>12.3f}{warm:>12.3f}{warm / cold:>8.2f}x{'<= 0.5x':>9}"
    )
    print(f"batched outputs identical to single-stream outputs: {same}/{args.sessions}")


if __name__ == "__main__":
    asyncio.run(main())
