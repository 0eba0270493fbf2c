"""What a run costs: per-episode usage and price, per-step cost, and the run's budget.

Concept: every episode records a `Usage` (miles_env/types.py): its sandbox's seconds from the start
of `create()` to the end of `close()`, the price of those seconds by the run's price table, and the
tokens of its samples (prompt tokens of every turn, the cached part of them, sampled tokens).
`RunCost` sums the episodes a run rolled out (each counted once, by id) into the step metrics
`cost_usd` (since the last step), `cost_usd_total`, `cost_per_step_usd` and, once a rollout has
passed, `cost_per_solved_usd` (total / passed episodes); with `cost.budget_usd` set it is
`exhausted` once the total reaches the budget, and the job stops starting rollouts (job/run.py).
Eval episodes count too (`add_eval`, as each one finishes; `eval_usd` is their part of the total,
never a solved task): their spend shows in the next step's `cost_usd`, and once the budget is
spent no eval starts and a resumed run completes no open group (an eval already running finishes).

Prices (USD; `cost.prices.<provider>` in the run config replaces a provider's row): a provider
bills `per_s` for each sandbox-second plus `per_cpu_s` per allocated CPU core and `per_gb_s` per
GiB of allocated memory (the spec's resources: cpus, default 1, and memory_mb). Defaults, read
2026-12-01:
- local, docker, agentenv: 0 (your own machine; agentenv bills by its operator's terms).
- e2b: $0.000014 per vCPU-second (e2b.dev/pricing, as summarized on usagepricing.com/blueprint/e2b)
  and $0.0000045 per GiB-second of RAM (the remainder of E2B's documented example "8 vCPU and
  4 GB RAM costs $0.468 per hour", e2b.dev/docs/billing).
- daytona: $0.000014 per vCPU-second, $0.0000045 per GiB-second (daytona.io/pricing: $0.0504 per
  vCPU-hour, $0.0162 per GiB-hour; the figures as commonly quoted, not re-read from the page).
- modal: $0.00003942 per physical core-second and $0.00000672 per GiB-second (modal.com/pricing:
  sandboxes at 3x the function rates $0.0000131/core-s and $0.00000222/GiB-s, per the beam.cloud
  "Modal pricing explained" article verified 2026-06-27). Modal bills max(request, use).
Cached tokens: the prompt prefix each turn shares with what its branch's previous turn left in the
KV cache (its prompt and completion but the last sampled token, never fed), capped at the prompt
less one token: a per-session prefix cache's hits as the hf and scripted engines count them
(`Generation.cached_tokens`). The first turn of a branch has none; an engine that evicts (SGLang
under memory pressure) may serve fewer, which its step-level `prefix_cache_*` metrics show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_env.types import Episode, Resources, Trajectory, Usage

__all__ = ["Price", "DEFAULT_PRICES", "CostConfig", "token_usage", "episode_usage", "RunCost"]


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    per_s: float = Field(0.0, ge=0, description="USD per sandbox-second")
    per_cpu_s: float = Field(0.0, ge=0, description="USD per allocated CPU core-second")
    per_gb_s: float = Field(0.0, ge=0, description="USD per allocated GiB-second of memory")

    def of(self, seconds: float, resources: Resources) -> float:
        cpus = resources.cpus or 1.0
        gib = resources.memory_mb / 1024
        return seconds * (self.per_s + self.per_cpu_s * cpus + self.per_gb_s * gib)


DEFAULT_PRICES: dict[str, Price] = {
    "local": Price(),
    "docker": Price(),
    "agentenv": Price(),
    "e2b": Price(per_cpu_s=0.000014, per_gb_s=0.0000045),
    "daytona": Price(per_cpu_s=0.000014, per_gb_s=0.0000045),
    "modal": Price(per_cpu_s=0.00003942, per_gb_s=0.00000672),
}


class CostConfig(BaseModel):
    """The run config's `cost:` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prices: dict[str, Price] = Field(default_factory=dict, description="per provider; over DEFAULT_PRICES")
    budget_usd: float | None = Field(None, gt=0, description="stop starting rollouts once spent")

    def price(self, provider: str) -> Price:
        return self.prices.get(provider) or DEFAULT_PRICES.get(provider) or Price()


def token_usage(samples: Sequence[Trajectory]) -> tuple[int, int, int]:
    """(prompt, cached, sampled) tokens over every turn of every sample (branch)."""
    prompt = cached = 0
    for traj in samples:
        held = 0  # tokens in the KV cache after the previous turn: all but its last sampled one
        for turn in traj.turns:
            prompt += turn.prompt_len
            cached += max(0, min(held, turn.prompt_len - 1))  # the last prompt token is always computed
            held = turn.prompt_len + turn.completion_len - 1
    return prompt, cached, sum(t.n_sampled for t in samples)


