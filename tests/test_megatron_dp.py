"""Data parallel 2 gives the same step as 1: two gloo CPU processes under torchrun, each running half
of the step's microbatches (the worker of test_megatron_pp with pp=1, so dp = world size), grads
summed over the replicas; and pp=2 x dp=2 on four processes. The exported weights after one step,
the gathered weights after two, and the losses must match the single-process run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_megatron_pp import assert_same_run, run_torchrun  # type: ignore[import-not-found]  # noqa: E402

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "pp"), [(2, 1), (4, 2)])
def test_dp_same_step_as_single_process(tmp_path: Path, nproc: int, pp: int) -> None:
    import test_megatron_pp  # type: ignore[import-not-found]
    from test_megatron import tiny_model  # type: ignore[import-not-found]

    model = tiny_model(tmp_path / "m")
    script = test_megatron_pp.__file__
    one = run_torchrun(tmp_path / "one", 1, str(model), "1", "0.1", script=script)
    many = run_torchrun(tmp_path / "many", nproc, str(model), str(pp), "0.1", script=script)
    assert_same_run(tmp_path / "one", tmp_path / "many", one, many, lr=1e-3)
