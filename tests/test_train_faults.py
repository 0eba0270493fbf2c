"""A fault-injected training run trains exactly what the same episodes give with the failed ones removed.

The one end-to-end test of INVARIANTS.md's "an infrastructure failure never trains" and "a token
the agent never received never trains" (why it is end to end: only a real run has every fault
land where it lands, under the real loop, queue, proxy and trainer). `miles-env train`'s job, in
process, on the tiny random Llama (real hf engine, TITO proxy, local sandboxes, SQLite queue,
torch trainer), 2 sync steps of 2 groups of 4, with `faults:` (miles_env/faults.py) making 25%
of sandbox creations fail, the engine restart (calls in flight and for 3 s after fail), and its
3rd call stall past the harness's request timeout (8 s: generous, so a loaded machine's slow
turns are not timeouts too) so its client retries (the held sampling is never delivered); the environment double's verifier crashes on every 6th episode
(tests/faults_support.py). Then, from the run directory alone:
- the faults happened and were classed (ends/* rates, re-rolls, the audit's undelivered turns);
- every step is replayed from the checkpoint before it: training its leased groups as they were
  (failures inside) gives the run's checkpoint bit for bit, and training the same groups with
  their infrastructure failures removed gives the same weights bit for bit;
- no trained sample has mask 1 on a turn the agent did not receive.
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import torch
from rich.console import Console

from miles_env.config import RunConfig, load_config
from miles_env.job.plan import build_job_trainer
from miles_env.job.run import run_training
from miles_env.queue.codec import decode_episode
from miles_env.tito.audit import audit
from miles_env.trainer.checkpoint import read_checkpoint
from miles_env.types import Episode, Reward
from tests.train_support import ROOT, rows


def _config(run_dir: Path, model: Path) -> RunConfig:
    sets = [
        f"run_dir={run_dir}", f"engine.model={model}", "env=tests.faults_support:FlakyBasics",
        "trainer.steps=2", "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.concurrency=8",
        "rollout.min_valid=2", "rollout.reroll_attempts=2", "harness.max_tokens=8", "harness.max_turns=1",
        "harness.retries=1", "harness.request_timeout_s=8.0", "eval.enabled=false", "trainer.lr=1e-2",
        "trainer.skip_zero_advantage=false", "trainer.keep_checkpoints=100",
        "faults.sandbox_create=0.25", "faults.seed=3", "faults.restart_at=[6]", "faults.down_s=3.0",
        "faults.stall_at=[3]", "faults.stall_s=10.0",
    ]  # fmt: skip
    return load_config(ROOT / "examples/terminal-cpu.yaml", sets)


def _steps(run_dir: Path) -> list[list[list[Episode]]]:
    """Each step's leased groups, in lease order, rebuilt from its checkpoint's trained ids and the
    queue's stored bytes (what `take` handed the trainer)."""
    conn = sqlite3.connect(run_dir / "queue.db")
    stored = {
        eid: decode_episode(m, b) for eid, m, b in conn.execute("SELECT id, meta, arrays FROM episodes")
    }
    out = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        groups: list[list[Episode]] = []
        for eid in json.loads((ckpt / "trainer.json").read_text())["extra"]["trained_episode_ids"]:
            ep = stored[eid]
            if not groups or groups[-1][0].group_id != ep.group_id:
                groups.append([])
            groups[-1].append(ep)
        out.append(groups)
    return out


def _after(cfg: RunConfig, model: Path, start: Path | None, groups: list[list[Episode]]) -> dict[str, Any]:
    trainer = build_job_trainer(cfg, model)
    if start is not None:
        trainer.load_checkpoint(start)
    trainer.train_step(groups)
    return {k: v.detach().clone() for k, v in trainer.state_dict().items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fault_injected_run_trains_what_the_clean_episodes_give(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, tiny_model)
    out = io.StringIO()
    anyio.run(run_training, cfg, Console(file=out, width=400))

    train = rows(run_dir, "train")
    assert len(train) == 2
    total = {k: sum(r.get(k, 0.0) for r in train) for k in train[0] if isinstance(train[0][k], float)}
    assert total["ends/sandbox_start"] > 0 and total["ends/verifier_error"] > 0, total
    assert total["ends/engine_error"] > 0, total  # the restart: in flight and retried into it
    assert total["episodes_excluded"] + total["episodes_rerolled"] > 0
    assert all(0 < r["wasted_rollout_share"] < 1 for r in train)
    signal = json.loads((run_dir / "summary.json").read_text())["signal"]  # the run summary's classes
    assert signal["infra_failures"] > 0 and signal["ends"]["completed"] > 0, signal
    ends = ", ".join(f"{k} {n}" for k, n in signal["ends"].items())  # the line the run ends with
    line = f"episodes by end: {ends}; infrastructure failures never trained: {signal['infra_failures']} ("
    assert line in out.getvalue()
    report = audit(run_dir)
    assert report.ok, report.drifts[:3]
    assert report.undelivered > 0  # the stalled calls: sampled, kept, never delivered

    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    for i, groups in enumerate(_steps(run_dir)):
        start = ckpts[i - 1] if i else None
        ran = read_checkpoint(ckpts[i])[0]["model"]
        faulty = _after(cfg, tiny_model, start, groups)
        clean = _after(cfg, tiny_model, start, [[e for e in g if e.end.policy] for g in groups])
        assert _equal(faulty, ran), f"step {i + 1}: the replay is not the run"
        assert _equal(faulty, clean), f"step {i + 1}: the failures changed what trained"
        for ep in (e for g in groups for e in g):
            for s in ep.samples:
                for t in s.turns:
                    if not t.delivered:
                        assert not any(s.loss_mask[t.start : t.start + t.completion_len])
    # Not vacuous: the replay trains. The run's own steps may hold only all-equal coins (a CI run here
    # had step 1 so, under load: it trained nothing, rightly), so one of its groups with its coins
    # set to differ must move the weights.
    group = max((g for step in _steps(run_dir) for g in step), key=lambda g: sum(e.end.policy for e in g))
    forced, ranked = [], 0
    for ep in group:
        if ep.end.policy:
            ep = ep.model_copy(update={"reward": Reward(score=1.0 if ranked == 0 else 0.0)})
            ranked += 1
        forced.append(ep)
    assert ranked >= 2, group
    assert not _equal(_after(cfg, tiny_model, None, [forced]), _after(cfg, tiny_model, None, []))
