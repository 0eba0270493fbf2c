"""The zero-KL check on the real model: logprobs the engine (HFEngine) reported while sampling from
SmolLM2 are reproduced by the trainer, a positive-advantage step raises the sampled sequence's
logprob, and after a disk weight sync engine and trainer agree again."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from miles_env.engines.base import SamplingParams
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Episode, Reward, Status, Trajectory, Turn

T = 0.8


def to_trajectory(prompt: list[int], gen) -> Trajectory:  # type: ignore[no-untyped-def]
    p, n = len(prompt), len(gen.output_ids)
    return Trajectory(
        token_ids=prompt + list(gen.output_ids),
        loss_mask=[0] * p + [1] * n,
        logprobs=[0.0] * p + list(gen.logprobs),
        turns=[Turn(start=p, prompt_len=p, completion_len=n, finish_reason=gen.finish_reason,
                    weight_version=gen.weight_version)],
    )  # fmt: skip


def diffs(trainer: TorchTrainer, trajs: list[Trajectory]) -> torch.Tensor:
    out = []
    for traj, lp in zip(trajs, trainer.logprobs(trajs), strict=True):
        on = torch.tensor(traj.loss_mask).bool()
        out.append((lp[on] - torch.tensor(traj.logprobs)[on]).abs())
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.model
def test_zero_kl_learning_direction_and_disk_sync(tmp_path: Path) -> None:
    from miles_env.engines.hf import HFEngine, HFEngineConfig
    from miles_env.models import load_tokenizer

    tok = load_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a prime number."}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    engine = HFEngine(HFEngineConfig(model="smollm2", dtype="float32", seed=0))
    sampling = SamplingParams(max_new_tokens=12, temperature=T, seed=3)

    async def sample() -> list[Trajectory]:
        gens = [await engine.generate(prompt, sampling.model_copy(update={"seed": s})) for s in (3, 4)]
        return [to_trajectory(prompt, g) for g in gens]

    try:
        good, bad = anyio.run(sample)
        trainer = TorchTrainer(
            "smollm2", TrainerConfig(lr=1e-5, temperature=T, max_tokens_per_microbatch=512)
        )
        d = diffs(trainer, [good, bad])
        print(
            f"zero-KL check: {d.numel()} tokens, mean |diff| {float(d.mean()):.2e}, max {float(d.max()):.2e}"
        )
        assert float(d.mean()) < 1e-4, f"zero-KL check: mean |trainer - engine| = {float(d.mean())}"
        before = float(trainer.logprobs([good])[0][torch.tensor(good.loss_mask).bool()].sum())
        group = [
            Episode(id=f"e{i}", task_id="t", env="toy", group_id="g", status=Status.COMPLETED,
                    reward=Reward(score=r), samples=[traj])
            for i, (traj, r) in enumerate(((good, 1.0), (bad, 0.0)))
        ]  # fmt: skip
        metrics = trainer.train_step([group])
        assert metrics["logprob_diff_mean"] < 1e-4
        after = float(trainer.logprobs([good])[0][torch.tensor(good.loss_mask).bool()].sum())
        assert after > before

        version = anyio.run(engine.update_weights_from_disk, trainer.export_weights(tmp_path / "w"), 1)
        assert version == 1
        resampled = anyio.run(sample)
        assert all(t.turns[0].weight_version == 1 for t in resampled)
        assert float(diffs(trainer, resampled).mean()) < 1e-4  # engine now samples the trained weights
    finally:
        anyio.run(engine.close)
