"""Where an episode's end class (`EpisodeEnd`) is decided: by the phase that raised, and by the error.

Concept: a rollout runs in phases: `sandbox` (create and the environment's setup: the agent never
started), `harness` (the agent's run), `verify` (guards and the verifier). An exception raised in
the `sandbox` phase is SANDBOX_START whatever it is (the sandbox never became ready); in a later
phase a typed error's own class wins (`MilesEnvError.end`: a SandboxError is SANDBOX_LOST, an
EngineError ENGINE_ERROR), else the phase's class (HARNESS_CRASH, VERIFIER_ERROR). Nothing here
reads an error's message. A harness that returns instead of raising says how it ended
(`HarnessResult.end`, else its status); the proxy's record of the session's last request, when it
failed for a reason that is no budget (`SessionInfo.fault`), overrides a harness's guess: the
proxy saw the failure, the harness only its symptom.
"""

from __future__ import annotations

from typing import Literal

from miles_env.errors import MilesEnvError
from miles_env.types import EpisodeEnd, Status

__all__ = ["Phase", "end_of_error", "end_of_harness"]

Phase = Literal["sandbox", "harness", "verify"]

_PHASE_END: dict[Phase, EpisodeEnd] = {
    "sandbox": EpisodeEnd.SANDBOX_START,
    "harness": EpisodeEnd.HARNESS_CRASH,
    "verify": EpisodeEnd.VERIFIER_ERROR,
}
_STATUS_END = {Status.COMPLETED: EpisodeEnd.COMPLETED, Status.TRUNCATED: EpisodeEnd.TRUNCATED}


def end_of_error(exc: BaseException, phase: Phase | None) -> EpisodeEnd:
    """The class of an episode that `exc` ended in `phase` (None: outside every phase, e.g. the
    rollout's own bookkeeping, which is UNCLASSIFIED unless the error names its class)."""
    if phase == "sandbox":
        return EpisodeEnd.SANDBOX_START
    own = exc.end if isinstance(exc, MilesEnvError) else None
    if own is not None:
        return own
    return _PHASE_END[phase] if phase is not None else EpisodeEnd.UNCLASSIFIED


def end_of_harness(status: Status, end: EpisodeEnd | None, fault: EpisodeEnd | None) -> EpisodeEnd:
    """The class of an episode whose harness returned `status` (and its own `end`, if it set one);
    `fault`: the proxy's class for the session's last request, when that request failed."""
    if fault is not None:
        return fault
    if end is not None:
        return end
    return _STATUS_END.get(status, EpisodeEnd.HARNESS_CRASH)  # aborted or failed, and nobody said why
