"""Core value types shared by every layer.

Anything that crosses a process or HTTP boundary (tasks, episodes, rewards) is a
pydantic model; in-process results (ExecResult) are frozen slotted dataclasses.

Invariant of a Trajectory: token_ids, loss_mask and logprobs have one entry per
token; loss_mask is 1 exactly on tokens the engine sampled, and logprobs is 0.0
wherever loss_mask is 0. Token ids are recorded once and never re-derived from text.
A mixture-of-experts rollout may also carry `routed_experts` (RoutedExperts): the experts each
layer routed every mask-1 token's producing position to, packed, one row per mask-1 token.
"""

from __future__ import annotations

import base64
import enum
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "Status",
    "EpisodeEnd",
    "POLICY_ENDS",
    "end_of_status",
    "NetworkPolicy",
    "Resources",
    "SandboxSpec",
    "Task",
    "Reward",
    "ExecResult",
    "Turn",
    "RoutedExperts",
    "Trajectory",
    "Episode",
    "Usage",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Status(enum.StrEnum):
    COMPLETED = "completed"  # the harness finished on its own
    TRUNCATED = "truncated"  # a budget (turns, tokens, context, wall time) ended it
    ABORTED = "aborted"  # the engine or the harness process died or hung
    FAILED = "failed"  # infrastructure error (sandbox, verifier, adapter)


class EpisodeEnd(enum.StrEnum):
    """Why an episode ended, decided where the ending was raised, never read from a message: the
    rollout's phase (sandbox start, harness, verify), a typed error's own class (`MilesEnvError.end`),
    the harness's result (`HarnessResult.end`) or the proxy's record of the session's last request
    (`SessionInfo.fault`). Policy ends (`POLICY_ENDS`) keep their score and train; every other class
    is an infrastructure failure and never trains (trainer/samples.py)."""

    # -- policy ends: what the agent did --
    COMPLETED = "completed"  # the harness finished on its own
    TRUNCATED = "truncated"  # the agent's own budget ended it: turns, tokens, context, wall time
    POLICY_FORMAT = "policy_format"  # the harness exited on the model's output (issue 31 sets it)
    # -- infrastructure: what the policy did not cause --
    SANDBOX_START = "sandbox_start"  # create or the environment's setup failed: no agent ran
    SANDBOX_LOST = "sandbox_lost"  # the sandbox broke under a running episode (SandboxError)
    HARNESS_CRASH = "harness_crash"  # the harness (a CLI, an agent loop) crashed or exited abnormally
    ADAPTER_WORKER = "adapter_worker"  # a framework adapter's worker process died or broke protocol
    VERIFIER_ERROR = "verifier_error"  # verify() (or a framework's grader) raised
    VERIFIER_TIMEOUT = "verifier_timeout"  # verify() ran past the verifier timeout
    ENGINE_ERROR = "engine_error"  # the engine failed a turn (died, restarted, unreachable)
    PROXY_REFUSAL = "proxy_refusal"  # the proxy refused a request for a reason that is no budget
    # The honest default: the episode failed and no layer said why (an unexpected exception in the
    # rollout's own code, or an episode stored before these classes existed). Never trains: nothing
    # shows the policy caused it.
    UNCLASSIFIED = "unclassified"

    @property
    def policy(self) -> bool:
        """Whether this is one of the default policy ends (a run may count others: trainer config)."""
        return self in POLICY_ENDS


POLICY_ENDS: frozenset[EpisodeEnd] = frozenset(
    {EpisodeEnd.COMPLETED, EpisodeEnd.TRUNCATED, EpisodeEnd.POLICY_FORMAT}
)
_END_OF_STATUS = {"completed": EpisodeEnd.COMPLETED, "truncated": EpisodeEnd.TRUNCATED}


def end_of_status(status: str) -> EpisodeEnd:
    """The class of an Episode stored without `end` (before the classes existed): completed and
    truncated say it; aborted and failed said nothing of why (UNCLASSIFIED: never trained)."""
    return _END_OF_STATUS.get(status, EpisodeEnd.UNCLASSIFIED)


class NetworkPolicy(enum.StrEnum):
    """A sandbox's network, from the strictest: a run's `rollout.limits.network` may only move a
    task's policy up this list (miles_env/limits.py)."""

    NONE = "none"  # no network at all; the model endpoint arrives through expose()
    # Outbound TCP/UDP and DNS to the outside, as a container on a bridge has; never the host's
    # own loopback (its 127.0.0.1 services: the TITO proxy, Redis, the image registry). What a
    # task asks for with Harbor's `allow_internet = true` / `network_mode = "public"`.
    PUBLIC = "public"
    HOST = "host"  # share the host's own network namespace, its loopback included (debugging only)


