"""On-policy distillation (`algorithm: opd`, miles_env/opd.py): the teacher's prefill-only score,
the per-token advantage it becomes, and the student moving toward the teacher.

Real parts: the hf engine on tiny random Llamas (student and teacher), the torch trainer, and for
the end-to-end run the whole `miles-env train` (proxy, bubblewrap sandboxes, sqlite queue). The
scripted engine is the teacher only where the model is not the point. The long run (SmolLM2
distilled from an RL-trained checkpoint, eval pass rate) is bench/bench_opd.py.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from miles_env.config import validate_config
from miles_env.engines.base import PromptScorer, SamplingParams
from miles_env.engines.hf import HFEngine, HFEngineConfig
from miles_env.engines.scripted import ScriptedEngine, pseudo_logprob
from miles_env.errors import ConfigError, EngineError
from miles_env.opd import Teacher, opd_metrics
from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.torch_backend import TorchTrainer, flatten_groups
from miles_env.types import Episode, Reward, Status, Trajectory
from tests.bandit_support import Bandit
from tests.train_support import rows, train_args


def _episode(
    i: int, prompt: list[int], output: list[int], logprobs: list[float], score: float = 0.0
) -> Episode:
    traj = Trajectory(
        token_ids=prompt + output, loss_mask=[0] * len(prompt) + [1] * len(output),
        logprobs=[0.0] * len(prompt) + logprobs,
    )  # fmt: skip
    return Episode(
        id=f"e{i}", task_id="t", env="e", group_id=f"g{i // 4}", status=Status.COMPLETED,
        reward=Reward(score=score), samples=[traj],
    )  # fmt: skip


def _direct_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return [0.0, *picked.tolist()]


def test_hf_score_equals_a_direct_forward_pass(tiny_model: Path) -> None:
    async def main() -> None:
        engine = HFEngine(HFEngineConfig(model=str(tiny_model), dtype="float32"))
        try:
            assert isinstance(engine, PromptScorer)
            seqs = [list(range(100, 117)), [5, 6, 7, 8, 9], [42], []]
            gen, batched = await asyncio.gather(  # a score between the decode steps of a generation
                engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8, seed=0)), engine.score(seqs)
            )
            assert len(gen.output_ids) > 0
            alone = await engine.score([seqs[0]])
            model = engine.model
        finally:
            await engine.close()
        assert [len(s) for s in batched] == [17, 5, 1, 0] and batched[2] == [0.0]
        # same dtype (float32); the engine's worker thread may reduce in another order: float rounding only
        want = [torch.tensor(_direct_logprobs(model, seq)) for seq in seqs[:2]]
        torch.testing.assert_close(torch.tensor(alone[0]), want[0], rtol=0, atol=1e-5)
        for got, direct in zip(batched, want, strict=False):  # padded in a batch: the same logprobs
            torch.testing.assert_close(torch.tensor(got), direct, rtol=0, atol=1e-5)
        assert all(lp < 0 for lp in batched[0][1:])

    asyncio.run(main())


def test_sglang_score_through_the_native_generate_api(tiny_model: Path) -> None:
    """The SGLang client's score is a /generate with max_new_tokens 0 and logprob_start_len 0 (slime's
    OPD request); the embedded server answers a batch with input_token_logprobs, the first null."""
    import httpx

    from miles_env.engines.sglang import SGLangEngine
    from miles_env.engines.sglang_server import running_server

    async def main() -> None:
        engine = HFEngine(HFEngineConfig(model=str(tiny_model), dtype="float32"))
        seqs = [list(range(100, 110)), [7, 8, 9]]
        try:
            direct = await engine.score(seqs)
            async with running_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
                client = SGLangEngine(url)
                try:
                    assert isinstance(client, PromptScorer)
                    assert await client.score([*seqs, []]) == [*direct, []]
                finally:
                    await client.close()
                body = {"input_ids": seqs[1], "return_logprob": True, "logprob_start_len": 0}
                raw = (
                    await http.post("/generate", json=body | {"sampling_params": {"max_new_tokens": 0}})
                ).json()
                assert raw["output_ids"] == [] and raw["meta_info"]["input_token_logprobs"][0] == [
                    None,
                    7,
                    None,
                ]
                assert [p[0] for p in raw["meta_info"]["input_token_logprobs"][1:]] == direct[1][1:]
                batch = await http.post("/generate", json=body | {"input_ids": seqs, "sampling_params": {}})
                assert batch.status_code == 400  # a batch is served only to score
        finally:
            await engine.close()

    asyncio.run(main())


def test_scripted_score_is_what_generate_recorded() -> None:
    async def main() -> None:
        engine = ScriptedEngine(echo_tokens=6)
        prompt = [11, 12, 13]
        gen = await engine.generate(prompt, SamplingParams(max_new_tokens=6))
        [scored] = await engine.score([prompt + gen.output_ids])
        assert scored[len(prompt) :] == gen.logprobs
        assert scored[0] == 0.0 and scored[1] == pseudo_logprob(1, 12)

    asyncio.run(main())


def test_teacher_fills_a_group_and_the_metrics_read_it() -> None:
    prompt, out = [11, 12, 13], [20, 21]
    group = [_episode(i, prompt, out, [-0.5, -0.25]) for i in range(2)]
    scored = asyncio.run(Teacher(ScriptedEngine()).score_group(group))
    teacher = [pseudo_logprob(3, 20), pseudo_logprob(4, 21)]
    for ep in scored:
        assert ep.samples[0].teacher_logprobs == [0.0, 0.0, 0.0, *teacher]  # 0.0 where the mask is 0
        assert ep.timings["teacher_s"] >= 0.0
    m = opd_metrics(scored, step_s=10.0)
    want = ((-0.5 - teacher[0]) + (-0.25 - teacher[1])) / 2
    assert math.isclose(m["opd/reverse_kl"], want) and m["opd/teacher_tokens"] == 10.0
    assert m["opd/teacher_share"] == pytest.approx(m["opd/teacher_s"] / 10.0)
    assert math.isnan(opd_metrics(group, step_s=1.0)["opd/reverse_kl"])  # nothing scored


def test_teacher_logprobs_are_checked_and_survive_the_queue_codec() -> None:
    from miles_env.queue.codec import decode_episode, encode_episode

    with pytest.raises(ValueError, match=r"teacher_logprobs\[0\]=-1.0 where loss_mask is 0"):
        Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], teacher_logprobs=[-1.0, -2.0])
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries"):
        Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], teacher_logprobs=[0.0])
    [ep] = asyncio.run(Teacher(ScriptedEngine()).score_group([_episode(0, [1, 2], [3, 4], [-0.5, -0.25])]))
    assert decode_episode(*encode_episode(ep)) == ep


def test_opd_advantage_is_per_token_and_mixes_the_reward() -> None:
    prompt, out = [1, 2], [3, 4]
    eps = [_episode(i, prompt, out, [-1.0, -2.0], score=1.0) for i in range(2)]  # one reward: A = 0
    eps = [
        e.model_copy(
            update={"samples": [e.samples[0].model_copy(update={"teacher_logprobs": [0, 0, -0.5, -4.0]})]}
        )
        for e in eps
    ]
    assert flatten_groups([eps], TrainerConfig()) == []  # GRPO: no gradient in a one-reward group
    samples = flatten_groups([eps], TrainerConfig(opd_kl_weight=2.0, opd_reward_weight=0.0))
    assert [list(s.token_advantages or []) for s in samples] == [[0.0, 0.0, 1.0, -4.0]] * 2
    mixed = [_episode(0, prompt, out, [-1.0, -2.0], 1.0), _episode(1, prompt, out, [-1.0, -2.0], 0.0)]
    mixed = [
        e.model_copy(
            update={"samples": [e.samples[0].model_copy(update={"teacher_logprobs": [0, 0, -1.0, -2.0]})]}
        )
        for e in mixed
    ]
    adv = [list(s.token_advantages or []) for s in flatten_groups([mixed], TrainerConfig(opd_kl_weight=1.0))]
    a = 1 / math.sqrt(2)  # GRPO's advantage of rewards (1, 0); the teacher agrees with the student here
    assert adv[0][2] == pytest.approx(a, rel=1e-5) and adv[1][3] == pytest.approx(-a, rel=1e-5)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        flatten_groups([[_episode(0, prompt, out, [-1.0, -2.0])]], TrainerConfig(opd_kl_weight=1.0))


def test_opd_config_sections() -> None:
    cfg = validate_config(
        {"algorithm": "opd", "opd": {"teacher": {"kind": "scripted"}, "reward_weight": 0.5}}
    )
    assert cfg.opd is not None and cfg.opd.kl_weight == 1.0 and cfg.opd.reward_weight == 0.5
    cases: list[tuple[dict[str, Any], str]] = [
        ({"algorithm": "opd"}, "opd: algorithm=opd needs opd.teacher"),
        ({"opd": {"teacher": {}}}, "opd: opd is read by algorithm=opd"),
        ({"algorithm": "opd", "opd": {"teacher": {}, "kl_weight": 0}}, "opd.kl_weight"),
        ({"algorithm": "ppo"}, "algorithm"),
    ]
    for bad, where in cases:
        with pytest.raises(ConfigError, match=where):
            validate_config(bad)


def _tiny(path: Path, scale: float) -> Path:
    """A tiny Llama (the tiny_model shape, seed 0) whose logits are `scale` times the base ones
    (the final norm's weight): a student and a sharper teacher of one family."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles_env.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def _exact_reverse_kl(
    student: torch.nn.Module, teacher: torch.nn.Module, seqs: list[list[int]], start: int
) -> float:
    """KL(student || teacher) summed over the vocabulary, averaged over the positions >= start."""
    with torch.no_grad():
        ids = torch.tensor(seqs)
        ls = torch.log_softmax(student(input_ids=ids).logits.float(), -1)[:, start - 1 : -1]
        lt = torch.log_softmax(teacher(input_ids=ids).logits.float(), -1)[:, start - 1 : -1]
    return float((ls.exp() * (ls - lt)).sum(-1).mean())


