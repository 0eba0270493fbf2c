"""A synthetic run directory for the viewer's tests and benchmark, written by the real writers.

`make_run(root, episodes=N, tokens=T)` lays out what `miles-env train` leaves: config.yaml,
metrics.jsonl (one train row per step, eval rows every 4 steps), queue.db (the real
SqliteReplayQueue's `put`, one GRPO group of `group_size` per task), eval_episodes.jsonl and one
checkpoint per step whose `trained_episode_ids` name the episodes that step trained. Episodes are
multi-turn (prompt, sampled, tool result, sampled), so masks, turns and weight versions vary.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from miles_env.jsonio import dumps
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.types import Episode, EpisodeEnd, Reward, Status, Trajectory, Turn

__all__ = ["make_run", "make_episode", "chromium_path", "STATUSES"]

ROOT = Path(__file__).resolve().parents[1]

STATUSES = (Status.COMPLETED, Status.COMPLETED, Status.COMPLETED, Status.TRUNCATED, Status.FAILED)
ENDS = (
    EpisodeEnd.COMPLETED,
    EpisodeEnd.COMPLETED,
    EpisodeEnd.COMPLETED,
    EpisodeEnd.TRUNCATED,
    EpisodeEnd.VERIFIER_ERROR,
)


def make_episode(i: int, tokens: int, group_size: int, rng: random.Random, version: int) -> Episode:
    """Episode `i`: two turns; mask 1 on the two sampled runs (tokens // 4 each)."""
    q = tokens // 4
    mask = [0] * q + [1] * q + [0] * q + [1] * (tokens - 3 * q)
    ids = [rng.randrange(49152) for _ in range(tokens)]
    lps = [0.0 if m == 0 else -rng.random() * 4 for m in mask]
    turns = [
        Turn(start=q, prompt_len=q, completion_len=q, finish_reason="tool_calls", weight_version=version),
        Turn(start=3 * q, prompt_len=3 * q, completion_len=tokens - 3 * q, finish_reason="stop", weight_version=version),
    ]  # fmt: skip
    sample = Trajectory.model_construct(token_ids=ids, loss_mask=mask, logprobs=lps, turns=turns, branch=0)
    g = i // group_size
    transcript = [
        {"role": "system", "content": "You are a Linux shell assistant."},
        {"role": "user", "content": f"Task {g}: write the word {g} into answer.txt"},
        {"role": "assistant", "content": f"```sh\necho {g} > answer.txt\n```"},
        {"role": "user", "content": "Exit code: 0\nOutput:\n(none)"},
        {"role": "assistant", "content": "DONE"},
    ]
    return Episode.model_construct(
        id=f"ep{i:06d}", task_id=f"task-{g % 97}", env="synthetic", group_id=f"task-{g % 97}:g{g:05d}",
        split="train", harness="builtin", status=STATUSES[i % len(STATUSES)], end=ENDS[i % len(ENDS)],
        reward=Reward(score=float(rng.random() < 0.4), details={"checks": [{"kind": "file_equals", "target": "answer.txt", "passed": True}]}),
        samples=[sample], error=None, timings={"total_s": rng.random() * 30},
        metadata={"session_id": f"s{i:06d}", "harness": {"commands": 1}, "transcript": transcript},
    )  # fmt: skip


def make_run(
    root: Path, *, episodes: int, tokens: int, group_size: int = 8, groups_per_step: int = 4
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    steps = max(1, -(-episodes // (group_size * groups_per_step)))
    cfg = {"run_dir": str(root), "env": "synthetic", "engine": {"kind": "scripted", "model": "smollm2"},
           "trainer": {"steps": steps, "advantage": "grpo"}, "rollout": {"group_size": group_size}}  # fmt: skip
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    rng = random.Random(0)
    queue = SqliteReplayQueue(
        root / "queue.db", group_size=group_size, max_pending_groups=1 << 30, synchronous="OFF"
    )
    per_step = group_size * groups_per_step
    t0 = time.time() - steps * 10
    with (root / "metrics.jsonl").open("w") as metrics:
        for step in range(1, steps + 1):
            ids = []
            for i in range((step - 1) * per_step, min(episodes, step * per_step)):
                ep = make_episode(i, tokens, group_size, rng, step - 1)
                queue.put(ep)
                ids.append(ep.id)
            ckpt = root / "checkpoints" / f"step_{step:08d}"
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "trainer.json").write_text(
                json.dumps({"step": step, "extra": {"trained_episode_ids": ids}})
            )
            row = {"step": step, "kind": "train", "time": t0 + step * 10, "reward_mean": min(1.0, 0.2 + step / steps / 2),
                   "pass_rate": min(1.0, 0.1 + step / steps / 2), "logprob_diff_mean": 1e-7 * (1 + rng.random()),
                   "logprob_diff_max": 1e-6, "staleness_mean": 0.5 * rng.random(), "clip_frac": 0.01 * rng.random(),
                   "tokens_per_s": 900 + 100 * rng.random(), "step_time_s": 8 + rng.random(), "rollout_s": 5.0,
                   "sync_s": 0.2, "train_s": 3.0, "loss": 0.1 * rng.random()}  # fmt: skip
            metrics.write(dumps(row) + "\n")
            if step % 4 == 0 or step == 1:
                ev = {
                    "step": step,
                    "kind": "eval",
                    "time": t0 + step * 10 + 1,
                    "pass_rate": min(1.0, step / steps),
                    "reward_mean": step / steps,
                }
                metrics.write(dumps(ev) + "\n")
    queue.close()
    return root


def chromium_path() -> str | None:
    """Debian's chromium (scripts/install-chromium.sh installs it when missing and root may)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts/install-chromium.sh")], capture_output=True, text=True
        )
        lines = proc.stdout.strip().splitlines()
        found = lines[-1] if proc.returncode == 0 and lines else None
    return found
