"""`miles-env train` with trainer.backend=megatron and delta weight sync, end to end on the tiny
random Llama of the e2e tests (real engine, proxy, sandboxes, queue): the megatron trainer
reproduces the engine's logprobs (zero-KL check) and every sync after the first is a delta the
engine accepts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.train_support import rows, train_args

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["delta", "delta_disk"])
def test_train_megatron_backend_with_delta_sync(tmp_path: Path, tiny_model: Path, sync: str) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_model, 2, "trainer.backend=megatron", f"weight_sync={sync}",
                      "trainer.skip_zero_advantage=false", "eval.enabled=false")  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = rows(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["samples"] >= 4
        assert r["logprob_diff_mean"] < 1e-4  # the megatron trainer recomputes the engine's logprobs
        assert (r["sync_delta"], r["sync_repaired"]) == (1.0, 0.0)
        assert 0 <= r["sync_bytes"] <= r["sync_full_bytes"]  # 0 when every advantage was 0
    ckpt = json.loads(
        sorted((run_dir / "checkpoints").glob("step_*"))[-1].joinpath("trainer.json").read_text()
    )
    assert ckpt["step"] == 2 and ckpt["backend"] == "megatron"
