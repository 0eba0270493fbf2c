"""`miles-env view` without a browser: the readers, the API and the wandb tracker, on run
directories written by the real writers (SqliteReplayQueue, metrics rows, checkpoints).

The browser end-to-end tests (a real training run, a Claude Code store, Chromium) are in
tests/test_view_browser.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from miles_env.errors import ConfigError
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.view import Kind, create_app, detect, open_run
from miles_env.view.commands import commands_from_transcript
from miles_env.view.detail import NotFound, advantages
from tests.view_support import make_episode, make_run

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("view") / "run", episodes=200, tokens=64)


def test_layouts_are_told_apart(tmp_path: Path, run_dir: Path) -> None:
    assert detect(run_dir).kind is Kind.TRAIN
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "episodes.jsonl").write_text("")
    assert detect(tmp_path / "eval").kind is Kind.EVAL
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "abc.jsonl").write_text("")
    assert detect(tmp_path / "store").kind is Kind.STORE
    with pytest.raises(ConfigError, match="not a run directory"):
        detect(tmp_path)


def test_table_pages_sorts_and_filters_server_side(run_dir: Path) -> None:
    run = open_run(run_dir, None, preload=False)
    idx = run.index
    assert idx.page(offset=0, limit=10, sort="", desc=False, filters={}).total == 200
    by_reward = idx.page(offset=0, limit=200, sort="reward", desc=True, filters={}).rows
    assert [r["reward"] for r in by_reward] == sorted((r["reward"] for r in by_reward), reverse=True)
    failed = idx.page(offset=0, limit=500, sort="", desc=False, filters={"status": "failed"})
    assert failed.total == 40 and {r["status"] for r in failed.rows} == {"failed"}  # every 5th episode
    step3 = idx.page(offset=0, limit=500, sort="id", desc=False, filters={"step": "3"})
    assert [r["id"] for r in step3.rows] == [f"ep{i:06d}" for i in range(64, 96)]  # from the checkpoints
    task = idx.page(offset=0, limit=500, sort="", desc=False, filters={"q": "task-3"})
    assert task.total and all("task-3" in r["task"] for r in task.rows)
    passed = idx.page(offset=0, limit=500, sort="", desc=False, filters={"passed": "1"})
    assert passed.total and all(r["reward"] >= 1.0 for r in passed.rows)
    second = idx.page(offset=100, limit=100, sort="id", desc=False, filters={})
    assert second.rows[0]["id"] == "ep000100" and len(second.rows) == 100
    row = idx.by_id["ep000005"]
    assert (row.turns, row.sampled, row.v_min, row.step) == (2, 32, 0, 1)


def test_reads_never_wait_for_a_writer_and_write_nothing(run_dir: Path) -> None:
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir() if p.is_file()}
    writer = sqlite3.connect(run_dir / "queue.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a train process mid-transaction holds the write lock
    try:
        run = open_run(run_dir, None, preload=False)
        tokens = run.details.tokens("ep000007", 0)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert len(tokens["ids"]) == 64
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir() if p.is_file()}
    sqlite_side = {"queue.db-wal", "queue.db-shm"}  # SQLite's own shared-memory files for WAL readers
    assert {k: v for k, v in after.items() if k not in sqlite_side} == {
        k: v for k, v in before.items() if k not in sqlite_side
    }


def test_tokens_are_the_stored_arrays(run_dir: Path) -> None:
    run = open_run(run_dir, None, preload=False)
    data = run.details.tokens("ep000011", 0)
    with sqlite3.connect(run_dir / "queue.db") as conn:
        meta, blob = conn.execute("SELECT meta, arrays FROM episodes WHERE id='ep000011'").fetchone()
    from miles_env.models import load_tokenizer
    from miles_env.queue.codec import decode_episode
    from miles_env.view.tokens import Pieces

    s = decode_episode(meta, blob).samples[0]
    assert data["ids"] == s.token_ids and data["mask"] == s.loss_mask and data["logprobs"] == s.logprobs
    assert sum(data["mask"]) == 32 and [t["start"] for t in data["turns"]] == [16, 48]
    tok = load_tokenizer("smollm2")  # config.yaml's engine.model; one piece per id, for display only
    assert data["pieces"] == [tok.decode([i]) for i in s.token_ids]
    assert Pieces(None).pieces([1, 2]) is None and "--model" in (Pieces(None).error or "")
    with pytest.raises(NotFound):
        run.details.tokens("ep000011", 1)


def test_live_refresh_reads_only_complete_new_lines_and_rows(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", episodes=32, tokens=32)
    run = open_run(root, None, preload=False)
    n_metrics, changes = len(run.metrics.rows), run.index.changes
    with (root / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 2, "kind": "train", "time": 1.0, "reward_mean": 0.5}) + "\n")
        fh.write('{"step": 3, "kind": "tr')  # a line being appended
    q = SqliteReplayQueue(root / "queue.db", max_pending_groups=1 << 20)
    import random

    for i in range(32, 40):
        q.put(make_episode(i, 32, 8, random.Random(i), 1))
    q.close()
    run.refresh(0.0)
    assert [r["step"] for r in run.metrics.rows[n_metrics:]] == [2]
    assert len(run.index.rows) == 40 and run.index.changes > changes
    with (root / "metrics.jsonl").open("a") as fh:
        fh.write('ain", "time": 2.0, "reward_mean": 0.7}\n')
    run.refresh(0.0)
    assert [r["step"] for r in run.metrics.rows[n_metrics:]] == [2, 3]


def test_commands_from_the_three_transcript_shapes() -> None:
    openai = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "exit code: 2\nls: cannot access"},
    ]  # fmt: skip
    anthropic = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "echo hi"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "hi"}]}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "false"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "Error", "is_error": True}]},
    ]  # fmt: skip
    builtin = [
        {"role": "assistant", "content": "```sh\ncat x\n```"},
        {"role": "user", "content": "Exit code: 1\nOutput:\ncat: x: No such file"},
    ]
    got = commands_from_transcript(openai + anthropic + builtin)
    assert [(c["command"], c["exit_code"]) for c in got] == [
        ("ls", 2),
        ("echo hi", None),
        ("false", 1),
        ("cat x", 1),
    ]
    assert got[1]["output"] == "hi"


def test_a_harness_exec_record_is_shown_as_recorded() -> None:
    from miles_env.view.detail import _commands

    execs = [{"command": "make", "exit_code": 2, "duration_s": 1.5, "output": "error", "extra": 1}]
    transcript = [{"role": "assistant", "content": "```sh\nls\n```"}]
    assert _commands(transcript, {"execs": execs}) == [
        {"tool": "exec", "command": "make", "exit_code": 2, "duration_s": 1.5, "output": "error"}
    ]
    assert _commands(transcript, {"commands": 0}) == []  # the one in the transcript was never run


def test_commands_and_turns_decoded_from_the_tokens() -> None:
    from miles_env.view.decoded import commands_from_turns, decoded_turns

    call = '<tool_call>{"name": "Bash", "arguments": {"command": "ls /nope"}}</tool_call>'
    texts = ["<user>do it</user>", call, "<tool_response>exit code 2\nls: /nope</tool_response>", "done"]
    ids = [i for i, text in enumerate(texts) for _ in range(3)]  # three ids per piece of text
    sample = {
        "token_ids": ids,
        "turns": [{"start": 3, "completion_len": 3}, {"start": 9, "completion_len": 3}],
    }
    turns = decoded_turns(sample, lambda run: "".join(texts[i] for i in sorted(set(run))))
    assert [(t["prompt"], t["completion"]) for t in turns] == [(texts[0], call), (texts[2], "done")]
    (cmd,) = commands_from_turns(turns)
    assert (cmd["tool"], cmd["command"], cmd["exit_code"], cmd["turn"]) == ("Bash", "ls /nope", 2, 0)


def test_group_advantages_are_the_trainers() -> None:
    torch = pytest.importorskip("torch")
    from miles_env.trainer.losses import group_advantages

    rewards = [1.0, 0.0, 0.5, 0.0]
    for kind in ("grpo", "dr_grpo"):
        want = group_advantages(torch.tensor(rewards, dtype=torch.float64), kind).tolist()  # type: ignore[arg-type]
        assert advantages(rewards, kind) == pytest.approx(want, abs=1e-9)


async def test_api_serves_pages_groups_and_errors(run_dir: Path) -> None:
    app = create_app(open_run(run_dir, None, preload=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://view") as client:
        page = (await client.get("/")).text
        assert "/static/app.js" in page
        assert (await client.get("/api/run")).json()["kind"] == "train"
        live = (await client.get("/api/live")).json()
        assert live["episodes"] == 200 and live["metrics"] > 0
        body = (await client.get("/api/episodes", params={"limit": 5, "sort": "reward", "desc": "1"})).json()
        assert body["total"] == 200 and len(body["rows"]) == 5
        ep = (await client.get("/api/episodes/ep000003")).json()
        assert ep["commands"] == [
            {"tool": "shell", "command": "echo 0 > answer.txt", "exit_code": 0, "output": "Exit code: 0\nOutput:\n(none)", "duration_s": None}
        ]  # fmt: skip
        assert ep["samples"] == [{"branch": 0, "tokens": 64, "masked": 32, "turns": 2, "versions": [0]}]
        group = (await client.get(f"/api/groups/{ep['row']['group']}")).json()
        advs = [e["advantage"] for e in group["episodes"] if e["end"] != "verifier_error"]
        assert len(group["episodes"]) == 8 and len(advs) < 8 and abs(sum(advs)) < 1e-6
        # an infrastructure failure has no advantage: it never trains nor moves its group's baseline
        assert all(e["advantage"] is None for e in group["episodes"] if e["end"] == "verifier_error")
        by_end = {
            want: (await client.get("/api/episodes", params={"end": want, "limit": 1})).json()["total"]
            for want in ("policy", "infra", "verifier_error", "truncated")
        }
        assert by_end == {"policy": 160, "infra": 40, "verifier_error": 40, "truncated": 40}
        assert (await client.get("/api/episodes/nope")).status_code == 404
        assert (await client.get("/api/episodes/ep000003/tokens/9")).status_code == 404


def test_static_assets_are_offline() -> None:
    static = Path(__file__).resolve().parents[1] / "miles_env" / "view" / "static"
    for path in static.iterdir():
        text = path.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path.name


def test_wandb_offline_gets_the_same_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from miles_env.runlog import LoggingConfig, RunLog

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(tensorboard=False, wandb=True, wandb_mode="offline")
    log = RunLog(tmp_path, config=cfg)
    log.log(1, "train", {"reward_mean": 0.25, "loss": float("nan")})
    log.log(2, "train", {"reward_mean": 0.75, "loss": 0.5})
    log.close()
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    (run,) = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    deadline = time.monotonic() + 30
    while len(history := _wandb_history(run.read_bytes())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # wandb-core may still be writing the file when finish() returns
    assert [h.get("train/reward_mean") for h in history] == [0.25, 0.75]
    assert [h.get("train/loss") for h in history] == [None, 0.5]  # NaN is not sent
    assert [h["_step"] for h in history] == [1, 2]
    assert [json.loads(x)["reward_mean"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0.25,
        0.75,
    ]
    log2 = RunLog(tmp_path, config=cfg)  # a resumed run logs into the same W&B run
    log2.close()
    assert (tmp_path / "wandb-run-id").read_text().strip() == run_id
    assert os.environ.get("WANDB_MODE") in (None, "offline")


def _wandb_history(data: bytes) -> list[dict[str, object]]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf Records after a
    7-byte header), read with wandb's own protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    rows, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = pb.Record()  # type: ignore[attr-defined]
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})
    return rows
