"""The three eval modes (`eval.mode`), each end to end through a short `miles-env train` run.

Real parts: the scripted engine (fast, deterministic; its weight version is whatever the job last
loaded into it), the TITO proxy over HTTP, bubblewrap sandboxes, the sqlite queue and the torch
trainer on the tiny random Llama of conftest.py's `tiny_model` (tests/train_support.py builds the
command line). Checks: shared evals on the rollout engine; dedicated evals on an engine of their own
whose weight version changes only at eval points and the rollout engine never serves an eval
episode; external hands each eval point's export to a command (success, non-zero exit, a hang past
its timeout: the run finishes every step either way) or POSTs it to a URL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from miles_env.config import load_config
from miles_env.errors import ConfigError
from tests.train_support import ROOT, rows, train_args


def test_each_mode_reads_its_own_section() -> None:
    cfg = load_config(None, ["eval.mode=external", "eval.external.command=python score.py --fast"])
    assert cfg.eval.external is not None and cfg.eval.external.command == ["python", "score.py", "--fast"]
    with pytest.raises(ConfigError, match=r"eval\.external: eval\.mode=external needs external\.command or"):
        load_config(None, ["eval.mode=external"])
    with pytest.raises(ConfigError, match=r"eval\.external: .*set exactly one of command and url"):
        load_config(None, ["eval.mode=external", "eval.external.command=x", "eval.external.url=http://h/e"])
    with pytest.raises(
        ConfigError, match=r"eval\.engine: engine is read by eval\.mode=dedicated, not shared"
    ):
        load_config(None, ["eval.engine.kind=scripted"])
    with pytest.raises(ConfigError, match=r"eval\.mode: Input should be 'shared', 'dedicated' or 'external'"):
        load_config(None, ["eval.mode=remote"])


def _train(run_dir: Path, model: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    args = train_args(run_dir, model, steps, f"engine={{kind: scripted, model: {model}}}", *extra)
    log = run_dir.parent / "train.log"
    with log.open("w") as fh:  # a file, not an unread pipe
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def _session_ids(run_dir: Path) -> list[str]:
    lines = (run_dir / "eval_episodes.jsonl").read_text().splitlines()
    return [json.loads(line)["metadata"]["session_id"] for line in lines if line]


def _journaled(store: Path) -> str:
    return "".join(p.read_text() for p in sorted(store.rglob("*.jsonl"))) if store.is_dir() else ""


def _turn_versions(store: Path) -> list[int]:
    found: list[int] = []
    for line in _journaled(store).splitlines():
        event = json.loads(line)
        if event.get("kind") == "turn":
            found.append(int(event["turn"]["weight_version"]))
    return found


@pytest.mark.slow
def test_shared_evaluates_on_the_rollout_engine(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, tiny_model, 2, "eval.mode=shared")
    evals = rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 2]
    assert all(r["episodes"] > 0 for r in evals)
    rollout_journal = _journaled(run_dir / "sessions")
    assert all(sid in rollout_journal for sid in _session_ids(run_dir))
    assert not (run_dir / "eval_sessions").exists()


@pytest.mark.slow
def test_dedicated_evaluates_on_its_own_engine_synced_only_at_eval_points(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, tiny_model, 4, "mode=fully_async", "eval.mode=dedicated", "eval.every=2")
    evals = rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 2, 4]
    # the eval engine took the trainer's weights at steps 2 and 4 only (it loaded step 0's itself)
    assert [r["eval_weight_version"] for r in evals] == [0, 2, 4]
    assert [r["eval_syncs"] for r in evals] == [0, 1, 2]
    # every eval turn was served by the eval engine at the version of the step it evaluates
    assert sorted(set(_turn_versions(run_dir / "eval_sessions"))) == [0, 2, 4]
    by_step: dict[int, set[int]] = {}
    for line in (run_dir / "eval_episodes.jsonl").read_text().splitlines():
        ep = json.loads(line)
        by_step.setdefault(ep["step"], set()).add(ep["metadata"]["session_id"])
    assert sorted(by_step) == [0, 2, 4]
    # the rollout engine never served an eval episode; the eval engine served nothing else
    rollout_journal, eval_journal = _journaled(run_dir / "sessions"), _journaled(run_dir / "eval_sessions")
    sids = _session_ids(run_dir)
    assert sids and all(sid in eval_journal and sid not in rollout_journal for sid in sids)
    assert len(_turn_versions(run_dir / "eval_sessions")) == len(sids)  # one turn per eval episode
    assert [r["step"] for r in rows(run_dir, "train")] == [1, 2, 3, 4]


EVALUATOR = """
import json, os, sys, time
step = int(os.environ["MILES_ENV_STEP"])
assert sys.argv[-1] == os.environ["MILES_ENV_CHECKPOINT"], sys.argv
ckpt = os.environ["MILES_ENV_CHECKPOINT"]
assert os.path.isfile(os.path.join(ckpt, "model.safetensors")) and os.path.isfile(os.path.join(ckpt, "config.json"))
if step == {hang}:
    time.sleep(60)
