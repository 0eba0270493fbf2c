"""Mixture-of-experts models in the trainer: the checkpoint layout, the megatron conversion both ways,
the load-balancing loss, and the megatron layout checks (single process, tiny random Qwen2/Qwen3-MoE).

What they pin down: the per-expert layout of the checkpoint files is exactly what transformers writes
and reads (`miles_env.weight_layout`); HF -> megatron -> HF is bit-exact (router, experts, Qwen2-MoE's
gated shared expert) and expert-parallel shards reassemble; megatron's MoE GPTModel gives the HF
logits and takes the torch backend's step, aux loss included; the aux loss's gradient is exactly
coef x d(token-weighted Switch loss); impossible tp x pp x cp x ep layouts fail at load in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_env.errors import ConfigError
from miles_env.models import make_tiny_moe
from miles_env.trainer.config import TrainerConfig
from miles_env.weight_layout import to_checkpoint, to_model
from tests.megatron_support import groups

pytest.importorskip("megatron.core")

KINDS = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both layouts over a 96-token vocabulary (no tokenizer: these tests feed ids)."""
    root = tmp_path_factory.mktemp("moe")
    return {kind: make_tiny_moe(root / kind, kind, tokenizer=None) for kind in KINDS}


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_layout_is_the_one_transformers_writes_and_reads(
    tmp_path: Path, small: dict[str, Path], kind: str
) -> None:
    from safetensors.torch import load_file

    path = small[kind]
    state = dict(_hf(path).state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5 fuses them in memory
    disk = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk  # the files keep one per expert
    mine = to_checkpoint(state)
    del mine["lm_head.weight"]  # tied: save_pretrained stores the embedding once
    assert set(mine) == set(disk) and all(torch.equal(mine[k], disk[k]) for k in disk)
    back = to_model(disk, set(state))
    assert set(back) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(back[k], state[k]) for k in back)
    partial = {k: v for k, v in disk.items() if "layers.1.mlp.experts.2." not in k}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts: expert tensors are incomplete"):
        to_model(partial)
    dense = {"model.layers.0.mlp.gate_proj.weight": disk["model.embed_tokens.weight"]}
    assert to_model(dense) == dense and to_checkpoint(dense) == dense
    again = make_tiny_moe(tmp_path / "again", kind, tokenizer=None)  # same seed, same bytes
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def _step_both(path: Path, cfg: TrainerConfig) -> list[tuple[dict[str, float], dict[str, torch.Tensor]]]:
    from miles_env.trainer.megatron.backend import MegatronTrainer
    from miles_env.trainer.torch_backend import TorchTrainer

    out = []
    for cls in (TorchTrainer, MegatronTrainer):
        trainer = cls(path, cfg)
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        metrics = trainer.train_step(groups())
        out.append((metrics, {k: v - before[k] for k, v in trainer.state_dict().items()}))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_converts_both_ways_gives_hf_logits_and_the_torch_step(
    small: dict[str, Path], kind: str
) -> None:
    from transformers import AutoConfig

    from miles_env.trainer.megatron.backend import MegatronTrainer
    from miles_env.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, model_shape
    from miles_env.trainer.megatron.experts import ep_global, ep_slice

    path = small[kind]
    shape = model_shape(AutoConfig.from_pretrained(str(path)))
    assert shape.moe is not None and shape.moe.experts == 4
    hf_model = _hf(path)
    hf = dict(hf_model.state_dict())
    mc = hf_to_megatron(hf, shape)
    assert ("decoder.layers.0.mlp.shared_experts.gate_weight" in mc) == (kind == "qwen2_moe")
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in mc
    back = megatron_to_hf(mc, shape)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # expert-parallel shards (2 ranks x 2 experts) put back under global indices give every expert
    ranks = [ep_slice(mc, r, 2, 4) for r in range(2)]
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in ranks[1]
    regathered = {k: v for k, v in ranks[0].items() if ".local_experts." not in k}
    for r, part in enumerate(ranks):
        regathered |= ep_global(part, r, 2)
    assert set(regathered) == set(mc) and all(torch.equal(regathered[k], mc[k]) for k in mc)
    with pytest.raises(KeyError, match="experts incomplete"):
        megatron_to_hf(ranks[0], shape)
    trainer = MegatronTrainer(path, TrainerConfig())
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (trainer.logits(ids) - hf_model(input_ids=ids).logits).abs().max() < 1e-5
    del trainer
    (mt, dt), (mm, dm) = _step_both(
        path, TrainerConfig(lr=1e-3, fused_adamw=False, max_tokens_per_microbatch=40)
    )
    for key in ("loss", "pg_loss", "grad_norm", "moe_aux_loss", "moe_max_load"):
        assert mm[key] == pytest.approx(mt[key], rel=1e-5), key
    assert mt["moe_aux_coef"] == 0.01 and mt["moe_aux_loss"] > 1.0  # the config's; 1.0 = balanced
    assert set(dm) == set(dt)
    for k in dt:  # Adam's first step is ~lr * sign(grad): only ~0 grads may land differently
        assert torch.isclose(dm[k], dt[k], rtol=1e-2, atol=1e-5).float().mean() > 0.99, k


