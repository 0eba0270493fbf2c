"""The learning rate of each step (trainer/lr_schedule.py) on both backends.

Unit: linear warmup from lr / W, then constant or cosine to lr_min, equal at every step to
megatron-core's own OptimizerParamScheduler (init_lr 0) as its training loop steps it (warmup one
step ahead, so the first update moves); the
config's one-line errors; `miles-env train` decays a cosine over its trainer.steps. On the tiny
random Llama: the torch backend, the megatron backend's torch step and its own
DistributedOptimizer (one process) each log `lr` per step as scheduled, and the schedule is what
the optimizer applied: Adam's first update moves a weight by lr x g / (|g| + eps), so the largest
change of the first step is that step's lr. A resumed trainer continues the schedule; a step with nothing to train moves no weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from miles_env.config import RunConfig
from miles_env.job.plan import build_job_trainer
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.lr_schedule import lr_at
from miles_env.trainer.torch_backend import TorchTrainer
from tests.megatron_support import groups, tiny_model

LR = 1e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def test_warmup_then_constant_or_cosine_as_megatron_schedules_it() -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warm = TrainerConfig(lr=LR, lr_warmup_steps=4)
    assert [lr_at(warm, s) for s in range(6)] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR])
    assert lr_at(TrainerConfig(lr=LR), 0) == LR  # no warmup: the first update at full lr
    cases = [
        (warm, "constant", 20),
        (
            TrainerConfig(lr=LR, lr_warmup_steps=3, lr_schedule="cosine", lr_min=1e-4, lr_decay_steps=10),
            "cosine",
            10,
        ),
        (TrainerConfig(lr=LR, lr_schedule="cosine", lr_decay_steps=7), "cosine", 7),
    ]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    for cfg, style, decay in cases:
        theirs = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.lr_min, lr_warmup_steps=cfg.lr_warmup_steps,
            lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
            wd_incr_style="constant",
        )  # fmt: skip
        for step in range(decay + 3):  # its loop's num_steps after `step` updates; warmup one ahead
            theirs.num_steps = step + 1 if step < cfg.lr_warmup_steps else step
            assert lr_at(cfg, step) == pytest.approx(theirs.get_lr(opt.param_groups[0]), rel=1e-12), (
                style,
                step,
            )
    cosine = cases[1][0]
    assert lr_at(cosine, 3) == LR and lr_at(cosine, 9) > 1e-4  # the last update of 10 still moves
    assert lr_at(cosine, 10) == lr_at(cosine, 30) == 1e-4  # from lr_decay_steps on: lr_min


def test_the_config_errors_and_the_job_decays_over_its_steps(tiny: Path) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"lr_schedule": "cosine"}, "lr_schedule=cosine needs lr_decay_steps"),
        ({"lr_schedule": "cosine", "lr_decay_steps": 3, "lr_warmup_steps": 3}, "must be more than lr_warmup"),
        ({"lr_schedule": "cosine", "lr_decay_steps": 3, "lr_min": 1.0}, "lr_min=1.0 is more than lr"),
        ({"lr_schedule": "linear"}, "Input should be 'constant' or 'cosine'"),
        ({"lr_warmup_steps": -1}, "greater than or equal to 0"),
    ]
    for options, msg in bad:
        with pytest.raises(ValidationError, match=msg):
            TrainerConfig(**options)
    cfg = RunConfig.model_validate(
        {"env": "terminal-basics", "trainer": {"steps": 5, "lr_schedule": "cosine", "lr_warmup_steps": 2}}
    )
    trainer = build_job_trainer(cfg, tiny)
    assert trainer.config.lr_decay_steps == 5 and trainer.config.lr_warmup_steps == 2  # type: ignore[attr-defined]


def _steps(trainer: Any, n: int) -> list[tuple[float, float]]:
    """(logged lr, largest weight change) of each of `n` steps."""
    out = []
    for i in range(n):
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        lr = trainer.train_step(groups(seed=i))["lr"]
        after = trainer.state_dict()
        out.append((lr, max(float((after[k] - v).abs().max()) for k, v in before.items())))
    return out


def _assert_scheduled(cfg: TrainerConfig, steps: list[tuple[float, float]]) -> None:
    assert [lr for lr, _ in steps] == pytest.approx([lr_at(cfg, s) for s in range(len(steps))], rel=1e-12)
    first_lr, first_move = steps[0]
    assert first_move == pytest.approx(first_lr, rel=1e-3)  # Adam's first update: lr x sign(g)


def _assert_no_update(trainer: Any) -> None:
    """A step with nothing to train (dynamic sampling's skipped step) moves no weight: on megatron's
    DistributedOptimizer, Adam's momentum would (it stepped with zero grads before)."""
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    step = trainer.step
    assert trainer.train_step(())["grad_norm"] == 0.0 and trainer.step == step + 1
    assert all(torch.equal(v, trainer.state_dict()[k]) for k, v in before.items())


def test_torch_backend_follows_the_schedule_and_resumes_it(tiny: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(lr=LR, lr_warmup_steps=3, fused_adamw=False)
    trainer = TorchTrainer(tiny, cfg)
    _assert_scheduled(cfg, _steps(trainer, 4))
    _assert_no_update(trainer)
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = TorchTrainer(tiny, cfg.model_copy(update={"lr_schedule": "cosine", "lr_decay_steps": 6}))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.train_step(groups(seed=9))["lr"] == pytest.approx(lr_at(resumed.config, 5))


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["torch-step", "megatron-optimizer"])
def test_megatron_backend_follows_the_schedule(tiny: Path, distributed_optimizer: bool) -> None:
    from miles_env.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    cfg = MegatronTrainerConfig(lr=LR, lr_warmup_steps=2, lr_schedule="cosine", lr_decay_steps=4, lr_min=1e-3,
                                fused_adamw=False, distributed_optimizer=distributed_optimizer)  # fmt: skip
    trainer = MegatronTrainer(tiny, cfg)
    assert (trainer.ddp is not None) is distributed_optimizer  # megatron's own optimizer steps
    _assert_scheduled(cfg, _steps(trainer, 5))
    _assert_no_update(trainer)
