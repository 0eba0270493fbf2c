"""The viewer's HTTP app: a static single-page app and a small read-only JSON API.

Routes (all GET): `/` the page, `/static/*` its assets (shipped in the package: no CDN, works
offline), `/api/run` what the directory is, `/api/live` the change counters the page polls (it
refreshes the metrics and the episode index, at most twice a second), `/api/metrics?since=N`,
`/api/episodes` one filtered, sorted page of the table, `/api/episodes/{id}`,
`/api/episodes/{id}/tokens/{k}` sample k's tokens, `/api/groups/{id}`.

Reading files and SQLite runs in worker threads, never on the event loop; nothing is written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from miles_env.jsonio import dumps
from miles_env.view.detail import Details, NotFound
from miles_env.view.index import EpisodeIndex
from miles_env.view.layout import Layout
from miles_env.view.metrics import MetricsLog
from miles_env.view.tokens import Pieces

__all__ = ["create_app", "Run"]

STATIC = Path(__file__).with_name("static")
_FILTERS = ("q", "status", "end", "split", "state", "group", "task", "step", "passed", "flag")


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content, default=str, separators=(",", ":")).encode()


class Run:
    """Everything the app reads from one directory."""

    def __init__(self, layout: Layout, model: str | None) -> None:
        self.layout = layout
        self.metrics = MetricsLog(layout.metrics)
        self.index = EpisodeIndex(layout, self.metrics)
        self.pieces = Pieces(model)
        self.details = Details(layout, self.index, self.pieces)
        self._refreshed = 0.0

    def refresh(self, min_interval: float = 0.5) -> None:
        now = time.monotonic()
        if now - self._refreshed < min_interval:
            return
        self._refreshed = now
        self.metrics.refresh()
        self.index.refresh()

    def info(self) -> dict[str, Any]:
        cfg = self.layout.config()
        return {
            "root": str(self.layout.root),
            "kind": self.layout.kind.value,
            "model": self.pieces.model,
            "config": cfg,
            "summary": _summary(self.layout.root / "summary.json"),
            "facets": self.index.facets(),
        }


def _summary(path: Path) -> dict[str, Any] | None:
    """summary.json of a finished train or eval (None while it runs, or for a proxy store)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def create_app(run: Run) -> Starlette:
    async def thread(fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args)

    async def page(_: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def info(_: Request) -> Response:
        await thread(run.refresh)
        return _Json(run.info())

    async def live(_: Request) -> Response:
        await thread(run.refresh)
        return _Json(
            {"metrics": len(run.metrics.rows), "episodes": len(run.index.rows), "changes": run.index.changes}
        )

    async def metrics(request: Request) -> Response:
        since = int(request.query_params.get("since", "0"))
        return _Json({"since": since, "rows": run.metrics.since(since)})

    async def episodes(request: Request) -> Response:
        q = request.query_params
        filters = {k: q[k] for k in _FILTERS if q.get(k)}
        offset, limit = max(0, int(q.get("offset", "0"))), min(500, max(1, int(q.get("limit", "100"))))
        result = await thread(
            lambda: run.index.page(
                offset=offset, limit=limit, sort=q.get("sort", ""), desc=q.get("desc") == "1", filters=filters
            )  # fmt: skip
        )
        return _Json({"total": result.total, "offset": offset, "rows": result.rows})

    async def episode(request: Request) -> Response:
        return _Json(await thread(run.details.episode, request.path_params["eid"]))

    async def tokens(request: Request) -> Response:
        p = request.path_params
        return _Json(await thread(run.details.tokens, p["eid"], int(p["k"])))

    async def group(request: Request) -> Response:
        return _Json(await thread(run.details.group, request.path_params["gid"]))

    async def not_found(_: Request, exc: Exception) -> Response:
        return _Json({"error": str(exc)}, status_code=404)

    async def bad(_: Request, exc: Exception) -> Response:
        return _Json({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)

    routes = [
        Route("/", page),
        Route("/api/run", info),
        Route("/api/live", live),
        Route("/api/metrics", metrics),
        Route("/api/episodes", episodes),
        Route("/api/episodes/{eid}", episode),
        Route("/api/episodes/{eid}/tokens/{k:int}", tokens),
        Route("/api/groups/{gid:path}", group),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={NotFound: not_found, ValueError: bad})
