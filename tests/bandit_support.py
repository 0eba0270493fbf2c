"""A one-prompt bandit on the real SmolLM2, for the learning tests of LoRA RL and OPD.

The prompt asks for a number "with the number only"; a reply is rewarded when its first token is a
digit. SmolLM2-135M-Instruct starts a reply with a digit ~30% of the time, so a group of 16 has
both rewards, and the exact probability of the rewarded behaviour is one forward pass
(`first_token_logprobs`), so a test reads learning without sampling noise.
`sample_group(engine, step, seed)` samples one GRPO group through an Engine (hf: the policy as
served, adapter or synced weights included) and wraps it as episodes with their rewards (each turn records the weight version that sampled it).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_env.engines.base import Engine, SamplingParams
from miles_env.types import Episode, Reward, Status, Trajectory, Turn

__all__ = ["Bandit"]


class Bandit:
    def __init__(self) -> None:
        from miles_env.models import load_tokenizer

        tok = load_tokenizer()
        chat = [{"role": "user", "content": "Pick a number between 1 and 9. Reply with the number only."}]
        encoded = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        self.prompt: list[int] = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        self.digits = sorted(i for i in range(len(tok)) if tok.decode([i]).strip()[:1].isdigit())
        self.tokenizer = tok

    def first_token_logprobs(self, model: Any) -> torch.Tensor:
        """log p(first reply token) over the vocabulary, exact (one forward pass)."""
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([self.prompt])).logits[0, -1].float()
        return torch.log_softmax(logits, -1)

    def p_rewarded(self, model: Any) -> float:
        return float(self.first_token_logprobs(model).exp()[self.digits].sum())

    async def sample_group(self, engine: Engine, step: int, seed: int, n: int = 16) -> list[Episode]:
        sampling = SamplingParams(max_new_tokens=2, temperature=1.0)
        gens = [
            await engine.generate(
                self.prompt, sampling.model_copy(update={"seed": 1000 * seed + n * step + k})
            )
            for k in range(n)
        ]
        digits, p = set(self.digits), len(self.prompt)
        return [
            Episode(id=f"e{step}-{k}", task_id="t", env="bandit", group_id=f"g{step}", status=Status.COMPLETED,
                    reward=Reward(score=float(g.output_ids[0] in digits)),
                    samples=[Trajectory(token_ids=self.prompt + g.output_ids, loss_mask=[0] * p + [1] * len(g.output_ids),
                                        logprobs=[0.0] * p + g.logprobs,
                                        turns=[Turn(start=p, prompt_len=p, completion_len=len(g.output_ids),
                                                    finish_reason=g.finish_reason, weight_version=g.weight_version)])])
            for k, g in enumerate(gens)
        ]  # fmt: skip
