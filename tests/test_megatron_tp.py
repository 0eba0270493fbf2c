"""Tensor parallel 2 gives the same loss as 1: a gloo world of two CPU processes under torchrun
(the slow test starts it), each holding half of every sharded tensor of a tiny Llama.

Run by hand: torchrun --nproc_per_node 2 tests/test_megatron_tp.py OUT.json MODEL_DIR"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _worker(out: Path, model_dir: Path) -> None:
    from miles_env.trainer.megatron.backend import MegatronTrainer, MegatronTrainerConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by torchrun as a script
    from tests.megatron_support import groups

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = MegatronTrainer(model_dir, MegatronTrainerConfig(tp=tp, lr=1e-3, fused_adamw=False))
    m1 = trainer.train_step(groups())
    m2 = trainer.train_step(groups(seed=1))
    state = trainer.state_dict()
    if int(os.environ.get("RANK", "0")) == 0:
        checksum = float(sum(v.double().sum() for v in state.values()))
        out.write_text(json.dumps({"loss1": m1["loss"], "loss2": m2["loss"], "grad_norm": m1["grad_norm"],
                                   "weights_sum": checksum}))  # fmt: skip


@pytest.mark.slow
def test_tp2_same_loss_as_tp1(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from tests.megatron_support import tiny_model

    model = tiny_model(tmp_path / "m")
    results = {}
    for n in (1, 2):
        out = tmp_path / f"tp{n}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(29400 + n),
               __file__, str(out), str(model)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[n] = json.loads(out.read_text())
    one, two = results[1], results[2]
    assert two["loss1"] == pytest.approx(one["loss1"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert two["loss2"] == pytest.approx(one["loss2"], rel=1e-3, abs=1e-6)  # after a TP=2 optimizer step
    assert two["weights_sum"] == pytest.approx(one["weights_sum"], rel=1e-5)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
    import torch.distributed as dist

    dist.barrier()  # leave together: a world torn down at exit can abort a rank (gloo's threads)
    dist.destroy_process_group()
