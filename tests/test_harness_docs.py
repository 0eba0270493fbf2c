"""docs/harnesses.md, run as written: every command of its ```sh blocks, with the real CLIs.

`RUN_BY` names, for each command, the test that runs it (a substring that picks it out), and
`test_every_command_is_run` keeps the table and the page equal: a command added to the page
without a test fails here. `/path/to/ckpt` is a real HF checkpoint served by the hf engine: the
"Done." model (tests/cli_docs_support.py), which answers every prompt "Done." so an episode costs
seconds; the one command that names SmolLM2 runs the real SmolLM2 (marked `model`). Plain
`miles-env` commands run in this process (their argv as written, in a scratch directory); the
rest (heredocs, curl, the CLIs by hand) with bash.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_env.harnesses._cli import CLAUDE_CODE, CODEX, OPENCODE, TESTED
from miles_env.harnesses.mini_swe_agent import MINI_SWE_AGENT
from miles_env.tito import audit
from tests.cli_docs_support import DOCS, ROOT, doc_blocks, doc_commands, make_done_model, run_cli, run_doc
from tests.cli_harness_support import require_cli

BLOCKS = doc_blocks(DOCS.read_text())
COMMANDS = [c for b in BLOCKS for c in doc_commands(b)]
SMOLLM2 = "--engine hf --model smollm2"
RUN_BY = {
    "scripts/install-clis.sh": "test_install_commands_find_the_cached_pins",
    "--harness claude-code --engine hf --model /path/to/ckpt": "test_eval_with_your_model",
    "--harness codex --engine hf --model /path/to/ckpt": "test_eval_with_your_model",
    "--harness mini-swe-agent --engine hf --model /path/to/ckpt": "test_eval_with_your_model",
    SMOLLM2: "test_the_documented_smollm2_command",
    "oracle_policy": "test_deterministic_demo_with_the_trimmed_clis",
    "--harness-opt lean=true --engine scripted": "test_deterministic_demo_with_the_trimmed_clis",
    "tito audit runs/eval": "test_deterministic_demo_with_the_trimmed_clis",
    "8555": "test_by_hand",  # proxy serve, the session, and each CLI pointed at it
}


def _commands(marker: str) -> list[str]:
    return [c for c in COMMANDS if marker in c]


def _blocks(marker: str) -> list[str]:
    return [b for b in BLOCKS if marker in b]


@pytest.fixture(scope="module")
def done_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_done_model(tmp_path_factory.mktemp("done") / "model")


def _episodes(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


def test_every_command_is_run() -> None:
    """Each command of the page is claimed by exactly one entry of RUN_BY (in the by-hand blocks,
    each block by the port they share), and each entry claims at least one command."""
    for block in BLOCKS:
        for cmd in doc_commands(block):
            owners = {test for marker, test in RUN_BY.items() if marker in cmd} or {
                test for marker, test in RUN_BY.items() if marker == "8555" and marker in block
            }
            assert len(owners) == 1, (cmd, owners)
    assert all(_commands(marker) for marker in RUN_BY), RUN_BY


def test_install_commands_find_the_cached_pins() -> None:
    # every tested pin, as CI's scripts/test.sh installs them beforehand (`install-clis.sh` with no
    # argument installs all of them: with only the defaults cached, a fresh `--quick` check failed)
    for pin in (*(p for pins in TESTED.values() for p in pins), MINI_SWE_AGENT):
        require_cli(pin)
    for cmd in _commands("scripts/install-clis.sh"):
        proc = run_doc(cmd, ROOT, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "cached in" in proc.stdout and "npm install" not in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["claude-code", "codex", "mini-swe-agent"])
def test_eval_with_your_model(
    harness: str, done_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full CLIs on a checkpoint of yours, through the hf engine: each episode ends by the CLI's
    own account of the model's "Done.", with exact tokens. mini-swe-agent wants a tool call in every
    reply: "Done." three times is its RepeatedFormatError, a policy end (the model's output)."""
    pin = {"claude-code": CLAUDE_CODE, "codex": CODEX, "mini-swe-agent": MINI_SWE_AGENT}[harness]
    require_cli(pin)
    (cmd,) = _commands(f"--harness {harness} --engine hf --model /path/to/ckpt")
    monkeypatch.chdir(tmp_path)
    code, output = run_cli(cmd, done_model)
    assert code == 0, output
    episodes = _episodes(tmp_path / "runs" / "eval")
    assert (
        len(episodes) == 2
        and f"first prompt {episodes[0]['metadata']['first_prompt_tokens']} tokens" in output
    )
    for ep in episodes:
        meta = ep["metadata"]
        if harness == "mini-swe-agent":
            assert ep["status"] == "aborted" and ep["end"] == meta["harness"]["end"] == "policy_format", ep[
                "error"
            ]
            assert meta["harness"]["output"]["exit_status"] == "RepeatedFormatError"
        else:
            assert ep["status"] == "completed", (ep["error"], meta["harness"])
            assert meta["transcript"][-1] == {"role": "assistant", "content": "Done."}
        # The full prompts: Claude Code's is over 8k tokens (hence the 32k context), Codex's ~9k
        # with its multi-agent tools (on at 32k), mini-swe-agent's ~1.3k.
        least = {"claude-code": 10000, "codex": 8000, "mini-swe-agent": 1000}[harness]
        assert meta["first_prompt_tokens"] > least, meta["first_prompt_tokens"]
    report = audit(tmp_path / "runs" / "eval" / "sessions")
    assert report.sessions == 2 and not report.drifts, report.drifts


