"""Data parallel 2 gives the same step as 1: two gloo CPU processes under torchrun, each running half
of the step's microbatches (the worker of test_megatron_pp with pp=1, so dp = world size), grads
summed over the replicas; pp=2 x dp=2 and pp=2 x tp=2 on four processes; tp=2 on two. With plain grad all-reduce + a
full AdamW per replica, and with megatron's DDP + DistributedOptimizer (grads reduce-scattered,
each rank holding half of Adam's state). The exported weights after one step, the gathered weights
after two, and the losses must match the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron_support import PP_WORKER, assert_same_run, run_torchrun

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "pp", "tp", "dist_opt"),
    [(2, 1, 1, False), (2, 1, 1, True), (4, 2, 1, False), (4, 2, 1, True), (4, 2, 2, False), (4, 2, 2, True),
     (2, 1, 2, False)],
)  # fmt: skip
def test_dp_same_step_as_single_process(
    tmp_path: Path,
    megatron_single: tuple[Path, Path, list[dict[str, float]]],
    nproc: int,
    pp: int,
    tp: int,
    dist_opt: bool,
) -> None:
    """(4, 2, 2) is tp=2 x pp=2 on four ranks (every axis at once but dp); (2, 1, 2) is tensor parallel
    alone (it replaced test_megatron_tp.py's tp2-vs-tp1 run). The one-process run
    is the session's (conftest `megatron_single`: the same seeded model, pp 1, kl 0.1)."""
    model, one_dir, one = megatron_single
    script = str(PP_WORKER)
    many = run_torchrun(
        tmp_path / "many", nproc, str(model), str(pp), "0.1", str(int(dist_opt)), str(tp), script=script
    )
    assert_same_run(one_dir, tmp_path / "many", one, many, lr=1e-3)
    if dist_opt and nproc == 2 and tp == 1:  # rank 0 steps about half of the parameters (buckets are padded)
        assert 0.4 < many[1]["adam_numel"] / one[1]["adam_numel"] < 0.6
    elif nproc == 2 and tp == 1:
        assert many[1]["adam_numel"] == one[1]["adam_numel"]
