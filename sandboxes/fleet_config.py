"""The run config's `fleet:` section and the retry policy for sandbox creation (pydantic and stdlib
only: the run config imports this module, never the fleet's implementation).

`create_rate_per_s` and `burst` are one token bucket shared by every process creating sandboxes of
one provider on this machine (a locked file) or, with `redis_url`, by every rollout worker of every
machine using that Redis; `max_starting` caps this process's creations in flight (the "starting"
sandboxes a provider is still booting); `start_timeout_s` fails a creation stuck starting;
`retry` retries a provider's rate-limit refusals with full-jitter exponential backoff;
`warm_pool` keeps that many ready sandboxes per distinct spec (sandboxes/pool.py).
"""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RetryPolicy", "FleetConfig"]


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(6, ge=1, description="tries in all, the first included")
    base_s: float = Field(0.5, gt=0)
    max_s: float = Field(30.0, gt=0)
    multiplier: float = Field(2.0, ge=1)

    def delay(
        self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Full jitter: uniform in [0, min(max, base * mult**attempt)], at least the backend's hint."""
        ceiling = min(self.max_s, self.base_s * self.multiplier**attempt)
        return max((rng or random).uniform(0, ceiling), retry_after or 0.0)


class FleetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    create_rate_per_s: float | None = Field(
        None, gt=0, description="sandbox creations per second, all processes together; None: no limit"
    )
    burst: int = Field(4, ge=1, description="creations allowed at once after an idle spell")
    max_starting: int | None = Field(32, ge=1, description="creations in flight in this process")
    start_timeout_s: float | None = Field(
        None, gt=0, description="a creation not done by then fails its episode (stuck 'starting')"
    )
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    warm_pool: int = Field(0, ge=0, description="ready sandboxes kept per distinct sandbox spec")
    bucket_dir: Path | None = Field(
        None, description="where the machine-wide bucket file lives; None: $MILES_ENV_CACHE/fleet"
    )
    redis_url: str | None = Field(
        None, description="share the bucket through this Redis (the job sets the run's queue url)"
    )
