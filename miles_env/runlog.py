"""What a training run leaves behind: metrics.jsonl, TensorBoard events, a reward-curve PNG, and
optionally a Weights & Biases run.

One `RunLog` per run directory. Each `log(step, metrics)` appends one JSON line
(durable, append-only, the source of truth; strict JSON, a NaN metric is null), mirrors scalars to
TensorBoard and, with `logging.wandb: true`, the same scalars to W&B (`kind/key` at `step`; online or
offline, files under RUN_DIR/wandb), and redraws `reward_curve.png` from the JSONL, so the picture
always matches the numbers. Resuming a run appends to the same files and resumes the same W&B run
(its id is kept in RUN_DIR/wandb-run-id). `miles-env view RUN_DIR` reads metrics.jsonl live.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from miles_env.jsonio import dumps

__all__ = ["RunLog", "LoggingConfig", "read_metrics", "plot_rewards"]


class LoggingConfig(BaseModel):
    """The run config's `logging` section: where metrics go besides metrics.jsonl (always written)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "miles-env"
    wandb_mode: Literal["online", "offline"] | None = None  # None: wandb's own (WANDB_MODE, login)


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


def _finite_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _start_wandb(run_dir: Path, cfg: LoggingConfig) -> Any:
    import wandb

    id_file = run_dir / "wandb-run-id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=cfg.wandb_project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=cfg.wandb_mode,
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )


class RunLog:
    def __init__(
        self, run_dir: Path, *, tensorboard: bool = True, config: LoggingConfig | None = None
    ) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.png = run_dir / "reward_curve.png"
        cfg = config or LoggingConfig(tensorboard=tensorboard)
        self._tb: Any = None
        self._wandb: Any = _start_wandb(run_dir, cfg) if cfg.wandb else None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional; metrics.jsonl is the record
                self._tb = None

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        row = {"step": step, "kind": kind, "time": time.time(), **metrics}
        with self.path.open("a") as fh:
            fh.write(dumps(row, default=float) + "\n")  # strict: NaN/Infinity -> null
        scalars = _finite_scalars(metrics)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=int(step))
        plot_rewards(read_metrics(self.path), self.png)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
