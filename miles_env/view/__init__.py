"""`miles-env view RUN_DIR`: a local, read-only web viewer of a training run, an eval output or a
proxy store, updating live while `miles-env train` writes to the same directory.

Concept: a Starlette app (app.py) over readers of the files other commands write (layout.py,
metrics.py, index.py, sessions.py, detail.py) and a single static page shipped in the package
(static/: plain JavaScript and SVG, nothing from a CDN). The viewer never writes into the
directory: SQLite is opened `mode=ro`, journals are read as bytes. Token ids are shown as stored;
text is decoded from them with the run's tokenizer for display only (tokens.py).

Lifecycle: `serve(root, port)` detects the layout, starts loading the tokenizer in the background
and serves on loopback until interrupted; every page poll refreshes what changed on disk.
"""

from __future__ import annotations

import threading
from pathlib import Path

from miles_env.view.app import Run, create_app
from miles_env.view.layout import Kind, Layout, detect

__all__ = ["Run", "create_app", "detect", "Kind", "Layout", "open_run"]


def open_run(root: Path, model: str | None = None, *, preload: bool = True) -> Run:
    """The viewer's state for `root`. `model` names the tokenizer (default: config.yaml's engine.model);
    `preload` loads it in a background thread so the first token view does not wait for it."""
    layout = detect(root)
    if model is None:
        engine = layout.config().get("engine") or {}
        model = (
            str(engine["model"])
            if engine.get("model")
            else ("smollm2" if layout.kind is not Kind.TRAIN else None)
        )
    run = Run(layout, model)
    run.refresh(0.0)
    if preload and model:
        threading.Thread(target=run.pieces.pieces, args=([0],), daemon=True, name="view-tokenizer").start()
    return run
