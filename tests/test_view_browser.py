"""`miles-env view` end to end in a real browser: Playwright driving Debian's chromium, headless.

Against a real run directory (a short `miles-env train` on a tiny random Llama with the SmolLM2
tokenizer, as tests/test_train_e2e.py) and the proxy store of the Claude Code scripted episode
(tests/test_harness_claude_code.py): each page loads, the token view shows exactly the stored
masked tokens, filters work, a drift `tito audit` finds is marked at its token, and the run page
picks up the steps a resumed `train` writes while the viewer is open.

Screenshots go to $MILES_ENV_VIEW_SHOTS (docs/img to refresh the README's pictures), else to a
temporary folder. Chromium comes from scripts/install-chromium.sh (scripts/test.sh runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_env.queue.codec import decode_episode
from tests.view_support import chromium_path

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def chromium() -> str:
    found = chromium_path()
    if found is None:
        pytest.skip("chromium is not installed and scripts/install-chromium.sh could not install it")
    return found


@contextmanager
def viewer(root: Path, *extra: str) -> Iterator[str]:
    """`miles-env view ROOT` as a user runs it, until the block ends."""
    cmd = [sys.executable, "-m", "miles_env.cli.main", "view", str(root), "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "miles-env view: KIND at ROOT on http://127.0.0.1:PORT/"
        if " on http://" not in line:
            raise AssertionError(f"viewer did not start: {line}{proc.stdout.read()}")
        url = line.rsplit(" on ", 1)[1].strip().rstrip("/")
        httpx.get(f"{url}/api/live", timeout=30).raise_for_status()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = ctx.new_page()
    yield pg
    ctx.close()


def shot(page: Any, name: str) -> None:
    """A screenshot of the page; in docs/img (MILES_ENV_VIEW_SHOTS) reduced to 256 colours to stay small."""
    out = Path(
        os.environ.get("MILES_ENV_VIEW_SHOTS") or os.environ.get("PYTEST_VIEW_TMP", "/tmp/miles-view-shots")
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"view-{name}.png"
    page.screenshot(path=str(path))
    from PIL import Image

    Image.open(path).convert("RGB").quantize(colors=256).save(path, optimize=True)


# -- the runs -------------------------------------------------------------------------------------


def train_args(run_dir: Path, model: Path, steps: int) -> list[str]:
    sets = [
        f"run_dir={run_dir}", f"engine.model={model}", f"trainer.steps={steps}", "rollout.group_size=2",
        "rollout.groups_per_step=2", "rollout.concurrency=4", "harness.max_tokens=12", "harness.max_turns=2",
        "eval.rollouts=1", "eval.tiers=[1]", "eval.every=1", "trainer.skip_zero_advantage=false",
    ]  # fmt: skip
    out = [sys.executable, "-m", "miles_env.cli.main", "train", str(ROOT / "examples/terminal-cpu.yaml")]
    for s in sets:
        out += ["--set", s]
    return out


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("view-train") / "run"
    proc = subprocess.run(train_args(run_dir, tiny_model, 2), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def queue_episodes(run_dir: Path) -> list[Any]:
    import sqlite3

    with sqlite3.connect(f"file:{run_dir / 'queue.db'}?mode=ro", uri=True) as conn:
        return [
            decode_episode(m, b) for m, b in conn.execute("SELECT meta, arrays FROM episodes ORDER BY rowid")
        ]


def eval_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "eval_episodes.jsonl").read_text().splitlines() if x]


# -- the tests ------------------------------------------------------------------------------------


def test_run_episodes_episode_and_group_pages(train_run: Path, page: Any) -> None:
    episodes, evals = queue_episodes(train_run), eval_lines(train_run)
    with viewer(train_run) as url:
        page.goto(f"{url}/#/run")
        page.wait_for_selector("[data-testid=chart] svg")
        assert page.locator("[data-testid=chart]").count() == 10
        assert page.locator("[data-testid=step]").text_content() == "2"
        shot(page, "run")

        page.goto(f"{url}/#/episodes")
        page.wait_for_function(
            f"document.querySelector('#count')?.dataset.total == '{len(episodes) + len(evals)}'"
        )
        assert page.locator("#rows tr").count() == len(episodes) + len(evals)
        shot(page, "episodes")
        page.select_option("[data-testid=f-split]", "test")
        page.wait_for_function(f"document.querySelector('#count').dataset.total == '{len(evals)}'")
        assert set(page.locator("#rows tr td:nth-child(7)").all_text_contents()) == {"test"}
        page.select_option("[data-testid=f-split]", "")
        policy = {"completed", "truncated", "policy_format"}  # the end filter: policy ends, infrastructure
        infra = sum(e.end.value not in policy for e in episodes) + sum(e["end"] not in policy for e in evals)
        page.select_option("[data-testid=f-end]", "infra")
        page.wait_for_function(f"document.querySelector('#count').dataset.total == '{infra}'")
        page.select_option("[data-testid=f-end]", "")
        task = episodes[0].task_id
        page.fill("[data-testid=f-q]", task)
        want = sum(e.task_id == task for e in episodes) + sum(e["task_id"] == task for e in evals)
        page.wait_for_function(f"document.querySelector('#count').dataset.total == '{want}'")
        assert set(page.locator("#rows tr td:nth-child(2)").all_text_contents()) == {task}

        ep = max(episodes, key=lambda e: len(e.samples[0].token_ids))  # a known episode: its stored tokens
        sample = ep.samples[0]
        page.goto(f"{url}/#/episode/{ep.id}")
        page.wait_for_function(f"document.body.dataset.tokensReady == '{ep.id}:0'")
        stats = page.locator("[data-testid=tokstats]")
        assert stats.get_attribute("data-masked") == str(sum(sample.loss_mask))
        assert page.locator("#tokens span.s").count() == sum(sample.loss_mask)
        assert page.locator("#tokens span.p").count() == len(sample.token_ids) - sum(sample.loss_mask)
        assert page.locator("#tokens span.turn").count() == len(sample.turns)
        first = sample.turns[0].start  # the first sampled token is where turn 0's completion starts
        assert page.locator(f"#tokens span[data-i='{first}']").get_attribute("class") == "s"
        assert page.locator(f"#tokens span[data-i='{first - 1}']").get_attribute("class") == "p"
        assert page.locator("[data-testid=conversation] .msg").count() == len(ep.metadata["transcript"])
        assert "score" in page.locator("[data-testid=verifier]").text_content()
        shot(page, "episode")
        page.locator("#tokens").scroll_into_view_if_needed()
        shot(page, "tokens")

        page.goto(f"{url}/#/group/{ep.group_id}")
        page.wait_for_selector("[data-testid=group-col]")
        assert page.locator("[data-testid=group-col]").count() == 2  # rollout.group_size
        advs = [float(x.split("=")[1]) for x in page.locator("[data-testid=advantage]").all_text_contents()]
        assert abs(sum(advs)) < 1e-2
        shot(page, "group")


def test_drift_is_marked_at_the_token_where_it_starts(train_run: Path, tmp_path: Path, page: Any) -> None:
    run = tmp_path / "run"
    shutil.copytree(train_run, run, ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "weights"))
    ep = queue_episodes(run)[0]
    snap = run / "sessions" / f"{ep.metadata['session_id']}.export.json"
    body = json.loads(snap.read_text())
    mask = body["branches"][0]["loss_mask"]
    pos = mask.index(1) + 2  # a sampled token, changed at rest in the export snapshot
    body["branches"][0]["token_ids"][pos] += 1
    snap.write_text(json.dumps(body))
    with viewer(run) as url:
        page.goto(f"{url}/#/episode/{ep.id}")
        page.wait_for_function(f"document.body.dataset.tokensReady == '{ep.id}:0'")
        assert page.locator("[data-testid=tokstats]").get_attribute("data-drift") == "1"
        assert page.locator("[data-testid=drift]").text_content() == "drift: sampled_ids"
        assert "d" in (page.locator(f"#tokens span[data-i='{pos}']").get_attribute("class") or "").split()
        assert page.locator("#tokens span.d").count() == 1


def test_live_update_picks_up_the_steps_a_running_train_writes(
    train_run: Path, tiny_model: Path, page: Any, tmp_path: Path
) -> None:
    before = len(queue_episodes(train_run))
    with viewer(train_run) as url:
        page.goto(f"{url}/#/run")
        page.wait_for_function("document.querySelector('[data-testid=step]')?.textContent == '2'")
        log = (tmp_path / "train.log").open("w")  # a file, not an unread pipe that could fill and block it
        train = subprocess.Popen(train_args(train_run, tiny_model, 4), stdout=log, stderr=subprocess.STDOUT)
        try:  # resumes at step 2 and writes steps 3 and 4 while the page is open
            assert train.wait(timeout=500) == 0, (tmp_path / "train.log").read_text()[-3000:]
            page.wait_for_function(  # no reload: the page's own polling shows the new steps
                "document.querySelector('[data-testid=step]')?.textContent == '4'", timeout=30_000
            )
        finally:
            if train.poll() is None:
                train.kill()
        page.goto(f"{url}/#/episodes")
        page.wait_for_function(f"+document.querySelector('#count')?.dataset.total > {before}")


@pytest.fixture(scope="module")
def claude_code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Claude Code scripted episode (two Bash tool calls), as `eval --out` lays it out."""
    import anyio

    from miles_env.cli.eval import summarize
    from miles_env.harnesses._cli import CLAUDE_CODE
    from miles_env.jsonio import write_json
    from miles_env.models import load_tokenizer
    from tests.cli_harness_support import TWO_STEP_POLICY, SideCallEngine, require_cli, run_one, task_for

    require_cli(CLAUDE_CODE)
    out = tmp_path_factory.mktemp("view-cc") / "eval"
    engine = SideCallEngine(load_tokenizer(), policy=TWO_STEP_POLICY, max_context=1 << 20)

    async def one() -> Any:
        return await run_one("claude-code", engine, out / "sessions", task_for(CLAUDE_CODE), budget_s=150,
                             version=CLAUDE_CODE.version)  # fmt: skip

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        ep = pool.submit(anyio.run, one).result(timeout=600)
    assert ep.reward is not None and ep.reward.passed, (ep.error, ep.reward)
    (out / "episodes.jsonl").write_text(ep.model_dump_json() + "\n")
    write_json(out / "summary.json", summarize([ep]))  # as `miles-env eval --out` writes them
    return out


