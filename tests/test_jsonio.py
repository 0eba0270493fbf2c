"""Strict JSON (issue 14): every JSON file miles-env writes parses without NaN/Infinity tokens.

jq, JavaScript and most JSON parsers refuse `NaN` and `Infinity`; Python writes them by default.
A non-finite number is written as null.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NONFINITE = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf}


def strict_loads(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_writes_nonfinite_as_null(tmp_path: Path) -> None:
    from miles_env.runlog import RunLog, read_metrics

    log = RunLog(tmp_path, tensorboard=False)
    log.log(
        1, "train", {"reward_mean": 0.5, "kl": math.nan, "grad_norm": math.inf, "nested": [-math.inf, 1.0]}
    )
    log.close()
    (row,) = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["kl"] is None and row["grad_norm"] is None and row["nested"] == [None, 1.0]
    assert row["reward_mean"] == 0.5 and read_metrics(tmp_path / "metrics.jsonl")[0]["kl"] is None


def test_checkpoint_json_is_strict(tmp_path: Path) -> None:
    from miles_env.trainer.checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path, 3, {}, {"loss": math.nan, "episode_ids": ["a"]}, keep=2)
    meta = strict_loads((path / "trainer.json").read_text())
    assert meta == {"step": 3, "loss": None, "episode_ids": ["a"]}


@pytest.mark.parametrize("value", list(NONFINITE.values()), ids=list(NONFINITE))
def test_dumps_replaces_nonfinite_everywhere(value: float) -> None:
    import numpy as np

    from miles_env.jsonio import dumps

    class Scalar:  # a tensor-like value, reached through `default`
        def __float__(self) -> float:
            return value

    obj = {"a": value, "b": [value, (value, 2)], "c": {"d": np.float64(value)}, "e": Scalar(), "ok": 1.5}
    assert strict_loads(dumps(obj, default=float)) == {
        "a": None,
        "b": [None, [None, 2]],
        "c": {"d": None},
        "e": None,
        "ok": 1.5,
    }


def test_write_json_is_strict_and_atomic(tmp_path: Path) -> None:
    from miles_env.jsonio import write_json

    path = tmp_path / "summary.json"
    write_json(path, {"mean_reward": math.nan, "steps": 2})
    assert strict_loads(path.read_text()) == {"mean_reward": None, "steps": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


# Writers of JSON files in scope of issue 14 (tito/, engines/ and sandboxes/ keep their own). A
# `json.dump`/`json.dumps` call elsewhere must go through miles_env.jsonio, or be listed here with
# why it cannot carry a non-finite float.
_SCANNED = [
    "miles_env/*.py",
    "miles_env/cli/*.py",
    "miles_env/queue/*.py",
    "miles_env/job/*.py",
    "trainer/*.py",
]
_ALLOWED = {
    ("miles_env/jsonio.py", "dumps"): "the helper itself",
    ("miles_env/queue/codec.py", "dumps"): "queue storage: lossless round trip of an Episode, not a file",
    ("miles_env/queue/sqlite.py", "dumps"): "a list of episode ids bound as an SQL parameter",
    ("trainer/weight_delta.py", "dumps"): "a CRC over names and shapes, never written",
}


def test_json_writers_go_through_the_strict_helper() -> None:
    offenders = []
    for pattern in _SCANNED:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "json"
                    and node.func.attr in ("dump", "dumps")
                    and (rel, node.func.attr) not in _ALLOWED
                ):
                    offenders.append(f"{rel}:{node.lineno} json.{node.func.attr}")
    assert offenders == [], "write JSON with miles_env.jsonio (strict: NaN/Infinity -> null)"