class Resources(_Model):
    """Limits applied to every process in a sandbox."""

    memory_mb: int = Field(1024, gt=0)
    max_procs: int = Field(256, gt=0)
    cpu_seconds: int = Field(120, gt=0)
    output_bytes: int = Field(1 << 20, gt=0, description="per stream, per exec")
    timeout_s: float = Field(60.0, gt=0, description="default wall-clock limit per exec")
    disk_mb: int = Field(512, gt=0, description="largest file a process may write")
    # The task's own limits (miles_env/limits.py tightens them by the run's override): None keeps
    # the provider's default (docker's config.cpus, no quota locally) and the run's timeouts.
    cpus: float | None = Field(None, gt=0, description="CPU quota in cores; None = the provider's default")
    agent_timeout_s: float | None = Field(
        None, gt=0, description="wall time of the agent phase; None = the run's rollout.episode_timeout_s"
    )
    verifier_timeout_s: float | None = Field(
        None, gt=0, description="wall time of verify(); None = the run's default (600 s)"
    )


class SandboxSpec(_Model):
    """What a sandbox must look like before the episode starts."""

    image: str | None = None  # container image (docker and cloud providers)
    # A Docker build context (a directory with a Dockerfile) for when `image` is None: the docker
    # provider builds it offline (cached by content); providers that cannot build ignore it.
    build: str | None = None
    rootfs: str | None = None  # host directory used as / (local provider); None = host /usr
    files: dict[str, str] = Field(default_factory=dict)  # path (relative to workdir or absolute) -> text
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/workspace"
    resources: Resources = Field(default_factory=Resources)
    network: NetworkPolicy = NetworkPolicy.NONE


class Task(_Model):
    id: str = Field(min_length=1)
    env: str = Field(min_length=1)
    instruction: str = Field(min_length=1)
    split: str = "train"
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    verifier: dict[str, Any] = Field(default_factory=dict)  # data the environment's verify() reads
    solution: str | None = None  # reference shell solution (oracle)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Reward(_Model):
    score: float
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.score >= 1.0


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int  # -N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_by_limit: str | None = None  # "memory" | "procs" | "cpu" | "output" | "disk"
    truncated: bool = False  # output was cut at the output limit
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_by_limit is None


class Turn(_Model):
    """One engine generation inside a trajectory."""

    start: int = Field(ge=0, description="offset of the first completion token in token_ids")
    prompt_len: int = Field(ge=0)
    completion_len: int = Field(ge=0)
    finish_reason: str
    weight_version: int = 0
    latency_s: float = 0.0
    engine: str = ""
    # False: the agent never received this turn's reply, or asked for it again (tito/session.py);
    # its tokens have mask 0 and it never trains, nor counts in the sample's weight versions
    delivered: bool = True


class RoutedExperts(_Model):
    """A MoE engine's routing record: for each of `tokens` sampled tokens, the top-k experts (sorted)
    each layer routed the position that produced it to (position i - 1 for the token at i: the
    engine's `Generation.meta["routed_experts"]`, [tokens][layers][k]). Packed, as its size is
    tokens x layers x k: `data` is the ids as uint8 (uint16 little-endian when `itemsize` is 2,
    more than 256 experts), base64, so every JSON form (journal, export, episode) carries it as is."""

    layers: int = Field(ge=1)
    top_k: int = Field(ge=1)
    itemsize: int = Field(1, ge=1, le=2)
    data: str

    @model_validator(mode="after")
    def _whole(self) -> RoutedExperts:
        row = self.layers * self.top_k * self.itemsize
        try:
            n = len(base64.b64decode(self.data, validate=True))
        except ValueError:
            raise ValueError("routed_experts.data: not base64") from None
        if n % row:
            raise ValueError(f"routed_experts.data: {n} bytes is no whole number of {row}-byte rows")
        return self

    @property
    def tokens(self) -> int:
        nbytes = len(self.data) * 3 // 4 - self.data[-2:].count("=")
        return nbytes // (self.layers * self.top_k * self.itemsize)

    def raw(self) -> bytes:
        return base64.b64decode(self.data)

    @classmethod
    def from_raw(cls, raw: bytes, layers: int, top_k: int, itemsize: int = 1) -> RoutedExperts:
        return cls(layers=layers, top_k=top_k, itemsize=itemsize, data=base64.b64encode(raw).decode())

    @classmethod
    def pack(cls, rows: list[list[list[int]]]) -> RoutedExperts:
        """From [tokens][layers][k] expert ids (at least one token, every row the same shape)."""
        layers, k = len(rows[0]), len(rows[0][0])
        flat = [e for tok in rows for layer in tok for e in layer]
        if len(flat) != len(rows) * layers * k:
            raise ValueError(f"routed_experts: rows differ in shape (the first is {layers} layers x {k})")
        ids = array("H" if max(flat) > 255 else "B", flat)
        if ids.itemsize == 2 and sys.byteorder == "big":
            ids.byteswap()
        return cls.from_raw(ids.tobytes(), layers, k, ids.itemsize)

    def ids(self) -> list[int]:
        """The expert ids, flat: token after token, layer after layer, k each."""
        ids = array("H" if self.itemsize == 2 else "B", self.raw())
        if self.itemsize == 2 and sys.byteorder == "big":
            ids.byteswap()
        return ids.tolist()

    def rows(self) -> list[list[list[int]]]:
        """Inverse of `pack`: [tokens][layers][k]."""
        flat, k, per = self.ids(), self.top_k, self.layers * self.top_k
        return [[flat[t + j : t + j + k] for j in range(0, per, k)] for t in range(0, len(flat), per)]

    @classmethod
    def concat(cls, parts: list[RoutedExperts]) -> RoutedExperts:
        """The records one after the other (same layers and k; the wider ids' itemsize)."""
        first = parts[0]
        if any((p.layers, p.top_k) != (first.layers, first.top_k) for p in parts):
            raise ValueError("routed_experts: records of different layers or top_k")
        if all(p.itemsize == first.itemsize for p in parts):
            return cls.from_raw(b"".join(p.raw() for p in parts), first.layers, first.top_k, first.itemsize)
        return cls.pack([row for p in parts for row in p.rows()])


