"""The eval section's own models: which mode, and the external evaluator's settings.

Concept: `eval.mode` picks one of three evaluators (miles_env/evals/): `shared` runs the eval
episodes on the rollout engines, `dedicated` on an engine of its own, `external` hands each
exported checkpoint to a user command or URL. `ExternalEvalConfig` is what crosses to that
evaluator: a command (argv, or one string split like a shell would) or a URL, never both, and
the time it may take. Invariant: pydantic and stdlib only; the run config imports this module,
never an evaluator.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["EvalMode", "ExternalEvalConfig"]

EvalMode = Literal["shared", "dedicated", "external"]


class ExternalEvalConfig(BaseModel):
    """`eval.external`: run `command` or POST to `url` on each exported checkpoint (evals/external.py).

    A command's arguments may hold `{checkpoint}` and `{step}`; without `{checkpoint}` the
    checkpoint's path is appended as the last argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[str] | None = None
    url: str | None = Field(None, pattern=r"^https?://")
    timeout_s: float = Field(600.0, gt=0, description="a command is killed, a request abandoned, after this")
    keep_exports: int = Field(2, ge=1, description="exported checkpoints kept once evaluated (newest)")

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.command is None) == (self.url is None):
            raise ValueError("set exactly one of command and url")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        return self
