"""SGLang's native /generate request and the checks a real SGLang server applies to it.

Used by the embedded server (`sglang_server.py`), whose design note tables each rule with
where it comes from. The messages are SGLang's own, so a client parsing a real server's
refusal parses ours the same way (`_http.refusal`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.engines.base import SamplingParams

__all__ = [
    "GenerateRequest",
    "WireSamplingParams",
    "SAMPLING_KEYS",
    "RESERVED_TAIL",
    "check_context",
    "check_scheduler",
]

RESERVED_TAIL = 5  # scheduler: max_req_input_len = max_req_len - 5, max_req_len = context - 1


class WireSamplingParams(BaseModel):
    """SGLang's `sampling_params` (python/sglang/srt/sampling/sampling_params.py); None means default.

    Numbers keep their JSON type (int | float), so a refusal prints the value as SGLang does.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: int | float | None = 1.0
    top_p: int | float | None = 1.0
    top_k: int | None = -1
    min_p: int | float | None = 0.0
    frequency_penalty: int | float | None = 0.0
    presence_penalty: int | float | None = 0.0
    repetition_penalty: int | float | None = 1.0
    min_new_tokens: int | None = 0
    n: int | None = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    def verify(self) -> None:
        """SamplingParams.verify(): a ValueError with SGLang's message for a value it refuses."""
        t = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = -1 if self.top_k is None else self.top_k
        min_p = self.min_p or 0.0
        if not math.isfinite(t) or t < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {t}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name) or 0.0
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}.")
        rep = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        if not 0.0 < rep <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
        min_new = self.min_new_tokens or 0
        if min_new < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if min_new > self.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {min_new}."
                )
        if sum(x is not None for x in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")

    def unsupported(self) -> str | None:
        """What this engine cannot honour (valid for SGLang, refused here), or None."""
        neutral: dict[str, Any] = {
            "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None,
            "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False,
            "custom_params": None, "logit_bias": None,
        }  # fmt: skip
        for name, value in neutral.items():
            got = getattr(self, name)
            if got is not None and got != value:
                return f"sampling_params.{name}={got!r} is not supported by this engine (only {value!r})"
        if self.max_new_tokens == 0:
            return "sampling_params.max_new_tokens=0 is not supported by this engine (at least 1)"
        return None

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            seed=self.sampling_seed,
        )


SAMPLING_KEYS = frozenset(WireSamplingParams.model_fields)


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput, the fields served; unknown fields are ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[int] | list[list[int]] | None = None  # a batch (list of lists): scoring only
    text: str | None = None  # tokenized without special tokens when input_ids is absent
    sampling_params: dict[str, Any] | None = None  # checked by hand: an unknown key is SGLang's 500
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=0)  # top logprobs are not served
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False  # streaming is not served
    rid: str | None = None


def check_context(prompt_len: int, max_new_tokens: Any, context_len: int) -> None:
    """TokenizerManager._validate_one_request: the strict context rules (ValueError, SGLang's text)."""
    if prompt_len >= context_len:
        raise ValueError(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if isinstance(max_new_tokens, int) and max_new_tokens + prompt_len >= context_len:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {max_new_tokens + prompt_len} tokens: {prompt_len} tokens from the "
            f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        )


def check_scheduler(prompt_len: int, max_new_tokens: int | None, context_len: int) -> int:
    """Scheduler.handle_generate_request: the input-length rule, then the max_new_tokens clamp."""
    max_req_len = context_len - 1
    max_req_input_len = max_req_len - RESERVED_TAIL
    if prompt_len >= max_req_input_len:
        raise ValueError(
            f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({max_req_input_len} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    cap = max_req_len - prompt_len - 1
    return cap if max_new_tokens is None else min(max_new_tokens, cap)