def _switch_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Written out again here: E * sum_e (share of top-k slots) * (mean router probability)."""
    p = torch.softmax(logits.float(), dim=-1)
    counts = torch.stack([(p.topk(top_k, dim=-1).indices == e).sum() for e in range(p.shape[1])]).float()
    return p.shape[1] * (counts / (p.shape[0] * top_k) * p.mean(0)).sum()


def test_aux_loss_gradient_is_coef_times_the_token_weighted_switch_loss(small: dict[str, Path]) -> None:
    from miles_env.trainer.batch import collate
    from miles_env.trainer.samples import flatten_groups, pack_microbatches
    from miles_env.trainer.torch_backend import TorchTrainer

    path, batch, coef = small["qwen3_moe"], groups(), 5.0
    grads, metrics = {}, {}
    for c in (0.0, coef):
        trainer = TorchTrainer(path, TrainerConfig(lr=1e-3, fused_adamw=False, moe_aux_loss_coef=c,
                                                   max_tokens_per_microbatch=40))  # fmt: skip

        def keep(t: TorchTrainer = trainer, c: float = c) -> float:  # the step's grads, before AdamW
            grads[c] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
            return 0.0

        trainer._clip_and_step = keep  # type: ignore[method-assign]
        metrics[c] = trainer.train_step(batch)
    # the same step by hand: every microbatch's layer-mean Switch loss, weighted by its real tokens
    model = _hf(path)
    samples = flatten_groups(batch, TrainerConfig())
    lengths = [len(s.token_ids) for s in samples]
    mbs = pack_microbatches(lengths, 40)
    assert len(mbs) > 1
    total = torch.zeros(())
    for idx in mbs:
        b = collate([samples[i] for i in idx], torch.device("cpu"))
        valid = (torch.arange(b.ids.shape[1])[None] < torch.tensor(b.lengths)[:, None]).reshape(-1)
        router_logits = model(input_ids=b.ids, output_router_logits=True).router_logits
        aux = torch.stack([_switch_loss(lg[valid], 2) for lg in router_logits]).mean()
        total = total + aux * sum(b.lengths) / sum(lengths)
    routers = [n for n in grads[0.0] if n.endswith("mlp.gate.weight")]
    expected = torch.autograd.grad(coef * total, [dict(model.named_parameters())[n] for n in routers])
    for n, g in zip(routers, expected, strict=True):
        torch.testing.assert_close(grads[coef][n] - grads[0.0][n], g, rtol=1e-4, atol=1e-7)
    value = float(total.detach())
    assert metrics[coef]["moe_aux_loss"] == pytest.approx(value, rel=1e-6)
    assert metrics[coef]["loss"] == pytest.approx(metrics[0.0]["loss"] + coef * value, rel=1e-6)
    assert metrics[coef]["pg_loss"] == metrics[0.0]["pg_loss"]


def _shape(heads: int = 4, groups_: int = 2, layers: int = 2, experts: int | None = 4) -> SimpleNamespace:
    moe = SimpleNamespace(experts=experts) if experts else None
    return SimpleNamespace(heads=heads, groups=groups_, layers=layers, moe=moe)


@pytest.mark.parametrize(
    ("layout", "world", "shape", "error"),
    [
        (
            {"tp": 2, "pp": 2},
            6,
            _shape(),
            r"trainer\.tp x pp x cp = 2 x 2 x 1 does not divide the world of 6",
        ),
        (
            {"tp": 4},
            4,
            _shape(experts=None),
            r"trainer\.tp=4 does not divide the model's 4 attention heads and 2 key-value",
        ),
        ({"pp": 3}, 3, _shape(), r"trainer\.pp=3 does not divide the model's 2 layers"),
        ({"ep": 2}, 2, _shape(experts=None), r"trainer\.ep=2: the model has no experts"),
        ({"ep": 3}, 3, _shape(), r"trainer\.ep=3 does not divide the model's 4 experts"),
        ({"ep": 2, "pp": 2}, 2, _shape(), r"trainer\.ep=2 does not divide data x context parallel = 1 x 1"),
        ({"tp": 2, "ep": 2}, 4, _shape(), r"trainer\.tp=2 with a MoE model needs sequence parallelism"),
        (
            {"cp": 2},
            2,
            _shape(),
            r"trainer\.cp=2 needs GPUs: megatron-core 0\.16 runs context parallelism only",
        ),
    ],
)
def test_impossible_layouts_fail_at_load_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
    layout: dict,
    world: int,
    shape: SimpleNamespace,
    error: str,  # type: ignore[type-arg]
) -> None:
    from miles_env.trainer.megatron.layout import check_layout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's answer for cp, on any machine
    cfg = SimpleNamespace(**({"tp": 1, "pp": 1, "cp": 1, "ep": 1} | layout))
    with pytest.raises(ConfigError, match=error) as info:
        check_layout(cfg, world, shape)
    assert "\n" not in str(info.value)
    check_layout(
        SimpleNamespace(tp=1, pp=1, cp=1, ep=2), 2, shape if shape.moe else _shape()
    )  # ep = dp: fine


def test_the_backend_refuses_a_layout_before_building_anything(small: dict[str, Path]) -> None:
    from miles_env.trainer.build import build_trainer

    with pytest.raises(ConfigError, match=r"trainer\.ep=3 does not divide the model's 4 experts"):
        build_trainer("megatron", small["qwen3_moe"], {"ep": 3})
    with pytest.raises(ConfigError, match=r"trainer\.ep: Input should be greater than or equal to 1"):
        build_trainer("megatron", small["qwen3_moe"], {"ep": 0})


def test_context_parallel_chunks_tile_the_sequence_and_te_names_round_trip(small: dict[str, Path]) -> None:
    """The CPU-checkable half of the GPU-only cp path (trainer/megatron/context.py): the cp ranks'
    positions (megatron's 2 x cp zigzag chunks) cover the padded sequence once, so every logprob
    column but 0 is some rank's; the TE spec's fused-norm names map back to the local spec's."""
    from transformers import AutoConfig

    from miles_env.trainer.megatron.context import cp_positions, te_names
    from miles_env.trainer.megatron.convert import hf_to_megatron, model_shape

    for cp, length in ((2, 16), (4, 40), (3, 18)):
        parts = [cp_positions(length, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(length))
        assert all(len(p) == length // cp for p in parts)
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    path = small["qwen3_moe"]
    mc = hf_to_megatron(_hf(path).state_dict(), model_shape(AutoConfig.from_pretrained(str(path))))
    te = te_names(mc, moe=True, to_te=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te  # a MoE layer keeps its own pre-MLP norm
    assert te_names(te, moe=True, to_te=False).keys() == mc.keys()
    dense = {"decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(2)}
    assert set(te_names(dense, moe=False, to_te=True)) == {
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    }