def episode_usage(
    samples: Sequence[Trajectory], sandbox_s: float, provider: str, resources: Resources, cost: CostConfig
) -> Usage:
    prompt, cached, sampled = token_usage(samples)
    price = cost.price(provider).of(sandbox_s, resources)
    return Usage(
        provider=provider, sandbox_s=sandbox_s, price_usd=price,
        prompt_tokens=prompt, cached_tokens=cached, sampled_tokens=sampled,
    )  # fmt: skip


@dataclass
class RunCost:
    """The run's spend so far (mutable, in the job's process; `state()` rides in every checkpoint)."""

    config: CostConfig = field(default_factory=CostConfig)
    total_usd: float = 0.0
    sandbox_s: float = 0.0
    solved: int = 0
    reported_usd: float = 0.0  # total at the last step report
    eval_usd: float = 0.0  # of total_usd, what eval episodes cost
    _seen: set[str] = field(default_factory=set)

    def add(self, episodes: Iterable[Episode]) -> None:
        """Training rollouts (each counted once): their price, seconds and solved tasks."""
        for ep in self._new(episodes):
            if ep.reward is not None and ep.reward.passed and ep.split != "test":
                self.solved += 1

    def add_eval(self, episodes: Iterable[Episode]) -> None:
        """Eval episodes (each counted once): their price and seconds, in the total and `eval_usd`."""
        for ep in self._new(episodes):
            self.eval_usd += ep.usage.price_usd if ep.usage is not None else 0.0

    def _new(self, episodes: Iterable[Episode]) -> list[Episode]:
        fresh = []
        for ep in episodes:
            if ep.id in self._seen:
                continue
            self._seen.add(ep.id)
            fresh.append(ep)
            if ep.usage is not None:
                self.total_usd += ep.usage.price_usd
                self.sandbox_s += ep.usage.sandbox_s
        return fresh

    @property
    def exhausted(self) -> bool:
        budget = self.config.budget_usd
        return budget is not None and self.total_usd >= budget

    def stop_reason(self) -> str | None:
        if not self.exhausted:
            return None
        return (
            f"cost budget reached: ${self.total_usd:.4f} spent of cost.budget_usd=${self.config.budget_usd:g}"
        )

    def step_metrics(self, step: int, episodes: Sequence[Episode]) -> dict[str, float]:
        """The cost metrics of a step whose trained episodes are `episodes` (counted if new)."""
        self.add(episodes)
        usages = [ep.usage for ep in episodes if ep.usage is not None]
        out = {
            "cost_usd": self.total_usd - self.reported_usd,
            "cost_usd_total": self.total_usd,
            "cost_per_step_usd": self.total_usd / max(1, step),
            "cost_eval_usd_total": self.eval_usd,
            "sandbox_s": sum(u.sandbox_s for u in usages),
            "prompt_tokens": float(sum(u.prompt_tokens for u in usages)),
            "cached_tokens": float(sum(u.cached_tokens for u in usages)),
        }
        if self.solved:
            out["cost_per_solved_usd"] = self.total_usd / self.solved
        self.reported_usd = self.total_usd
        return out

    def summary(self, steps: int) -> dict[str, float | None]:
        """The run's cost report (summary.json's `cost`): None per solved task while none is solved."""
        return {
            "total_usd": self.total_usd,
            "per_step_usd": self.total_usd / max(1, steps),
            "per_solved_usd": self.total_usd / self.solved if self.solved else None,
            "eval_usd": self.eval_usd,
            "sandbox_s": self.sandbox_s,
            "solved": float(self.solved),
        }

    def report_line(self, steps: int) -> str:
        per_solved = f"${self.total_usd / self.solved:.4f}" if self.solved else "n/a (none solved)"
        return (
            f"cost: ${self.total_usd:.4f} in {steps} steps (${self.total_usd / max(1, steps):.4f} a step, "
            f"{per_solved} a solved task; ${self.eval_usd:.4f} of it in evals), {self.sandbox_s:.0f} sandbox-seconds"
        )

    def state(self) -> dict[str, float]:
        return {
            "total_usd": self.total_usd,
            "eval_usd": self.eval_usd,
            "sandbox_s": self.sandbox_s,
            "solved": float(self.solved),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.total_usd = self.reported_usd = float(state.get("total_usd", 0.0))
        self.eval_usd = float(state.get("eval_usd", 0.0))
        self.sandbox_s = float(state.get("sandbox_s", 0.0))
        self.solved = int(state.get("solved", 0))
