"""Expert parallel 2 takes the single process's step: a tiny random Qwen3-MoE (4 experts) under
torchrun on two gloo CPU processes, each holding 2 of every layer's experts (and a data-parallel copy
of the rest), megatron-core's all-gather token dispatcher moving tokens to their experts, against the
same run in one process (in this one).

A step of 3 microbatches: rank 0 runs 2, rank 1 runs 1 and a zero-weight filler (every MoE forward
is a collective over the ep ranks) on microbatches padded to one shape (the all-gather dispatcher's
need). With a KL reference model. The losses (the load-balancing term included), the grad norm, the
exported HF weights after one step, the gathered weights after two, the logprobs, and a resume from
the per-ep-rank checkpoints must match. The one end-to-end test of expert parallelism (~40 s: two
processes importing megatron-core on a shared 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_env.models import make_tiny_moe
from tests.megatron_support import assert_same_run, run_torchrun, train_and_record

pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_ep2_takes_the_single_process_step(tmp_path: Path) -> None:
    import json

    model = make_tiny_moe(tmp_path / "m", tokenizer=None)
    train_and_record(tmp_path / "one", model, 1, 0.1, odd=True)  # pp=1, kl=0.1, this process
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    #                                                       pp  kl   D    TP   EP   ODD
    two = run_torchrun(tmp_path / "two", 2, str(model), "1", "0.1", "0", "1", "2", "1")
    assert one[0]["samples"] == 5 and one[0]["moe_aux_loss"] > 1.0
    for key in ("moe_aux_loss", "moe_max_load"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-6), key
    assert_same_run(tmp_path / "one", tmp_path / "two", one, two, lr=1e-3)
    # each ep rank checkpointed its own two experts of every layer
    import torch

    for rank in (0, 1):
        (step,) = sorted((tmp_path / "two" / "ckpt" / f"tp0_pp0_ep{rank}").glob("step_*"))
        names = torch.load(step / "state.pt", weights_only=False)["model"]
        experts = {n for n in names if ".local_experts." in n and n.endswith("linear_fc1.weight")}
        assert len(experts) == 2 * 2  # 2 local experts x 2 layers
