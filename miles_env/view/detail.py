"""One episode in full, one GRPO group side by side: what the episode and group pages show.

An episode is read from where its row says (index.py): the replay queue (decoded with
queue/codec.py, the same bytes the trainer took), a JSONL line (eval), or the store alone (a proxy
session: no transcript, no reward). Its samples are the exported trajectories; the token payload of
one sample is its ids, loss mask and logprobs as stored, with display pieces from the tokenizer
(tokens.py), the turn boundaries and weight versions, and the audit's drift positions.

Group advantages are the trainer's formula (trainer/losses.py `group_advantages`), recomputed in
plain Python from the rewards: grpo (r - mean) / (std + 1e-6), std unbiased; dr_grpo r - mean;
over the members that ended by the policy (`trainer.policy_ends`, default types.POLICY_ENDS), as
trainer/groups.py does: an infrastructure failure shows no advantage (None) and moves no baseline.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from miles_env.errors import MilesEnvError
from miles_env.queue.codec import decode_episode
from miles_env.types import POLICY_ENDS
from miles_env.view.commands import commands_from_transcript
from miles_env.view.decoded import commands_from_turns, decoded_turns
from miles_env.view.index import EpisodeIndex, Row
from miles_env.view.layout import Layout, connect_ro
from miles_env.view.sessions import session_drift, session_samples
from miles_env.view.tokens import Pieces

__all__ = ["NotFound", "Details", "advantages"]


class NotFound(MilesEnvError):
    """No episode or group by that id in this directory."""


def advantages(rewards: list[float], kind: str = "grpo", eps: float = 1e-6) -> list[float]:
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if kind == "dr_grpo":
        return centred
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return [c / (std + eps) for c in centred]


def _sample_summary(s: dict[str, Any]) -> dict[str, Any]:
    mask = s["loss_mask"]
    return {
        "branch": s.get("branch", 0),
        "tokens": len(mask),
        "masked": int(sum(mask)),
        "turns": len(s.get("turns", [])),
        "versions": sorted({int(t.get("weight_version", 0)) for t in s.get("turns", [])}),
    }


class Details:
    def __init__(self, layout: Layout, index: EpisodeIndex, pieces: Pieces) -> None:
        self.layout, self.index, self.pieces = layout, index, pieces
        self._cache: dict[str, dict[str, Any]] = {}  # episode id -> full episode (as JSON data)

    def _row(self, episode_id: str) -> Row:
        row = self.index.by_id.get(episode_id)
        if row is None:
            self.index.refresh()
            row = self.index.by_id.get(episode_id)
        if row is None:
            raise NotFound(f"episode {episode_id!r}: not in {self.layout.root}")
        return row

    def load(self, episode_id: str) -> dict[str, Any]:
        """The episode as JSON data with `samples` (token arrays as lists)."""
        if (hit := self._cache.get(episode_id)) is not None:
            return hit
        row = self._row(episode_id)
        if row.source == "queue":
            conn = connect_ro(self.layout.queue)
            try:
                meta, blob = conn.execute(
                    "SELECT meta, arrays FROM episodes WHERE id=?", (row.id,)
                ).fetchone()
            finally:
                conn.close()
            ep = decode_episode(meta, blob)
            data = ep.model_dump(mode="python")
        elif row.source in ("jsonl", "failed"):
            path = self.layout.eval_episodes if row.source == "jsonl" else self.layout.failed_episodes
            with path.open("rb") as fh:
                fh.seek(row.offset)
                data = json.loads(fh.readline())
            if data.get("samples") is None:
                data["samples"] = session_samples(self.layout.store, row.session)
        else:
            data = {"id": row.id, "task_id": row.task, "status": row.status, "group_id": row.group,
                    "metadata": {"session_id": row.session}, "samples": session_samples(self.layout.store, row.session)}  # fmt: skip
        if row.source == "session" and row.status == "open":
            return data  # still being written: read again next time
        if len(self._cache) > 64:
            self._cache.pop(next(iter(self._cache)))
        self._cache[episode_id] = data
        return data

    def episode(self, episode_id: str) -> dict[str, Any]:
        row = self._row(episode_id)
        data = self.load(episode_id)
        meta = data.get("metadata") or {}
        transcript = meta.get("transcript") or []
        samples = data.get("samples", [])
        commands = _commands(transcript, meta.get("harness") or {})
        decoded: list[dict[str, Any]] = []
        if (
            samples and len(transcript) <= 2
        ):  # a CLI harness records instruction and answer: turns are in the tokens
            longest = max(samples, key=lambda s: len(s["token_ids"]))
            decoded = decoded_turns(longest, self.pieces.decode)
            commands = commands or commands_from_turns(decoded)
        return {
            "row": row.public(),
            "reward": data.get("reward"),
            "error": data.get("error"),
            "flags": data.get("flags") or [],  # reward-hacking flags (miles_env/guards)
            "guards": meta.get("guards") or {},  # their evidence
            "timings": data.get("timings") or {},
            "harness": data.get("harness"),
            "harness_meta": meta.get("harness") or {},
            "transcript": transcript,
            "commands": commands,
            "decoded": decoded,
            "samples": [_sample_summary(s) for s in samples],
        }

    def tokens(self, episode_id: str, k: int) -> dict[str, Any]:
        data = self.load(episode_id)
        samples = data.get("samples", [])
        if not 0 <= k < len(samples):
            raise NotFound(f"episode {episode_id!r}: no sample {k} (it has {len(samples)})")
        s = samples[k]
        sid = str((data.get("metadata") or {}).get("session_id", ""))
        drift = [d for d in self._drift(sid, samples) if d["branch"] in (None, s.get("branch", 0))]
        return {
            "ids": list(s["token_ids"]),
            "mask": list(s["loss_mask"]),
            "logprobs": [
                None if lp != lp or lp in (float("inf"), float("-inf")) else lp for lp in s["logprobs"]
            ],
            "pieces": self.pieces.pieces(s["token_ids"]),
            "tokenizer_error": self.pieces.error,
            "turns": s.get("turns", []),
            "branch": s.get("branch", 0),
            "drift": drift,
        }

    def _drift(self, session_id: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        store: Path = self.layout.store
        if not session_id or not (store / f"{session_id}.jsonl").is_file():
            return []
        return session_drift(store, session_id, samples)

    def group(self, group_id: str) -> dict[str, Any]:
        rows = self.index.group(group_id)
        if not rows:
            raise NotFound(f"group {group_id!r}: not in {self.layout.root}")
        trainer = self.layout.config().get("trainer") or {}
        kind = str(trainer.get("advantage", "grpo"))
        policy = set(trainer.get("policy_ends") or [e.value for e in POLICY_ENDS])
        valid = [r for r in rows if r.end in policy]
        by_id = dict(
            zip((r.id for r in valid), advantages([r.reward or 0.0 for r in valid], kind), strict=True)
        )
        out = []
        for row in rows:
            adv = by_id.get(row.id)
            ep = self.episode(row.id)
            last = next(
                (
                    m
                    for m in reversed(ep["transcript"])
                    if isinstance(m, dict) and m.get("role") == "assistant"
                ),
                None,
            )
            out.append({**row.public(), "advantage": adv, "commands": ep["commands"][:20],
                        "final": _plain(last.get("content")) if last else None})  # fmt: skip
        return {"group": group_id, "advantage_kind": kind, "episodes": out}


def _commands(transcript: list[Any], harness_meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The sandbox commands: the harness's own record when it keeps one (`metadata.harness.execs`:
    [{command, exit_code, duration_s, output}], exact), else read from the transcript; when the
    harness counted the commands it ran (the builtin harness's few-shot example holds one it never
    ran), only that many, the last ones."""
    execs = harness_meta.get("execs")
    if isinstance(execs, list) and all(isinstance(e, dict) for e in execs):  # recorded by the harness itself
        keys = ("command", "exit_code", "duration_s", "output")
        return [{"tool": "exec", **{k: e.get(k) for k in keys}} for e in execs]
    cmds = commands_from_transcript(transcript)
    ran = harness_meta.get("commands")
    if isinstance(ran, int) and not isinstance(ran, bool) and 0 <= ran < len(cmds):
        cmds = cmds[len(cmds) - ran :]
    return cmds


def _plain(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return "" if content is None else str(content)
