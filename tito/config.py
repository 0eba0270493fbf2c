"""Typed configuration of the TITO proxy and per-session budgets.

`TitoConfig` is the component config (one per proxy); `Budget` is what a session
may spend. A session's budget is the config default overridden field by field by
the one given at `create_session`; `None` means unlimited. Request bodies are
bounded per route (`max_body_bytes`, overridden by name in `route_body_bytes`) and
in time (`body_timeout_s`). `tool_parser` / `reasoning_parser` name the completion parsers
(tito/parsers/); "auto" picks them from the chat template.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from miles_env.tito.parsers import check_name

__all__ = ["Budget", "TitoConfig", "Route"]

# the routes that take a body, by name (app.py)
Route = Literal["chat_completions", "responses", "messages", "count_tokens", "admin"]


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int | None = Field(default=None, ge=1, description="engine generations per session")
    max_tokens: int | None = Field(default=None, ge=1, description="sampled tokens per session, all branches")
    max_context: int | None = Field(default=None, ge=2, description="prompt + completion tokens per request")
    wall_time_s: float | None = Field(default=None, gt=0, description="seconds since the session was created")

    def merged(self, override: Budget | None) -> Budget:
        if override is None:
            return self
        data = self.model_dump()
        data.update(override.model_dump(exclude_unset=True))
        return Budget(**data)


def _route_defaults() -> dict[Route, int]:
    return {"admin": 2**20}


class TitoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = "policy"  # what /v1/models lists and responses echo when a client sends none
    default_max_tokens: int = Field(1024, ge=1)  # when a request gives no max_tokens
    budget: Budget = Budget()
    admin_token: str | None = None  # None: the admin HTTP API refuses every call
    # "auto": the chat template's own `tools` support when it has one, else the text-action fallback
    tool_mode: Literal["auto", "template", "text"] = "auto"
    stop_token: str | None = "<|im_end|>"  # the end-of-turn token; falls back to tokenizer.eos_token
    # completion parsers (tito/parsers/): "auto" reads the chat template's family markers
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    # which branches `export` returns: every one, the one with most ids, or the newest
    branch_policy: Literal["all", "longest", "last"] = "all"
    # request bodies: bytes per route (a 413 in the route's dialect), and seconds to arrive (408)
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    route_body_bytes: dict[Route, int] = Field(default_factory=_route_defaults)
    body_timeout_s: float = Field(60.0, gt=0)

    @field_validator("tool_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, name: str, info: ValidationInfo) -> str:
        return check_name(str(info.field_name), name)

    def body_limit(self, route: Route) -> int:
        return self.route_body_bytes.get(route, self.max_body_bytes)
