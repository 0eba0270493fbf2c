"""Data parallel 2 gives the same step as 1: two gloo CPU processes under torchrun, each running half
of the step's microbatches (the worker of test_megatron_pp with pp=1, so dp = world size), grads
summed over the replicas; and pp=2 x dp=2 on four processes. Both with plain grad all-reduce + a
full AdamW per replica, and with megatron's DDP + DistributedOptimizer (grads reduce-scattered,
each rank holding half of Adam's state). The exported weights after one step, the gathered weights
after two, and the losses must match the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron_support import PP_WORKER, assert_same_run, run_torchrun, tiny_model

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", [False, True])
@pytest.mark.parametrize(("nproc", "pp", "tp"), [(2, 1, 1), (4, 2, 1), (4, 2, 2)])
def test_dp_same_step_as_single_process(tmp_path: Path, nproc: int, pp: int, tp: int, dist_opt: bool) -> None:
    """(4, 2, 2) is tp=2 x pp=2 without data parallel: every axis at once but dp."""
    model = tiny_model(tmp_path / "m")
    script = str(PP_WORKER)
    one = run_torchrun(tmp_path / "one", 1, str(model), "1", "0.1", script=script)
    many = run_torchrun(
        tmp_path / "many", nproc, str(model), str(pp), "0.1", str(int(dist_opt)), script=script
    )
    assert_same_run(tmp_path / "one", tmp_path / "many", one, many, lr=1e-3)
    if dist_opt and nproc == 2:  # rank 0 steps about half of the parameters (buckets are padded)
        assert 0.4 < many[1]["adam_numel"] / one[1]["adam_numel"] < 0.6
    elif nproc == 2:
        assert many[1]["adam_numel"] == one[1]["adam_numel"]
