"""Typed configuration of the TITO proxy and per-session budgets.

`TitoConfig` is the component config (one per proxy); `Budget` is what a session
may spend. A session's budget is the config default overridden field by field by
the one given at `create_session`; `None` means unlimited.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Budget", "TitoConfig"]


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


class TitoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = "policy"  # what /v1/models lists and responses echo when a client sends none
    default_max_tokens: int = Field(1024, ge=1)  # when a request gives no max_tokens
    budget: Budget = Budget()
    admin_token: str | None = None  # None: the admin HTTP API refuses every call
    # "auto": the chat template's own `tools` support when it has one, else the text-action fallback
    tool_mode: Literal["auto", "template", "text"] = "auto"
    stop_token: str | None = "<|im_end|>"  # the end-of-turn token; falls back to tokenizer.eos_token
    # which branches `export` returns: every one, the one with most ids, or the newest
    branch_policy: Literal["all", "longest", "last"] = "all"
