"""A tiny random Qwen3-MoE (the session's `tiny_moe`, SmolLM2's tokenizer) through every path a dense
model takes: the hf engine, a chat through the TITO proxy, the torch trainer, weight sync (full and
delta, in process and through disk), LoRA on the attention and on the experts, and the zero-KL check
(the trainer's logprobs are the engine's after every sync).

Real parts: the hf engine's batching worker, the proxy behind uvicorn with the official openai
client, PEFT. The engine also records, per sampled token, the experts each layer routed it to: they
must be the trainer's (`router_agreement` 1.0), the rollout-vs-training routing check; the chat
through TITO carries them into the exported samples (`Trajectory.routed_experts`), and the trainer's
step measures them (`moe_router_agreement`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from miles_env.engines.base import Generation, SamplingParams
from miles_env.engines.hf import HFEngine, HFEngineConfig
from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.moe import routed_experts, router_agreement
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Trajectory, Turn
from tests.trainer_support import episode

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SAMPLE = SamplingParams(max_new_tokens=8, temperature=1.0)
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _engine(model: Path) -> HFEngine:
    return HFEngine(HFEngineConfig(model=str(model), dtype="float32", seed=0, threads=1))


def _traj(prompt: list[int], gen: Generation) -> Trajectory:
    n, m = len(prompt), len(gen.output_ids)
    return Trajectory(token_ids=prompt + gen.output_ids, loss_mask=[0] * n + [1] * m,
                      logprobs=[0.0] * n + gen.logprobs,
                      turns=[Turn(start=n, prompt_len=n, completion_len=m, finish_reason=gen.finish_reason,
                                  weight_version=gen.weight_version)])  # fmt: skip


def _assert_reproduced(trainer: TorchTrainer, prompt: list[int], gen: Generation) -> None:
    """Zero KL: the trainer's logprobs of what the engine sampled are the engine's; and routing."""
    t = _traj(prompt, gen)
    mine = trainer.logprobs([t])[0][len(prompt) :]
    torch.testing.assert_close(mine, torch.tensor(gen.logprobs), rtol=0, atol=1e-5)
    ids = torch.tensor(t.token_ids)
    theirs = torch.tensor(gen.meta["routed_experts"])  # [sampled tokens, layers, top k]
    at = routed_experts(trainer.model, ids, 2)[len(prompt) - 1 : len(prompt) - 1 + len(gen.output_ids)]
    assert theirs.shape == (len(gen.output_ids), 2, 2)
    assert router_agreement(theirs, at) == 1.0


def test_syncs_keep_the_engine_on_the_trainer_and_exports_are_qwen3_moe_checkpoints(
    tmp_path: Path, tiny_moe: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_env.trainer.weight_sync import WeightSyncer

    trainer = TorchTrainer(tiny_moe, TrainerConfig(lr=1e-2, fused_adamw=False))
    engine = _engine(tiny_moe)
    modes = [("full", "in_process"), ("delta", "in_process"), ("full", "disk"), ("delta", "disk")]

    async def main() -> list[dict[str, float]]:
        out = []
        gen = await engine.generate(PROMPT, SAMPLE)
        _assert_reproduced(trainer, PROMPT, gen)  # the same checkpoint on both sides
        for step, (mode, transport) in enumerate(modes, start=1):
            other = await engine.generate(PROMPT, SAMPLE)
            before = {k: v.clone() for k, v in trainer.state_dict().items()}
            group = [episode("a", "g", _traj(PROMPT, gen), 1.0), episode("b", "g", _traj(PROMPT, other), 0.0)]
            assert trainer.train_step([group])["moe_aux_loss"] > 0
            syncer = WeightSyncer(
                mode=mode, transport=transport, dtype=torch.float32, workdir=tmp_path / mode
            )
            syncer.assume(before, step - 1)  # what the engine holds now
            m = await syncer.sync(engine, trainer.state_dict(), step)
            assert (m["sync_delta"], m["sync_repaired"]) == (float(mode == "delta"), 0.0)
            out.append(m)
            gen = await engine.generate(PROMPT, SAMPLE)
            assert gen.weight_version == step
            _assert_reproduced(trainer, PROMPT, gen)
        await engine.close()
        return out

    metrics = anyio.run(main)
    assert all(0 < m["sync_bytes"] <= m["sync_full_bytes"] for m in metrics)
    # an export is a Qwen3-MoE checkpoint: one tensor per expert on disk, loadable by transformers
    out = trainer.export_weights(tmp_path / "export")
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    mine = trainer.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in hf.state_dict().items())


def test_lora_on_the_attention_and_the_experts(tmp_path: Path, tiny_moe: Path) -> None:
    from transformers import AutoModelForCausalLM

    from miles_env.trainer.lora import sync_adapter

    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"), target_parameters=EXPERTS)
    trainer = TorchTrainer(tiny_moe, TrainerConfig(lr=1e-2, fused_adamw=False, lora=lora))
    adapter = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert "model.layers.1.mlp.experts.lora_A.default.weight" in adapter  # down_proj's, one pair per expert
    assert "model.layers.1.mlp.experts.base_layer.lora_B.default.weight" in adapter  # gate_up_proj's
    assert "model.layers.1.self_attn.q_proj.lora_A.default.weight" in adapter
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    engine = _engine(tiny_moe)

    async def main() -> dict[str, float]:
        a, b = await engine.generate(PROMPT, SAMPLE), await engine.generate(PROMPT, SAMPLE)
        trainer.train_step(
            [[episode("a", "g", _traj(PROMPT, a), 1.0), episode("b", "g", _traj(PROMPT, b), 0.0)]]
        )
        with torch.no_grad():  # a trained-looking adapter: after one step B is still ~0
            for n, p in trainer.model.named_parameters():
                if n in adapter:
                    p.copy_(torch.randn_like(p) * 0.3)
        for version in (1, 2):  # the second adapter replaces the first's tensors (same targets)
            m = await sync_adapter(trainer, engine, version, tmp_path / "adapters")
            gen = await engine.generate(PROMPT, SAMPLE)
            assert gen.weight_version == version
            _assert_reproduced(trainer, PROMPT, gen)  # the engine applies the expert adapters unmerged too
            with torch.no_grad():
                for n, p in trainer.model.named_parameters():
                    if n in adapter:
                        p.mul_(-1.0)
        await engine.close()
        return m

    m = anyio.run(main)
    assert 0 < m["sync_bytes"] < 0.05 * m["sync_full_bytes"]
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base, experts included, is bit-identical
    # the merged full weights (what a full sync or an export carries) compute the adapted model
    merged = trainer.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in merged and not any(".lora_" in k for k in merged)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.float32).eval()
    plain.load_state_dict(merged)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, trainer.model(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def _assert_routing_carried(trajs: list[Trajectory], engine: Any, store: Path, session_id: str) -> None:
    """Each exported sample carries the engine's routing of its sampled tokens, turn after turn, and
    keeps it through the replay queue's codec, the journal's replay and `tito audit`."""
    from miles_env.queue.codec import decode_episode, encode_episode
    from miles_env.tito.audit import audit
    from miles_env.tito.store import load_sessions

    recorded = {tuple(c.generation.output_ids): c.generation.meta["routed_experts"] for c in engine.calls}
    for t in trajs:
        want = [row for turn in t.turns if turn.delivered
                for row in recorded[tuple(t.token_ids[turn.start : turn.start + turn.completion_len])]]  # fmt: skip
        assert t.routed_experts is not None and t.routed_experts.rows() == want
        assert (t.routed_experts.layers, t.routed_experts.top_k, t.routed_experts.itemsize) == (2, 2, 1)
    ep = episode("a", "g", trajs[0], 1.0).model_copy(update={"samples": trajs})
    assert decode_episode(*encode_episode(ep)) == ep
    assert load_sessions(store)[session_id].trajectories() == trajs
    report = audit(store)
    assert report.ok and report.snapshots == 1, report.drifts


def _assert_trainer_measures_routing(trainer: TorchTrainer, t: Trajectory) -> None:
    """A step's `moe_router_agreement` is `router_agreement` of the rollout's routing and the
    trainer's on the same tokens: 1.0 on the engine's weights, lower once the routers moved."""
    from miles_env.trainer.moe import rollout_routing, routers

    assert t.routed_experts is not None
    group = [episode("a", "g", t, 1.0), episode("b", "g", t, 0.0)]

    def direct() -> float:
        pos, theirs = rollout_routing(t.loss_mask, t.routed_experts)  # type: ignore[arg-type]
        return router_agreement(theirs, routed_experts(trainer.model, torch.tensor(t.token_ids), 2)[pos])

    assert direct() == 1.0 and trainer.train_step([group])["moe_router_agreement"] == 1.0
    torch.manual_seed(0)
    with torch.no_grad():
        for router, _ in routers(trainer.model):
            router.weight.add_(torch.randn_like(router.weight) * router.weight.std())
    want = direct()
    assert want < 1.0
    assert trainer.train_step([group])["moe_router_agreement"] == pytest.approx(want, abs=1e-12)


@pytest.mark.anyio
async def test_a_chat_through_tito_is_token_exact_carries_its_routing_and_the_trainer_reproduces_it(
    tiny_moe: Path, tmp_path: Path
) -> None:
    """The one end-to-end test of a MoE rollout's routing: through the real proxy into the sample,
    the queue codec and the journal, and measured by the trainer's step (moe_router_agreement)."""
    from miles_env.models import load_tokenizer
    from tests.tito_support import RecordingEngine, check_fidelity, served

    tok = load_tokenizer(tiny_moe)
    engine = RecordingEngine(_engine(tiny_moe))
    async with served(tok, engine, store_dir=tmp_path) as s:  # type: ignore[arg-type]
        h = s.proxy.create_session()
        c = s.client(h.session_id)
        msgs: list = [{"role": "user", "content": "Name a color."}]
        r1 = await c.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                 {"role": "user", "content": "And another one?"}]  # fmt: skip
        await c.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        trajs = s.proxy.export(h.session_id)
    await engine.close()
    check_fidelity(trajs, engine, h.session_id)  # every mask-1 token is exactly the engine's
    assert sum(len(t.turns) for t in trajs) == 2
    _assert_routing_carried(trajs, engine, tmp_path, h.session_id)
    trainer = TorchTrainer(tiny_moe, TrainerConfig())
    for t in trajs:
        mine = trainer.logprobs([t])[0]
        sampled = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(mine[sampled], torch.tensor(t.logprobs)[sampled], rtol=0, atol=1e-5)
    for call in engine.calls:
        _assert_reproduced(trainer, list(call.input_ids), call.generation)
    _assert_trainer_measures_routing(trainer, max(trajs, key=lambda t: t.n_sampled))
