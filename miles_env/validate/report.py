"""The registration gate's report: one result per stage, rendered as one page of text or JSON.

Concept: `env validate` runs five stages in order (schema, oracle, nop, determinism, train);
each yields a `StageResult` (passed, a one-line summary, the problems found, one per line).
A stage that could not run (the environment did not load) or was skipped (`--quick` skips
only `train`) says so. The report passes only if every stage that ran passed and only
`train` was skipped, and only on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["STAGES", "StageResult", "ValidationReport"]

STAGES = ("schema", "oracle", "nop", "determinism", "train")
_MAX_PROBLEMS_SHOWN = 12  # one page: the JSON report keeps them all


@dataclass(frozen=True, slots=True)
class StageResult:
    name: str  # one of STAGES
    passed: bool
    summary: str
    problems: tuple[str, ...] = ()
    skipped: bool = False  # not run: `--quick` (train) or an earlier stage made it impossible
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "skipped": self.skipped,
            "summary": self.summary,
            "problems": list(self.problems),
            "duration_s": round(self.duration_s, 3),
        }


@dataclass(frozen=True, slots=True)
class ValidationReport:
    env: str
    provider: str
    distribution: dict[str, str] = field(default_factory=dict)  # {name, version} of the env's package
    n_tasks: int = 0
    stages: tuple[StageResult, ...] = ()
    quick: bool = False

    @property
    def passed(self) -> bool:
        ran = [s for s in self.stages if not s.skipped]
        skipped_ok = all(s.name == "train" and self.quick for s in self.stages if s.skipped)
        return bool(ran) and all(s.passed for s in ran) and skipped_ok

    def stage(self, name: str) -> StageResult:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "provider": self.provider,
            "distribution": dict(self.distribution),
            "n_tasks": self.n_tasks,
            "quick": self.quick,
            "passed": self.passed,
            "stages": [s.to_dict() for s in self.stages],
        }

    def render(self) -> str:
        dist = f"{self.distribution.get('name', '?')} {self.distribution.get('version', '?')}"
        lines = [f"env validate {self.env}  ({dist}; {self.n_tasks} tasks; provider {self.provider})", ""]
        for s in self.stages:
            mark = "SKIP" if s.skipped else ("PASS" if s.passed else "FAIL")
            lines.append(f"  {mark:4}  {s.name:<12} {s.summary}  [{s.duration_s:.1f}s]")
            for p in s.problems[:_MAX_PROBLEMS_SHOWN]:
                lines.append("          - " + p.replace("\n", "\n            "))
            if len(s.problems) > _MAX_PROBLEMS_SHOWN:
                lines.append(
                    f"          ... and {len(s.problems) - _MAX_PROBLEMS_SHOWN} more (--report PATH)"
                )
        lines += ["", "PASSED: the environment may be registered" if self.passed else "FAILED"]
        return "\n".join(lines)
