"""`miles-env view` time to first paint on a synthetic run of 10k episodes of 4k tokens.

Builds the run with the real writers (tests/view_support.py: SqliteReplayQueue.put, metrics rows,
checkpoints), serves it with the viewer's app, and measures in headless Chromium (Playwright,
Debian's chromium) the time from navigation start to the first animation frame after:
- the episodes table's first page is in the DOM (server-side paging, 100 rows);
- an episode's token view (all 4k tokens, shaded, with turn marks) is in the DOM.
Baselines in the same run: the naive table (all 10k rows fetched and rendered at once) and the
episode's raw JSON document opened in the browser (the floor: no rendering at all).

    python bench/bench_view.py [--episodes 10000] [--tokens 4096] [--repeat 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from starlette.requests import Request  # noqa: E402
from starlette.responses import HTMLResponse, Response  # noqa: E402

from miles_env.http import free_port  # noqa: E402
from miles_env.jsonio import dumps  # noqa: E402
from miles_env.view import create_app, open_run  # noqa: E402
from tests.view_support import chromium_path, make_run  # noqa: E402

NAIVE_TABLE = """<!doctype html><meta charset=utf-8><table><tbody id=rows></tbody></table><script>
fetch('/naive/rows').then(r => r.json()).then(rows => {
  document.getElementById('rows').innerHTML = rows.map(r => '<tr>' + Object.values(r).map(v => '<td>' + v + '</td>').join('') + '</tr>').join('');
  requestAnimationFrame(() => { document.body.dataset.tablePaint = performance.now().toFixed(1); });
});</script>"""


def serve(root: Path) -> tuple[str, Any]:
    import uvicorn

    run = open_run(root, None, preload=True)
    app = create_app(run)

    async def naive_page(_: Request) -> Response:
        return HTMLResponse(NAIVE_TABLE)

    async def naive_rows(_: Request) -> Response:
        rows = run.index.page(offset=0, limit=10**9, sort="", desc=False, filters={}).rows
        return Response(dumps(rows), media_type="application/json")

    async def raw_episode(request: Request) -> Response:
        return Response(dumps(run.details.load(request.path_params["eid"])), media_type="application/json")

    app.add_route("/naive", naive_page)
    app.add_route("/naive/rows", naive_rows)
    app.add_route("/naive/episode/{eid}", raw_episode)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    run.pieces.pieces([0])  # the tokenizer is loaded once per viewer, before the first page
    return f"http://127.0.0.1:{port}", server


def paint(browser: Any, url: str, marker: str) -> float:
    """ms from navigation start to the page's paint marker (a fresh page: no cache)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    page = ctx.new_page()
    page.goto(url)
    page.wait_for_function(f"document.body.dataset.{marker} !== undefined", timeout=120_000)
    value = float(page.evaluate(f"document.body.dataset.{marker}"))
    ctx.close()
    return value


def load_ms(browser: Any, url: str) -> float:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(url, wait_until="load")
    value = float(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
    ctx.close()
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="build (or reuse) the run here")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="bench-view-"))
    root = args.keep or tmp / "run"
    t0 = time.perf_counter()
    if not (root / "queue.db").exists():
        make_run(root, episodes=args.episodes, tokens=args.tokens)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    url, server = serve(root)
    started = time.perf_counter() - t0
    size_mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
    print(f"run: {args.episodes} episodes x {args.tokens} tokens, {size_mb:.0f} MB, built in {built:.0f} s; "
          f"viewer up (index of {args.episodes} rows, tokenizer) in {started:.1f} s")  # fmt: skip
    ids = [f"ep{i:06d}" for i in range(0, args.episodes, max(1, args.episodes // args.repeat))][: args.repeat]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium_path() or "chromium", headless=True, args=["--no-sandbox"]
        )
        table = [paint(browser, f"{url}/#/episodes", "tablePaint") for _ in range(args.repeat)]
        naive = [paint(browser, f"{url}/naive", "tablePaint") for _ in range(max(1, args.repeat // 2))]
        tokens = [paint(browser, f"{url}/#/episode/{eid}", "tokensPaint") for eid in ids]
        raw = [load_ms(browser, f"{url}/naive/episode/{eid}") for eid in ids]
        browser.close()
    server.should_exit = True
    med = statistics.median
    print(f"episodes table, first paint: {med(table):7.0f} ms (median of {len(table)}; max {max(table):.0f})")
    print(
        f"  naive table (all {args.episodes} rows rendered): {med(naive):7.0f} ms  -> viewer is {med(naive) / med(table):.1f}x faster"
    )
    print(
        f"token view ({args.tokens} tokens), first paint: {med(tokens):7.0f} ms (median of {len(tokens)}; first {tokens[0]:.0f}, max {max(tokens):.0f})"
    )
    print(
        f"  raw episode JSON opened in the browser: {med(raw):7.0f} ms  -> viewer / raw = {med(tokens) / med(raw):.1f}x"
    )
    target = max(med(table), med(tokens)) < 1000
    print(f"target (< 1 s each): {'met' if target else 'MISSED'}")
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
