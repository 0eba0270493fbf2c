"""A tiny random Llama and rollouts sampled from it, for the trainer's tests.

`make_tiny_model(path)` saves a 2-layer Llama over a 96-token vocabulary (seeded, so two calls
give the same weights); `rollouts(model_dir)` samples two trajectories from it with a plain HF
forward loop, recording log_softmax(logits / T) of each sampled id as the engine would;
`episode(...)` wraps one as a completed episode of a GRPO group; `random_groups(scores)` builds
GRPO groups of random trajectories (the distributed trainers' tests compare ranks on them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles_env.types import Episode, Reward, Status, Trajectory, Turn

__all__ = ["VOCAB", "episode", "make_tiny_model", "random_groups", "rollouts", "sample_trajectory"]

VOCAB = 96


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@torch.no_grad()
def sample_trajectory(
    model, prompt: list[int], n: int, temperature: float, seed: int, version: int = 0
) -> Trajectory:
    """A plain HF forward loop; logprob convention log_softmax(logits / T) of the sampled id."""
    gen = torch.Generator().manual_seed(seed)
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
        ids.append(tok)
        lps.append(float(lp[tok]))
    p = len(prompt)
    return Trajectory(
        token_ids=ids,
        loss_mask=[0] * p + [1] * n,
        logprobs=[0.0] * p + lps,
        turns=[Turn(start=p, prompt_len=p, completion_len=n, finish_reason="length", weight_version=version)],
    )


def episode(eid: str, group: str, traj: Trajectory, score: float) -> Episode:
    return Episode(
        id=eid, task_id=group, env="toy", group_id=group, status=Status.COMPLETED,
        reward=Reward(score=score), samples=[traj],
    )  # fmt: skip


def rollouts(model_dir: Path, temperature: float = 1.0) -> tuple[Trajectory, Trajectory]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    a = sample_trajectory(model, [1, 2, 3, 4, 5], 12, temperature, seed=1)
    b = sample_trajectory(model, [1, 2, 3, 4, 5], 9, temperature, seed=2)
    return a, b


def random_groups(
    scores: list[list[float]], seed: int = 0, vocab: int = VOCAB, stagger: bool = False
) -> list[list[Episode]]:
    """One group per entry of `scores` (one episode per score) of random trajectories: a 5-token
    prompt and 8 + 3i sampled tokens for episode i (+ the group's index with `stagger`)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi, group_scores in enumerate(scores):
        group = []
        for i, score in enumerate(group_scores):
            p, n = 5, 8 + 3 * i + (gi if stagger else 0)
            ids = torch.randint(0, vocab, (p + n,), generator=g).tolist()
            lps = (-torch.rand(n, generator=g) * 3).tolist()
            traj = Trajectory(token_ids=ids, loss_mask=[0] * p + [1] * n, logprobs=[0.0] * p + lps,
                              turns=[Turn(start=p, prompt_len=p, completion_len=n, finish_reason="length",
                                          weight_version=0)])  # fmt: skip
            group.append(Episode(id=f"e{gi}{i}", task_id=f"t{gi}", env="toy", group_id=f"g{gi}",
                                 status=Status.COMPLETED, reward=Reward(score=score), samples=[traj]))  # fmt: skip
        out.append(group)
    return out