class Trajectory(_Model):
    """One training sample: a branch of a session's token history."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[Turn] = Field(default_factory=list)
    branch: int = 0
    # on-policy distillation (miles_env/opd.py): the teacher's logprob of each token, 0.0 where
    # loss_mask is 0; None when no teacher scored it
    teacher_logprobs: list[float] | None = None
    # MoE: the engine's routing of every token with loss_mask 1, in order (RoutedExperts); None when
    # the engine gave none, or not for every one of them. Prompt and tool tokens carry none.
    routed_experts: RoutedExperts | None = None

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory lengths differ: token_ids={n} loss_mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)}"
            )
        if self.teacher_logprobs is not None:
            if len(self.teacher_logprobs) != n:
                raise ValueError(f"teacher_logprobs has {len(self.teacher_logprobs)} entries: must be {n}")
            for i, (m, t) in enumerate(zip(self.loss_mask, self.teacher_logprobs, strict=True)):
                if m == 0 and t != 0.0:
                    raise ValueError(f"teacher_logprobs[{i}]={t} where loss_mask is 0: must be 0.0")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.logprobs, strict=True)):
            if m not in (0, 1):
                raise ValueError(f"loss_mask[{i}]={m}: must be 0 or 1")
            if m == 0 and lp != 0.0:
                raise ValueError(f"logprobs[{i}]={lp} where loss_mask is 0: must be 0.0")
        if self.routed_experts is not None and self.routed_experts.tokens != sum(self.loss_mask):
            raise ValueError(
                f"routed_experts has {self.routed_experts.tokens} tokens: must be {sum(self.loss_mask)}, "
                "one per token with loss_mask 1"
            )
        return self

    @property
    def weight_versions(self) -> list[int]:
        """The versions of the turns the agent received (the ones that can train)."""
        return [t.weight_version for t in self.turns if t.delivered]

    @property
    def n_sampled(self) -> int:
        return sum(self.loss_mask)


class Usage(_Model):
    """What one episode used and cost (miles_env/cost.py fills it): the sandbox's life from create
    to close, its price by the run's price table, and the tokens of every turn of its samples."""

    provider: str = ""
    sandbox_s: float = Field(0.0, ge=0)
    price_usd: float = Field(0.0, ge=0)
    prompt_tokens: int = Field(0, ge=0, description="prompt tokens of every turn (each turn's whole prompt)")
    cached_tokens: int = Field(0, ge=0, description="of prompt_tokens, the prefix already in the session")
    sampled_tokens: int = Field(0, ge=0)


class Episode(_Model):
    id: str
    task_id: str
    env: str
    group_id: str  # episodes of one GRPO group share it
    split: str = "train"
    harness: str = "builtin"
    status: Status
    end: EpisodeEnd = EpisodeEnd.UNCLASSIFIED  # why it ended; unset: derived from status (below)
    reward: Reward | None = None
    samples: list[Trajectory] = Field(default_factory=list)
    error: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # reward-hacking flags raised by miles_env.guards (test_edit, git_history, package_install);
    # their evidence is metadata["guards"]
    flags: list[str] = Field(default_factory=list)
    usage: Usage | None = None  # sandbox-seconds, price and tokens (miles_env/cost.py)

    @model_validator(mode="before")
    @classmethod
    def _end_from_status(cls, data: Any) -> Any:
        """An Episode built (or stored) without `end`: completed and truncated say it; aborted and
        failed said nothing of why, so they are UNCLASSIFIED (infrastructure: never trained)."""
        if isinstance(data, dict) and data.get("end") is None and "status" in data:
            return {**data, "end": end_of_status(str(data["status"]))}
        return data

    @property
    def score(self) -> float:
        return self.reward.score if self.reward is not None else 0.0

    @property
    def min_weight_version(self) -> int:
        versions = [v for s in self.samples for v in s.weight_versions]
        return min(versions) if versions else 0

    @property
    def sampled(self) -> bool:
        """Whether the policy sampled any turn the agent received (an episode aborted before its
        first turn did not; one whose only turn never reached the agent did not either)."""
        return any(s.weight_versions for s in self.samples)
