"""What a CLI's first request costs a small model: full prompts vs `tools=Bash` vs `lean` (issue 31).

For each variant, one episode of tests/cli_harness_support.py's two_step_task through the real
CLI in the bwrap sandbox:
- with the scripted engine (a million-token window, answer "Done."): the first prompt's size in
  SmolLM2 tokens (the proxy's count, Episode.metadata.first_prompt_tokens);
- with `--smollm2`, the real SmolLM2 on CPU (its 8k context) with a 1-token session budget: the
  first turn's engine latency, i.e. reading the prompt (prefill) before the first sampled token,
  and the episode's wall time; a prompt over 8k is refused ("-"). Baselines, measured in the same
  run: the CLI's full prompt for the size, its largest prompt that fits for the prefill.

Run: python bench/bench_harness_fit.py [--smollm2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy  # noqa: E402
from miles_env.models import load_tokenizer  # noqa: E402
from tests.cli_harness_support import run_one  # noqa: E402
from tests.tito_support import RecordingEngine  # noqa: E402

# (harness, variant, options); the first of each harness is its baseline
VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("claude-code", "all tools", {}),
    ("claude-code", "tools=Bash", {"tools": "Bash"}),
    ("claude-code", "lean", {"lean": True}),
    ("codex", "default (multi-agent on)", {"multi_agent": True}),
    ("codex", "multi_agent=false", {"multi_agent": False}),
    ("codex", "lean", {"lean": True}),
)


async def one(
    harness: str, opts: dict[str, Any], engine: Any, store: Path
) -> tuple[int | None, float, float]:
    """-> (first prompt tokens, first engine call's latency s, episode wall s)."""
    t0 = time.perf_counter()
    ep = await run_one(harness, engine, store, tito={"budget": {"max_tokens": 1}}, budget_s=900, **opts)
    wall = time.perf_counter() - t0
    latency = ep.samples[0].turns[0].latency_s if ep.samples and ep.samples[0].turns else float("nan")
    return ep.metadata.get("first_prompt_tokens"), latency, wall


async def main(smollm2: bool) -> None:
    import tempfile

    tok = load_tokenizer()
    real: Any = None
    if smollm2:
        from miles_env.engines import HFEngineConfig, build_engine

        real = RecordingEngine(await build_engine(HFEngineConfig(max_batch_size=1)))  # SmolLM2's 8192
    print(
        "| harness | variant | first prompt tokens | vs baseline |"
        + (" prefill s | vs baseline | episode s |" if smollm2 else "")
    )
    print("|---|---|---|---|" + ("---|---|---|" if smollm2 else ""))
    base: dict[str, tuple[int, float]] = {}
    for harness, variant, opts in VARIANTS:
        store = Path(tempfile.mkdtemp()) / "store"
        scripted = ScriptedEngine(
            tok, policy=ScriptedPolicy((PolicyRule(None, ("Done.",)),)), max_context=1 << 20
        )
        tokens, _, _ = await one(harness, opts, scripted, store)
        row = f"| {harness} | {variant} | {tokens} |"
        if real is not None:
            _, prefill, wall = await one(harness, opts, real, store.with_name("real"))
        else:
            prefill = wall = float("nan")
        b_tokens, _ = base.setdefault(harness, (tokens or 1, prefill))
        if prefill == prefill and base[harness][1] != base[harness][1]:  # the first that fits
            base[harness] = (b_tokens, prefill)
        row += f" {(tokens or 0) / b_tokens:.2f}x |"
        if real is not None and prefill != prefill:
            row += f" - | - | {wall:.1f} |"
        elif real is not None:
            row += f" {prefill:.1f} | {prefill / base[harness][1]:.2f}x | {wall:.1f} |"
        print(row, flush=True)
    if real is not None:
        await real.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also time the first turn on the real SmolLM2")
    anyio.run(main, parser.parse_args().smollm2)
