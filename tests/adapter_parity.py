"""Parity with each framework's own runner: our reward vs the framework's, on the same rollout.

`framework_score(framework, script, payload)` runs `tests/parity/<script>` with the framework
venv's own interpreter (outside our worker and our agent loop), the rollout's recorded reply
and the task's data as a JSON file in, the framework's own score as a JSON file out (no pipes:
a child never blocks on an unread one). `reply_text(episode, tokenizer)` is what the model
actually said in an episode: its sampled tokens, decoded.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from miles_env.adapters.venv import venv_python
from miles_env.adapters.worker_client import WORKERS_DIR

__all__ = ["framework_score", "reply_text"]

PARITY_DIR = Path(__file__).resolve().parent / "parity"


def framework_score(
    framework: str, script: str, payload: dict[str, Any], timeout: float = 300
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="miles-parity-") as tmp:
        src, dst, log = Path(tmp, "in.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        src.write_text(json.dumps(payload))
        with log.open("wb") as out:
            rc = subprocess.run(
                [str(venv_python(framework)), str(PARITY_DIR / script), str(src), str(dst)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout,
                env={"PYTHONPATH": str(WORKERS_DIR), "HUD_TELEMETRY_ENABLED": "false", "PATH": "/usr/bin:/bin"},
            ).returncode  # fmt: skip
        assert rc == 0, f"{script} exited {rc}: {log.read_text()[-3000:]}"
        return json.loads(dst.read_text())  # type: ignore[no-any-return]


def reply_text(episode: Any, tokenizer: Any) -> str:
    ids = [t for s in episode.samples for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()
