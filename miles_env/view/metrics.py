"""metrics.jsonl as the run page reads it: every row, read incrementally while `train` appends.

Each call to `refresh()` reads from the byte offset reached last time up to the last complete
line (a line being appended is read next time), so polling a live run re-reads nothing. Rows are
the RunLog's (runlog.py): `{"step", "kind": "train" | "eval", "time", **metrics}`, strict JSON.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Read new complete lines; True when rows were added."""
        with self._lock:
            try:
                size = self.path.stat().st_size
            except OSError:
                return False
            if size < self._offset:  # replaced (a new run in the same directory): read it again
                self.rows, self._offset = [], 0
            if size == self._offset:
                return False
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read(size - self._offset)
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                if line.strip():
                    row = json.loads(line)
                    row["step"] = int(row.get("step", 0))
                    self.rows.append(row)
            self._offset += end
            return end > 0

    def since(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.rows[n:]

    def train_times(self) -> list[tuple[float, int]]:
        """(time logged, step) of every train row, in order."""
        with self._lock:
            return [(float(r.get("time", 0.0)), r["step"]) for r in self.rows if r.get("kind") == "train"]
