"""What a training run leaves behind: metrics.jsonl, TensorBoard events, a reward-curve PNG.

One `RunLog` per run directory. Each `log(step, metrics)` appends one JSON line
(durable, append-only, the source of truth; strict JSON, a NaN metric is null), mirrors scalars to TensorBoard,
and redraws `reward_curve.png` from the JSONL, so the picture always matches
the numbers. Resuming a run appends to the same files.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from miles_env.jsonio import dumps

__all__ = ["RunLog", "read_metrics", "plot_rewards"]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train" and "reward_mean" in r]
    evals = [r for r in rows if r.get("kind") == "eval" and "pass_rate" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(
            [r["step"] for r in train], [r["reward_mean"] for r in train], "o-", label="train reward (mean)"
        )
    if evals:
        ax.plot([r["step"] for r in evals], [r["pass_rate"] for r in evals], "s--", label="eval pass rate")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)


class RunLog:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.png = run_dir / "reward_curve.png"
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional; metrics.jsonl is the record
                self._tb = None

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        row = {"step": step, "kind": kind, "time": time.time(), **metrics}
        with self.path.open("a") as fh:
            fh.write(dumps(row, default=float) + "\n")  # strict: NaN/Infinity -> null
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        plot_rewards(read_metrics(self.path), self.png)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