def test_claude_code_store_and_eval_dir(claude_code_dir: Path, page: Any) -> None:
    ep = json.loads((claude_code_dir / "episodes.jsonl").read_text())
    store = claude_code_dir / "sessions"
    snap = json.loads((store / f"{ep['metadata']['session_id']}.export.json").read_text())
    masked = sum(sum(b["loss_mask"]) for b in snap["branches"])
    with viewer(store) as url:  # the proxy store alone: one row per session, tokens from the export
        page.goto(f"{url}/#/episodes")
        n = len(list(store.glob("*.jsonl")))
        page.wait_for_function(f"document.querySelector('#count')?.dataset.total == '{n}'")
        page.goto(f"{url}/#/episode/{ep['metadata']['session_id']}")
        page.wait_for_selector("[data-testid=tokstats][data-masked]")
        shown = 0
        for k in range(len(snap["branches"])):
            page.click(f"[data-testid=sample-{k}]")
            page.wait_for_function(f"document.body.dataset.tokensReady?.endsWith(':{k}')")
            shown += int(page.locator("[data-testid=tokstats]").get_attribute("data-masked") or 0)
        assert shown == masked
    with viewer(claude_code_dir) as url:  # the eval dir: its summary, the episode, its reward and commands
        page.goto(f"{url}/#/run")
        page.wait_for_selector("[data-testid=no-metrics]")
        assert page.locator("[data-testid=eval-pass]").text_content() == "1"
        page.goto(f"{url}/#/episode/{ep['id']}")
        page.wait_for_selector("[data-testid=tokstats][data-masked]")
        commands = page.locator("[data-testid=commands] tr.cmd td:nth-child(2)").all_text_contents()
        assert commands == ["echo alpha > first.txt", 'echo "$(cat first.txt) beta" > second.txt']
        assert page.locator("[data-testid=decoded] .msg.assistant").count() >= 3
        shot(page, "claude-code")
