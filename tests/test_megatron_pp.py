"""Pipeline parallel 2 gives the same step as 1: a gloo world of two CPU processes under torchrun
(the slow test starts it), each stage holding one of the tiny Llama's two layers, run by megatron's
1F1B schedule; the tied embedding lives on both stages. The exported HF weights (gathered over the
stages) must match the single-process run after one step, and the loss of the next step too.

Run by hand: torchrun --nproc_per_node 2 tests/test_megatron_pp.py OUT_DIR MODEL_DIR PP KL_COEF [D [TP [EP [ODD]]]]
(D=1: megatron's DistributedOptimizer; TP: tensor-parallel size, default 1; EP: expert-parallel size;
ODD=1: megatron_support.odd_groups, 3 microbatches a step, instead of groups' 2)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file as a script
from tests.megatron_support import assert_same_run, groups, odd_groups, run_torchrun, tiny_model  # noqa: E402

pytest.importorskip("megatron.core")


def _worker(
    out: Path,
    model_dir: Path,
    pp: int,
    kl: float,
    dist_opt: bool = False,
    tp: int = 1,
    ep: int = 1,
    odd: bool = False,
) -> None:
    import torch

    from miles_env.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    cfg = MegatronTrainerConfig(tp=tp, pp=pp, ep=ep, lr=1e-3, fused_adamw=False, kl_coef=kl, max_tokens_per_microbatch=40,
                                distributed_optimizer=dist_opt)  # fmt: skip
    batch = odd_groups if odd else groups
    trainer = MegatronTrainer(model_dir, cfg)
    m1 = trainer.train_step(batch())
    trainer.export_weights(out / "export")
    trainer.save_checkpoint(out / "ckpt")  # one dir per (tp, pp) rank, written by dp rank 0
    m2 = trainer.train_step(batch(seed=1))
    samples = [e.samples[0] for g in batch(seed=2) for e in g]
    logps = trainer.logprobs(samples)  # forward-only through the pipeline, on every rank
    m2["logprobs_sum"] = float(sum(t.double().sum() for t in logps))
    m2["logprobs_len"] = float(sum(t.numel() for t in logps))
    m2["adam_numel"] = float(_adam_state_numel(trainer.optimizer))
    state = trainer.state_dict()  # collective: every rank gathers
    # a resumed trainer (weights and Adam state, sharded or not) takes the very same second step
    resumed = MegatronTrainer(model_dir, cfg)
    resumed.load_checkpoint(out / "ckpt")
    m2["resumed_loss"] = resumed.train_step(batch(seed=1))["loss"]
    again = resumed.state_dict()
    m2["resumed_max_diff"] = max(float((again[k] - v).abs().max()) for k, v in state.items())
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(state, out / "state.pt")
        (out / "metrics.json").write_text(json.dumps([m1, m2]))


def _adam_state_numel(optimizer: Any) -> int:
    """Elements of AdamW's first moment held by this rank (megatron's optimizers wrap torch's)."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        base = getattr(opt, "optimizer", opt)
        total += sum(s["exp_avg"].numel() for s in base.state.values() if "exp_avg" in s)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_pp2_same_step_as_pp1(tmp_path: Path, kl: float) -> None:
    model = tiny_model(tmp_path / "m")
    m1 = run_torchrun(tmp_path / "pp1", 1, str(model), "1", str(kl))
    m2 = run_torchrun(tmp_path / "pp2", 2, str(model), "2", str(kl))
    assert m1[0]["samples"] >= 4 and m1[0]["loss_tokens"] > 0
    assert_same_run(tmp_path / "pp1", tmp_path / "pp2", m1, m2, lr=1e-3)


if __name__ == "__main__":
    dist_opt, tp = (sys.argv[5:6] or ["0"])[0] == "1", int((sys.argv[6:7] or ["1"])[0])
    ep, odd = int((sys.argv[7:8] or ["1"])[0]), (sys.argv[8:9] or ["0"])[0] == "1"
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), dist_opt, tp, ep, odd)
    import torch.distributed as dist

    dist.barrier()  # leave together: a world torn down at exit can abort a rank (gloo's threads)
    dist.destroy_process_group()
