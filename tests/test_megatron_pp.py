"""Pipeline parallel 2 gives the same step as 1: a gloo world of two CPU processes under torchrun
(the slow test starts it), each stage holding one of the tiny Llama's two layers, run by megatron's
1F1B schedule; the tied embedding lives on both stages. The exported HF weights (gathered over the
stages) must match the single-process run after one step, and the loss of the next step too.

Run by hand: torchrun --nproc_per_node 2 tests/test_megatron_pp.py OUT_DIR MODEL_DIR PP KL_COEF [D [TP [EP [ODD [CP]]]]]
(D=1: megatron's DistributedOptimizer; TP: tensor-parallel size, default 1; EP: expert-parallel size;
ODD=1: megatron_support.odd_groups, 3 microbatches a step, instead of groups' 2; CP: context-parallel
size, GPUs with TransformerEngine only)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file as a script
from tests.megatron_support import assert_same_run, run_torchrun, tiny_model, train_and_record  # noqa: E402

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_pp2_same_step_as_pp1(
    tmp_path: Path, megatron_single: tuple[Path, Path, list[dict[str, float]]], kl: float
) -> None:
    """kl 0.1's one-process run is the session's (conftest `megatron_single`, the same seeded model)."""
    model, pp1, m1 = megatron_single
    if kl != 0.1:
        model, pp1 = tiny_model(tmp_path / "m"), tmp_path / "pp1"
        m1 = run_torchrun(pp1, 1, str(model), "1", str(kl))
    m2 = run_torchrun(tmp_path / "pp2", 2, str(model), "2", str(kl))
    assert m1[0]["samples"] >= 4 and m1[0]["loss_tokens"] > 0
    assert_same_run(pp1, tmp_path / "pp2", m1, m2, lr=1e-3)


if __name__ == "__main__":
    dist_opt, tp = (sys.argv[5:6] or ["0"])[0] == "1", int((sys.argv[6:7] or ["1"])[0])
    ep, odd = int((sys.argv[7:8] or ["1"])[0]), (sys.argv[8:9] or ["0"])[0] == "1"
    cp = int((sys.argv[9:10] or ["1"])[0])
    out, model = Path(sys.argv[1]), Path(sys.argv[2])
    train_and_record(out, model, int(sys.argv[3]), float(sys.argv[4]), dist_opt, tp, ep, odd, cp)
    import torch.distributed as dist

    dist.barrier()  # leave together: a world torn down at exit can abort a rank (gloo's threads)
    dist.destroy_process_group()