@pytest.mark.slow
@pytest.mark.model
def test_the_documented_smollm2_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command of issue 31 (Claude Code with only its Bash tool on SmolLM2's 8k context),
    with the real SmolLM2 on CPU: its ~3.2k-token first prompt reaches the model (it used to end
    in a second with "Prompt is too long", nothing sent: Claude Code's default reply room of 20k
    tokens left no room in 8k), whatever the model then does; exact tokens, a clean audit. The one
    end-to-end run of SmolLM2 behind a CLI: its 90 s budget is the command's own."""
    require_cli(CLAUDE_CODE)
    (cmd,) = _commands(SMOLLM2)
    monkeypatch.chdir(tmp_path)
    code, output = run_cli(cmd)
    assert code == 0, output
    episodes = _episodes(tmp_path / "runs" / "eval")
    assert len(episodes) == 1, output
    for ep in episodes:
        assert 2500 < ep["metadata"]["first_prompt_tokens"] < 4000, ep["metadata"]["first_prompt_tokens"]
        assert ep["status"] in ("completed", "truncated", "aborted"), ep["error"]
        assert "blocking_limit" not in str(ep["error"]), ep["error"]
    assert not audit(tmp_path / "runs" / "eval" / "sessions").drifts
    print(output)


@pytest.mark.slow
def test_deterministic_demo_with_the_trimmed_clis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle policy through lean Claude Code and lean Codex in an 8k window: every task passes,
    each first prompt is ~0.65k / ~1.0k tokens, and the audit finds no drift."""
    for pin in (CLAUDE_CODE, CODEX):
        require_cli(pin)
    monkeypatch.chdir(tmp_path)
    for cmd in doc_commands(_blocks("oracle_policy")[0]):
        if not cmd.startswith("miles-env"):
            proc = run_doc(cmd, tmp_path)
            assert proc.returncode == 0, proc.stderr[-2000:]
            continue
        code, output = run_cli(cmd)
        assert code == 0, output
        if "tito audit" in cmd:
            assert "no drift" in output, output
            continue
        episodes = _episodes(tmp_path / "runs" / "eval")
        assert len(episodes) == 4 and all(ep["reward"]["score"] == 1.0 for ep in episodes), output
        bound = 800 if "claude-code" in cmd else 1200
        assert all(ep["metadata"]["first_prompt_tokens"] < bound for ep in episodes), output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_by_hand(done_model: Path, tmp_path: Path) -> None:
    """`miles-env proxy serve`, an admin session, then each CLI by hand against it (on this
    machine, in a scratch directory): each one's turn reaches the model and is stored exactly."""
    for pin in (CLAUDE_CODE, CODEX, OPENCODE, MINI_SWE_AGENT):
        require_cli(pin)
    port = str(_free_port())
    serve_block, *clis = [b.replace("8555", port) for b in _blocks("8555")]
    serve, create = doc_commands(serve_block)
    server = subprocess.Popen(
        ["bash", "-c", serve.replace("/path/to/ckpt", str(done_model)).rstrip().removesuffix("&")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
    )  # fmt: skip
    try:
        _wait_ready(int(port), server)
        made = run_doc(create, tmp_path)
        assert made.returncode == 0, made.stderr
        session = json.loads(made.stdout)
        sid, key = session["session_id"], session["api_key"]
        for block in clis:
            t0 = time.monotonic()
            proc = run_doc(re.sub(r"\bKEY\b", key, re.sub(r"\bSID\b", sid, block)), tmp_path, timeout=300)
            assert proc.returncode == 0 or "mini-swe-agent" in block, (block[:80], proc.stderr[-2000:])
            print(f"{time.monotonic() - t0:.1f}s  {block.splitlines()[0][:60]}\n{proc.stdout[-600:]}")
        with httpx.Client(headers={"Authorization": "Bearer secret"}) as http:
            traj = http.get(f"http://127.0.0.1:{port}/admin/sessions/{sid}/trajectory").json()
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert traj, traj
    report = audit(tmp_path / "runs" / "manual")
    assert report.sessions == 1 and report.turns >= 4 and not report.drifts, (report, report.drifts)


def _wait_ready(port: int, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"proxy serve exited: {server.stdout.read() if server.stdout else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("proxy serve did not listen in 120 s")
