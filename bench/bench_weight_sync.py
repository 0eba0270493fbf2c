"""Delta encode/decode speed: this tree's delta codec against a baseline revision's, same run.

One real RL step (TorchTrainer, SmolLM2-135M, AdamW at the example config's lr) gives the before /
after weights; for each engine dtype both codecs encode the delta (median of --repeat runs) and
decode it; every decoded tensor is checked bit for bit against the trainer's weights cast to that
dtype. The baseline codec is `trainer/weight_delta.py` at --base (git show), or `trainer/weight_sync.py`
for a revision before the codec had its own module; loaded as a module.

    python bench/bench_weight_sync.py [--base 90bae88] [--repeat 3] [--lr 2e-5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def load_baseline(rev: str) -> ModuleType:
    for name in ("weight_delta", "weight_sync"):  # the codec's home since the split, then before it
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:trainer/{name}.py"],
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"--base {rev}: no delta codec there: {shown.stderr.strip()}")
    path = Path(tempfile.mkdtemp()) / "delta_codec_baseline.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("delta_codec_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def one_step(lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from bench_trainer import make_group  # type: ignore[import-not-found]

    from miles_env.trainer.config import TrainerConfig
    from miles_env.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer("smollm2", TrainerConfig(lr=lr))
    before = _clone(trainer.state_dict())
    trainer.train_step([make_group(4, 128, 49152)])
    return before, _clone(trainer.state_dict())


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies that keep tied tensors tied (lm_head = embed_tokens: synced once)."""
    copies: dict[int, torch.Tensor] = {}
    return {k: copies.setdefault(v.data_ptr(), v.detach().clone()) for k, v in state.items()}


def measure(codec: Any, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], repeat: int) -> tuple[float, float, int]:  # fmt: skip
    """(median encode s, decode s, payload bytes); asserts the decode is bit-exact."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        delta = codec.encode_delta(old, new, 0, 1)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = {e.name: codec.decode_entry(e, old[e.name]) for e in delta.entries}
    dec = time.perf_counter() - t0
    for name, want in new.items():
        got = out.get(name, old[name])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}: decode is not exact"
    return statistics.median(times), dec, delta.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="90bae88", help="git revision of the baseline codec")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    args = ap.parse_args()
    from miles_env.trainer import weight_delta, weight_sync

    base = load_baseline(args.base)
    before, after = one_step(args.lr)
    print(f"### delta codec after one RL step (SmolLM2-135M, lr {args.lr}), baseline {args.base}\n")
    print("| engine dtype | full MiB | delta MiB (base / now) | encode s base | encode s now | encode speed-up "
          "| decode s base | decode s now | decode speed-up |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        cast = weight_sync.WeightSyncer(dtype=dtype)._cast
        old, new = cast(before), cast(after)
        full = sum(t.numel() * t.element_size() for t in new.values()) / 2**20
        e0, d0, b0 = measure(base, old, new, args.repeat)
        e1, d1, b1 = measure(weight_delta, old, new, args.repeat)
        print(f"| {str(dtype).removeprefix('torch.')} | {full:.1f} | {b0 / 2**20:.1f} / {b1 / 2**20:.1f} "
              f"| {e0:.2f} | {e1:.2f} | **{e0 / e1:.2f}x** | {d0:.2f} | {d1:.2f} | **{d0 / d1:.2f}x** |")  # fmt: skip


if __name__ == "__main__":
    main()
