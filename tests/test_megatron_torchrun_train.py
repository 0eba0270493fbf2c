"""`torchrun --nproc_per_node 2 miles-env train` with the megatron backend (tp=2, and dp=2):
rank 0 runs the job, rank 1 repeats its trainer calls (trainer/ranks.py). The trainer still
reproduces the engine's logprobs, so the sharded model is the engine's model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.train_support import rows, train_args

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["trainer.tp=2", "trainer.distributed_optimizer=true"])
def test_train_under_torchrun_two_ranks(tmp_path: Path, tiny_model: Path, layout: str) -> None:
    import subprocess

    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 2, "trainer.backend=megatron", layout, "eval.enabled=false")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = [*torchrun, "-m", *args[2:]]  # args = [python, -m, miles_env.cli.main, train, ...]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "rank 1: made" in proc.stdout, out  # the follower made rank 0's calls and stopped
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["samples"] >= 4
        assert r["logprob_diff_mean"] < 1e-4  # the 2-process trainer recomputes the engine's logprobs
    assert (run_dir / "summary.json").is_file()
