"""TorchTrainer on a tiny random Llama (fast): parity, learning direction, accumulation, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Trajectory
from tests.trainer_support import episode, make_tiny_model, rollouts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def masked_sum(lp: torch.Tensor, traj: Trajectory) -> float:
    return float((lp * torch.tensor(traj.loss_mask, dtype=torch.float32)).sum())


def test_zero_kl_and_positive_advantage_raises_logprob(tiny: Path) -> None:
    a, b = rollouts(tiny, temperature=0.7)
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-2, temperature=0.7, grad_clip=None))
    for traj, lp in zip((a, b), trainer.logprobs([a, b]), strict=True):
        on = torch.tensor(traj.loss_mask).bool()
        diff = (lp[on] - torch.tensor(traj.logprobs)[on]).abs()
        assert float(diff.max()) < 1e-5
    before = [masked_sum(lp, t) for lp, t in zip(trainer.logprobs([a, b]), (a, b), strict=True)]
    m = trainer.train_step([[episode("a", "g", a, 1.0), episode("b", "g", b, 0.0)]])
    assert m["logprob_diff_max"] < 1e-4 and m["loss_tokens"] == 21 and m["reward_mean"] == 0.5
    assert m["tis_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0
    after = [masked_sum(lp, t) for lp, t in zip(trainer.logprobs([a, b]), (a, b), strict=True)]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.step == 1


def test_microbatch_budget_gives_same_gradient(tiny: Path) -> None:
    a, b = rollouts(tiny)
    groups = [[episode("a", "g", a, 1.0), episode("b", "g", b, 0.0)]]
    norms = {}
    for agg in ("token-mean", "seq-mean-token-mean", "dr_grpo"):
        for budget in (10_000, 17):  # one microbatch vs one sample per microbatch
            t = TorchTrainer(tiny, TrainerConfig(max_tokens_per_microbatch=budget, loss_agg=agg))
            m = t.train_step(groups)
            norms[(agg, budget)] = (m["grad_norm"], m["pg_loss"])
        assert norms[(agg, 17)] == pytest.approx(norms[(agg, 10_000)], rel=1e-4, abs=1e-7)
    assert norms[("token-mean", 17)][0] != pytest.approx(norms[("dr_grpo", 17)][0], rel=1e-3)


def test_masked_tokens_carry_no_gradient(tiny: Path) -> None:
    a, b = rollouts(tiny)
    # trailing tokens with mask 0 (say, a tool result after the last sampled token) change nothing
    tail = Trajectory(
        token_ids=a.token_ids + [7, 8, 9], loss_mask=a.loss_mask + [0, 0, 0], logprobs=a.logprobs + [0.0] * 3,
        turns=a.turns,
    )  # fmt: skip
    out = []
    for traj in (a, tail):
        t = TorchTrainer(tiny, TrainerConfig())
        out.append(t.train_step([[episode("a", "g", traj, 1.0), episode("b", "g", b, 0.0)]])["grad_norm"])
    assert out[0] == pytest.approx(out[1], rel=1e-5)


def test_kl_to_reference(tiny: Path) -> None:
    a, b = rollouts(tiny)
    groups = [[episode("a", "g", a, 1.0), episode("b", "g", b, 0.0)]]
    t = TorchTrainer(tiny, TrainerConfig(lr=1e-2, kl_coef=0.5))
    assert t.train_step(groups)["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference
    m = t.train_step(groups)
    assert m["kl"] > 1e-6 and m["loss"] == pytest.approx(m["pg_loss"] + 0.5 * m["kl"], rel=1e-5)


def test_checkpoint_roundtrip_and_export(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    a, b = rollouts(tiny)
    groups = [[episode("a", "g", a, 1.0), episode("b", "g", b, 0.0)]]
    t = TorchTrainer(tiny, TrainerConfig(lr=1e-2, keep_checkpoints=2))
    assert t.load_checkpoint(tmp_path / "ckpt") is None
    for i in range(3):
        t.train_step(groups)
        t.save_checkpoint(tmp_path / "ckpt", {"trained_episode_ids": [f"s{i}"]})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000003"]
    expected = t.train_step(groups)

    t2 = TorchTrainer(tiny, TrainerConfig(lr=1e-2))
    assert t2.load_checkpoint(tmp_path / "ckpt") == {"trained_episode_ids": ["s2"]} and t2.step == 3
    again = t2.train_step(groups)  # same weights, same optimizer moments -> same step
    assert again["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    assert again["pg_loss"] == pytest.approx(expected["pg_loss"], rel=1e-6)

    out = t2.export_weights(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    mine = t2.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mine[name]), name
    assert dict(t2.named_parameters()).keys() <= mine.keys()


def test_train_from_queue_checkpoints_acks_and_filters_stale(tiny: Path, tmp_path: Path) -> None:
    import anyio

    from miles_env.queue.sqlite import SqliteReplayQueue
    from miles_env.trainer.loop import LoopConfig, StepHooks, StepResult, train_from_queue

    a, b = rollouts(tiny)
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2)

    def put_group(g: str, version: int) -> None:
        for i, (traj, r) in enumerate(((a, 1.0), (b, 0.0))):
            turns = [t.model_copy(update={"weight_version": version}) for t in traj.turns]
            q.put(episode(f"{g}-{i}", g, traj.model_copy(update={"turns": turns}), r), block=False)

    for g in range(4):
        put_group(f"g{g}", 0)
    seen: list[tuple[int, float]] = []

    class Hooks(StepHooks):
        async def report(self, result: StepResult) -> None:
            seen.append((result.step, result.metrics["loss_tokens"]))

    class AtVersion10(StepHooks):
        def current_version(self, step: int) -> int:
            return 10

    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    ckpt = tmp_path / "ckpt"
    cfg = LoopConfig(steps=2, groups_per_step=2, ckpt_dir=ckpt)
    assert anyio.run(lambda: train_from_queue(q.aio, trainer, cfg, Hooks())) == 2
    assert seen == [(1, 42.0), (2, 42.0)]
    assert q.stats().acked_groups == 4
    extra = TorchTrainer(tiny).load_checkpoint(ckpt)
    assert extra is not None and extra["trained_episode_ids"] == ["g2-0", "g2-1", "g3-0", "g3-1"]
    assert len(extra["lease_ids"]) == 2

    put_group("old", 0)
    put_group("new", 9)
    cfg = LoopConfig(steps=3, groups_per_step=1, ckpt_dir=ckpt, max_staleness=2)
    assert anyio.run(lambda: train_from_queue(q.aio, trainer, cfg, AtVersion10())) == 3
    s = q.stats()
    assert s.stale_groups == 1 and s.stale_dropped_episodes == 2 and s.acked_groups == 5
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000003"]


def test_uniform_groups_skipped_but_counted_in_reward_mean(tiny: Path) -> None:
    a, b = rollouts(tiny)
    mixed = [episode("a", "g1", a, 1.0), episode("b", "g1", b, 0.0)]
    uniform = [episode("c", "g2", a, 1.0), episode("d", "g2", b, 1.0)]
    m = TorchTrainer(tiny).train_step([mixed, uniform])
    assert m["reward_mean"] == 0.75 and m["skipped_samples"] == 2 and m["loss_tokens"] == 21
    m = TorchTrainer(tiny, TrainerConfig(kl_coef=0.1)).train_step([mixed, uniform])
    assert m["skipped_samples"] == 0 and m["loss_tokens"] == 42  # the KL term still pulls those samples