def test_distilling_a_tiny_student_lowers_its_reverse_kl(tmp_path: Path) -> None:
    student_dir, teacher_dir = _tiny(tmp_path / "student", 10.0), _tiny(tmp_path / "teacher", 30.0)

    async def main() -> list[float]:
        student = HFEngine(HFEngineConfig(model=str(student_dir), seed=0))
        teacher = Teacher(HFEngine(HFEngineConfig(model=str(teacher_dir))))
        trainer = TorchTrainer(student_dir, TrainerConfig(lr=1e-3, opd_kl_weight=1.0, opd_reward_weight=0.0))
        prompts = [list(range(200 + 7 * i, 206 + 7 * i)) for i in range(4)]
        held_out = [p + list(range(300 + i, 316 + i)) for i, p in enumerate(prompts)]  # fixed contexts
        sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
        kls = []
        try:
            for step in range(5):
                kls.append(_exact_reverse_kl(trainer.model, teacher.scorer.model, held_out, 6))  # type: ignore[attr-defined]
                gens = await asyncio.gather(
                    *[student.generate(p, sampling) for p in prompts for _ in range(4)]
                )
                eps = [_episode(j, prompts[j // 4], g.output_ids, g.logprobs) for j, g in enumerate(gens)]
                groups = [await teacher.score_group(eps[i : i + 4]) for i in range(0, 16, 4)]
                assert opd_metrics([e for g in groups for e in g], 1.0)["opd/reverse_kl"] > 0
                metrics = await asyncio.to_thread(trainer.train_step, groups)
                assert metrics["samples"] == 16
                await student.update_weights(trainer.state_dict(), weight_version=step + 1)
            kls.append(_exact_reverse_kl(trainer.model, teacher.scorer.model, held_out, 6))  # type: ignore[attr-defined]
        finally:
            await student.close()
            await teacher.close()
        return kls

    kls = asyncio.run(main())
    assert kls[-1] < kls[0] - 0.05, kls
    assert sum(b < a for a, b in zip(kls, kls[1:], strict=False)) >= 4, kls  # falls step after step


@pytest.mark.slow
def test_train_with_algorithm_opd_reports_the_teacher(tmp_path: Path, tiny_model: Path) -> None:
    """The job: the teacher (here the student's own starting weights) scores every group; at step 1
    the student is the teacher, so the reverse KL is ~0 (an off-by-one would not be)."""
    run_dir = tmp_path / "run"
    args = train_args(
        run_dir, tiny_model, 2, "eval.enabled=false", "algorithm=opd", "opd.teacher.kind=hf",
        f"opd.teacher.model={tiny_model}", "opd.teacher.dtype=float32", "opd.reward_weight=0.5",
    )  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert abs(train[0]["opd/reverse_kl"]) < 1e-3, train[0]
    for r in train:
        assert r["opd/teacher_s"] > 0 and 0 < r["opd/teacher_share"] < 1 and r["opd/teacher_tokens"] > 0
        assert r["samples"] == 4  # no sample skipped: the teacher signal is per token


class _HangingScorer(ScriptedEngine):
    async def score(self, sequences: Any) -> list[list[float]]:
        await asyncio.sleep(30)
        return []


def test_a_teacher_fault_drops_one_group_and_a_dead_teacher_raises() -> None:
    group = [_episode(i, [1, 2], [3, 4], [-0.5, -0.25]) for i in range(2)]

    async def main() -> None:
        teacher = Teacher(
            ScriptedEngine(fail_score_calls=frozenset({1, 3, 4, 5})), max_consecutive_failures=3
        )
        assert await teacher.score_group(group) is None and "score call 1 fails" in teacher.last_error
        scored = await teacher.score_group(group)  # a success resets the count of failures in a row
        assert scored is not None and scored[0].samples[0].teacher_logprobs is not None
        assert await teacher.score_group(group) is None and await teacher.score_group(group) is None
        with pytest.raises(EngineError, match="opd teacher failed 3 groups in a row; last: EngineError"):
            await teacher.score_group(group)
        assert teacher.take_dropped() == 4 and teacher.take_dropped() == 0
        hung = Teacher(_HangingScorer(), timeout_s=0.2)
        assert await hung.score_group(group) is None and hung.last_error == "timed out after 0.2 s"

    asyncio.run(main())


@pytest.mark.slow
def test_a_failing_teacher_costs_the_run_one_group_and_a_dead_one_ends_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The job re-rolls a group the teacher dropped (the step still trains groups_per_step groups);
    a teacher that keeps failing ends the run with the cause, not a hang."""
    base = [
        "eval.enabled=false",
        "algorithm=opd",
        "opd.teacher.kind=scripted",
        f"opd.teacher.model={tiny_model}",
    ]
    run_dir = tmp_path / "flaky"
    args = train_args(run_dir, tiny_model, 2, *base, "opd.teacher.fail_score_calls=[2]")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())  # the console wraps long lines
    assert "dropped, the teacher failed: EngineError: scripted: score call 2 fails" in said
    train = rows(run_dir, "train")
    assert [r["samples"] for r in train] == [4, 4]  # both steps trained 2 full groups
    assert sum(r["opd/groups_dropped"] for r in train) == 1
    dead = train_args(tmp_path / "dead", tiny_model, 2, *base, "opd.teacher.fail_score_calls=[1,2,3,4,5,6]")
    proc = subprocess.run(dead, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "opd teacher failed 3 groups in a row" in said, said[-3000:]


@pytest.mark.slow
@pytest.mark.model
def test_opd_on_smollm2_moves_the_student_to_an_rl_trained_teacher(tmp_path: Path) -> None:
    """OPD on the real SmolLM2 (tests/bandit_support.py). The teacher is an RL-trained SmolLM2: two
    LoRA GRPO steps on the bandit, merged and exported as an HF dir (it answers with a digit ~98% of
    the time, the base ~30%). The student (full weights, the base model) samples through the hf
    engine, the teacher engine scores each group, pure OPD (kl_weight 1, no task reward) trains it
    and the weights are synced back. The exact reverse KL(student || teacher) of the first reply
    token falls at every step and the student's probability of the rewarded reply rises."""
    from miles_env.engines.hf import HFEngine
    from miles_env.trainer.lora import sync_adapter

    bandit = Bandit()

    async def rl_teacher() -> Path:
        rl = TorchTrainer(
            "smollm2", TrainerConfig(lr=1e-3, lora=LoraConfig(rank=8, alpha=16), fused_adamw=False)
        )
        engine = HFEngine(HFEngineConfig(model="smollm2", dtype="float32", seed=0))
        for step in range(2):
            await anyio.to_thread.run_sync(rl.train_step, [await bandit.sample_group(engine, step, seed=7)])
            await sync_adapter(rl, engine, step + 1, tmp_path / "rl-weights")
        await engine.close()
        out = rl.export_weights(tmp_path / "teacher")  # merged: base + adapter, HF-named
        bandit.tokenizer.save_pretrained(str(out))
        return out

    teacher_dir = anyio.run(rl_teacher)
    student = TorchTrainer(
        "smollm2", TrainerConfig(lr=2e-5, opd_kl_weight=1.0, opd_reward_weight=0.0, fused_adamw=False)
    )
    teacher_model = HFEngine(HFEngineConfig(model=str(teacher_dir), dtype="float32"))
    teacher = Teacher(teacher_model)
    t_logp = bandit.first_token_logprobs(teacher_model.model)  # type: ignore[attr-defined]
    assert float(t_logp.exp()[bandit.digits].sum()) > 0.8  # the teacher has learnt the task

    def reverse_kl() -> float:
        s = bandit.first_token_logprobs(student.model)
        return float((s.exp() * (s - t_logp)).sum())

    async def distill() -> tuple[list[float], list[float], list[float]]:
        engine = HFEngine(HFEngineConfig(model="smollm2", dtype="float32", seed=0))
        kls, p, estimates = [reverse_kl()], [bandit.p_rewarded(student.model)], []
        for step in range(3):
            group = await teacher.score_group(await bandit.sample_group(engine, step, seed=0))
            assert group is not None
            estimates.append(opd_metrics(group, 1.0)["opd/reverse_kl"])
            m = await anyio.to_thread.run_sync(student.train_step, [group])
            assert m["samples"] == 16 and m["logprob_diff_max"] < 1e-4, m
            await engine.update_weights_from_disk(student.export_weights(tmp_path / "student"), step + 1)
            kls.append(reverse_kl())
            p.append(bandit.p_rewarded(student.model))
        await engine.close()
        await teacher.close()
        return kls, p, estimates

    kls, p, estimates = anyio.run(distill)
    print(
        f"reverse KL {[round(k, 4) for k in kls]}, P(rewarded) {[round(x, 3) for x in p]}, estimates {estimates}"
    )
    assert all(b < a for a, b in zip(kls, kls[1:], strict=False)) and kls[-1] < kls[0] / 4, kls
    assert p[-1] > p[0] + 0.3, p
    assert estimates[-1] < estimates[0], estimates  # the logged metric reads the same fall
