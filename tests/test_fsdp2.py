"""FSDP2 on the torch backend (trainer/fsdp.py): 2 gloo CPU ranks under torchrun take the single
process's step on the same groups (data parallel, an odd number of samples, a zero-weight filler
on the short rank), full weights and LoRA; a checkpoint written by 2 ranks resumes on 1 process and
one written by 1 process resumes on 2, each taking the same next step; and `torchrun
--nproc_per_node 2 miles-env train` with trainer.backend=torch runs its zero-KL job end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_env.models import make_tiny_moe
from miles_env.trainer.fsdp import deal
from miles_env.trainer.samples import pack_microbatches
from tests.fsdp_support import METRICS, lone_group, run_torchrun, save_run, steps, trainer
from tests.train_support import rows, train_args
from tests.trainer_support import make_tiny_model


def _same_metrics(a: list[dict[str, float]], b: list[dict[str, float]]) -> None:
    assert len(a) == len(b)
    for ma, mb in zip(a, b, strict=True):
        for key in METRICS + tuple(
            k for k in ("moe_aux_loss", "moe_max_load") if k in ma
        ):  # MoE: summed over ranks
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-6), key


def _same_state(a: Path, b: Path) -> None:
    """Same weights (state.pt) and same logprobs from them (logprobs.pt) in run dirs `a` and `b`."""
    sa, sb = torch.load(a / "state.pt", weights_only=True), torch.load(b / "state.pt", weights_only=True)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e-6, msg=k)
    la, lb = (
        torch.load(a / "logprobs.pt", weights_only=True),
        torch.load(b / "logprobs.pt", weights_only=True),
    )
    assert len(la) == len(lb) == 5
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


def test_deal_gives_every_rank_as_many_microbatches() -> None:
    """samples[rank::world] packed per rank; the short rank is topped up with fillers (None)."""
    lengths = [13, 14, 15, 16, 17]
    assert deal(lengths, 24, pack_microbatches, 0, 2) == [[4], [2], [0]]
    assert deal(lengths, 24, pack_microbatches, 1, 2) == [[3], [1], None]
    assert deal(lengths, 100, pack_microbatches, 1, 2) == [[3, 1]]  # one microbatch each: no filler
    assert deal(lengths, 24, pack_microbatches, 3, 4) == [[3], None]
    assert deal([], 24, pack_microbatches, 1, 2) == []


@pytest.mark.parametrize("lora", [0, 1, 2], ids=["full", "lora", "moe-lora-experts"])
def test_two_ranks_take_the_single_process_step_and_resume_across_world_sizes(
    tmp_path: Path, lora: int
) -> None:
    """lora 2: a tiny Qwen3-MoE (miles_env.models.make_tiny_moe) with LoRA on its attention and its
    fused experts (PEFT target_parameters; the load-balancing loss in the step)."""
    if lora == 2:
        model = make_tiny_moe(tmp_path / "model", tokenizer=None)
    else:
        model = make_tiny_model(tmp_path / "model")
    one = trainer(model, lora)  # the single process, in this one
    save_run(one, tmp_path / "one", steps(one, 2, tmp_path / "one_ckpt"))
    run_torchrun(tmp_path / "two", 2, str(model), str(int(lora)), str(tmp_path / "one_ckpt"))
    one_m = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = tmp_path / "two"
    # (a) the same 2 steps: metrics reduced over ranks, weights (merged, with LoRA) equal
    _same_metrics(one_m, json.loads((two / "fresh" / "metrics.json").read_text()))
    _same_state(tmp_path / "one", two / "fresh")
    # (a) one sample: rank 1 trains nothing of its own, yet takes part (a zero-weight filler)
    save_run(one, tmp_path / "one_lone", [one.train_step(lone_group())])
    assert json.loads((tmp_path / "one_lone" / "metrics.json").read_text())[0]["samples"] == 1
    _same_metrics(
        *(json.loads((d / "metrics.json").read_text()) for d in (tmp_path / "one_lone", two / "lone"))
    )
    _same_state(tmp_path / "one_lone", two / "lone")
    # the checkpoints have one format: the same keys, the same tensors
    ca = torch.load(next((tmp_path / "one_ckpt").glob("step_*")) / "state.pt", weights_only=False)
    cb = torch.load(next((two / "ckpt").glob("step_*")) / "state.pt", weights_only=False)
    assert sorted(ca) == sorted(cb) and sorted(ca["optimizer"]["state"]) == sorted(cb["optimizer"]["state"])
    assert ("adapter" in cb) == bool(lora)
    # (b) 1 -> 2: the single process's checkpoint, resumed on 2 ranks, takes the same step 2
    _same_metrics(one_m[1:], json.loads((two / "resumed" / "metrics.json").read_text()))
    _same_state(tmp_path / "one", two / "resumed")
    # (b) 2 -> 1: the 2 ranks' checkpoint, resumed here, takes the same step 2
    back = trainer(model, lora)
    assert back.load_checkpoint(two / "ckpt") == {"step": 1}
    save_run(back, tmp_path / "back", steps(back, 1))
    _same_metrics(one_m[1:], json.loads((tmp_path / "back" / "metrics.json").read_text()))
    _same_state(tmp_path / "one", tmp_path / "back")
    if lora:  # the sharded adapter export is the single process's, file for file
        from safetensors.torch import load_file

        a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
        b = load_file(str(two / "fresh" / "adapter" / "adapter_model.safetensors"))
        assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.parametrize("extra", [[], ["trainer.lora.rank=4"]], ids=["full", "lora"])
def test_torchrun_train_with_the_torch_backend(tmp_path: Path, tiny_model: Path, extra: list[str]) -> None:
    """Rank 0 runs the job and its engine; both ranks hold half the model. The engine samples
    what the sharded trainer computes (zero KL), through full or adapter weight syncs."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 2, "trainer.backend=torch", "eval.enabled=false", *extra)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.run([*torchrun, "-m", *args[2:]], stdout=f, stderr=subprocess.STDOUT, timeout=600)
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    assert "rank 1: made" in out, out[-3000:]  # the follower made rank 0's calls and stopped
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["samples"] >= 1
        assert r["logprob_diff_mean"] < 1e-4  # the 2-rank trainer recomputes the engine's logprobs
    if not extra:  # a full sync counts every weight once, though rank 0 holds half of each
        from safetensors import safe_open

        with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
            size = sum(f.get_tensor(k).nbytes for k in f.keys())  # tied lm_head is not stored
        assert [r["sync_bytes"] for r in train] == [size, size]
    assert (run_dir / "summary.json").is_file()
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000001", "step_00000002"]
    state = torch.load(ckpts[-1] / "state.pt", weights_only=False)
    assert ("adapter" in state) == bool(extra) and ("model" in state) != bool(extra)