if step == {fail}:
    print("evaluating...", flush=True)
    sys.stderr.write("Traceback: something broke\\nValueError: bad checkpoint\\n")
    sys.exit(3)
print("loading " + ckpt)
print(json.dumps({{"accuracy": step / 10, "suite": {{"n": 7}}, "name": "toy"}}))
"""


def _external(tmp_path: Path, tiny_model: Path, hang: int, fail: int) -> Path:
    script = tmp_path / "evaluator.py"
    script.write_text(EVALUATOR.format(hang=hang, fail=fail))
    run_dir = tmp_path / "run"
    command = json.dumps([sys.executable, str(script)])
    _train(
        run_dir, tiny_model, 3, "eval.mode=external", f"eval.external.command={command}",
        "eval.external.timeout_s=3", "eval.every=1",
    )  # fmt: skip
    assert [r["step"] for r in rows(run_dir, "train")] == [1, 2, 3]  # the run finished every step
    return run_dir


def _external_rows(run_dir: Path) -> dict[int, dict]:
    evals = rows(run_dir, "eval")
    assert sorted(r["step"] for r in evals) == [0, 1, 2, 3]  # one row per eval point
    return {r["step"]: r for r in evals}


@pytest.mark.slow
def test_external_command_results_become_eval_metrics(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = _external(tmp_path, tiny_model, hang=-1, fail=-1)
    for step, row in _external_rows(run_dir).items():
        assert "eval/external_error" not in row, row
        assert row["eval/accuracy"] == pytest.approx(step / 10)
        assert row["eval/suite/n"] == 7 and row["eval/name"] == "toy"
        assert row["eval/checkpoint"].endswith(f"exports/step_{step:08d}")
    kept = sorted(p.name for p in (run_dir / "exports").iterdir())
    assert kept == ["step_00000002", "step_00000003"]  # keep_exports=2, the newest
    # the export loads on its own: the example evaluator of the README scores it
    example = [
        sys.executable,
        str(ROOT / "examples/eval_external.py"),
        str(run_dir / "exports/step_00000003"),
    ]
    out = subprocess.run(example, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["answers"] == 3


@pytest.mark.slow
def test_external_timeout_is_reported_and_the_run_goes_on(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = _external(tmp_path, tiny_model, hang=1, fail=-1)
    by_step = _external_rows(run_dir)
    assert by_step[1]["eval/external_error"] == "timeout after 3s"
    assert 3 <= by_step[1]["eval/external_s"] < 30  # killed at its timeout, not slept out
    assert by_step[2]["eval/accuracy"] == pytest.approx(0.2)  # the next eval ran as usual


@pytest.mark.slow
def test_external_nonzero_exit_is_reported_with_its_stderr(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = _external(tmp_path, tiny_model, hang=-1, fail=2)
    by_step = _external_rows(run_dir)
    error = by_step[2]["eval/external_error"]
    assert error.startswith("exit code 3: ") and "ValueError: bad checkpoint" in error, error
    assert by_step[2]["eval/external_exit_code"] == 3
    assert by_step[3]["eval/accuracy"] == pytest.approx(0.3)


class _Evaluator(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body)
        reply = json.dumps(
            {"accuracy": body["step"] / 10, "exists": Path(body["checkpoint"]).is_dir()}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def evaluator_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Evaluator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/eval"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_external_url_gets_each_checkpoint_and_its_answer_is_logged(
    tmp_path: Path, tiny_model: Path, evaluator_url: str
) -> None:
    run_dir = tmp_path / "run"
    _Evaluator.seen.clear()
    _train(run_dir, tiny_model, 1, "eval.mode=external", f"eval.external.url={evaluator_url}")
    assert [b["step"] for b in _Evaluator.seen] == [0, 1]
    assert all(b["checkpoint"].endswith(f"exports/step_{b['step']:08d}") for b in _Evaluator.seen)
    by_step = {r["step"]: r for r in rows(run_dir, "eval")}
    assert by_step[0]["eval/accuracy"] == 0.0 and by_step[1]["eval/accuracy"] == pytest.approx(0.1)
    assert by_step[1]["eval/exists"] == 1.0
