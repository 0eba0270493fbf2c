"""Megatron backend equivalence: HF <-> megatron conversion is exact, the megatron GPTModel's logits
match the HF model's (tiny Llama/Qwen2/Qwen3 here, SmolLM2 in the slow test), and one training step
on the same batch moves both backends' weights the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, model_shape, shard, unshard
from tests.megatron_support import groups, tiny_model

pytest.importorskip("megatron.core")


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_round_trip_exact_and_tp_shards(tmp_path: Path, kind: str) -> None:
    from transformers import AutoConfig

    path = tiny_model(tmp_path / kind, kind)
    shape = model_shape(AutoConfig.from_pretrained(str(path)))
    hf = _hf_state(path)
    mc = hf_to_megatron(hf, shape)
    back = megatron_to_hf(mc, shape)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    for size in (2, 4):
        for name, t in mc.items():
            assert torch.equal(unshard(name, [shard(name, t, r, size) for r in range(size)]), t), name


def test_round_trip_exact_smollm2() -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles_env.models import resolve_model

    path = resolve_model("smollm2")
    shape = model_shape(AutoConfig.from_pretrained(str(path)))
    hf = load_file(str(path / "model.safetensors"))
    back = megatron_to_hf(hf_to_megatron(hf, shape), shape)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]  # tied, as HF's state_dict


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_match_hf_tiny(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles_env.trainer.megatron.backend import MegatronTrainer

    path = tiny_model(tmp_path / kind, kind)
    trainer = MegatronTrainer(path, TrainerConfig())
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (trainer.logits(ids) - hf(input_ids=ids).logits).abs().max()
    assert diff < 1e-5


def _step_both(path: Path, cfg: TrainerConfig) -> tuple[dict, dict, dict, dict]:  # type: ignore[type-arg]
    from miles_env.trainer.megatron.backend import MegatronTrainer
    from miles_env.trainer.torch_backend import TorchTrainer

    batch = groups(vocab=int(__import__("json").loads((path / "config.json").read_text())["vocab_size"]))
    out = []
    for cls in (TorchTrainer, MegatronTrainer):
        trainer = cls(path, cfg)
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        metrics = trainer.train_step(batch)
        out += [metrics, {k: v - before[k] for k, v in trainer.state_dict().items()}]
        del trainer
    return out[0], out[1], out[2], out[3]


def _assert_same_step(mt: dict, dt: dict, mm: dict, dm: dict, lr: float) -> None:  # type: ignore[type-arg]
    assert mm["loss"] == pytest.approx(mt["loss"], rel=1e-4, abs=1e-6)
    assert mm["grad_norm"] == pytest.approx(mt["grad_norm"], rel=1e-3)
    assert set(dm) == set(dt)
    for k in dt:
        # Adam's first step is ~lr * sign(grad): the two backends agree up to elements whose grad is ~0
        agree = torch.isclose(dm[k], dt[k], rtol=1e-2, atol=lr * 1e-2).float().mean()
        assert agree > 0.99, (k, float(agree))
        assert (dm[k] - dt[k]).abs().max() <= 2.5 * lr, k


def test_one_step_same_as_torch_tiny(tmp_path: Path) -> None:
    cfg = TrainerConfig(lr=1e-3, fused_adamw=False)
    _assert_same_step(*_step_both(tiny_model(tmp_path / "m"), cfg), lr=1e-3)


@pytest.mark.slow
@pytest.mark.model
def test_logits_match_hf_smollm2() -> None:
    from transformers import AutoModelForCausalLM

    from miles_env.models import resolve_model
    from miles_env.trainer.megatron.backend import MegatronTrainer

    trainer = MegatronTrainer("smollm2", TrainerConfig())
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (trainer.logits(ids) - hf(input_ids=ids).logits).abs().max()
    assert diff < 1e-4


@pytest.mark.slow
@pytest.mark.model
def test_one_step_same_as_torch_smollm2() -> None:
    from miles_env.models import resolve_model

    cfg = TrainerConfig(lr=1e-5)
    _assert_same_step(*_step_both(resolve_model("smollm2"), cfg), lr=1e-5)


def test_checkpoint_resume_and_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from miles_env.trainer.megatron.backend import MegatronTrainer

    path = tiny_model(tmp_path / "m")
    cfg = TrainerConfig(lr=1e-3)
    a = MegatronTrainer(path, cfg)
    a.train_step(groups(0))
    a.save_checkpoint(tmp_path / "ckpt", {"note": 1})
    b = MegatronTrainer(path, cfg)
    assert b.load_checkpoint(tmp_path / "ckpt") == {"note": 1} and b.step == 1
    ma, mb = a.train_step(groups(1)), b.train_step(groups(1))  # same optimizer state: same next step
    assert ma["loss"] == mb["loss"]
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    out = a.export_weights(tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (a.logits(ids) - hf(input_ids=ids).logits).abs().max() < 1e-5
