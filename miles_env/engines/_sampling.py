"""Token sampling and stop detection for the embedded engine.

Logprob convention (the trainer reproduces it): the reported logprob of a
sampled token is log_softmax(logits / T)[token] for temperature T > 0, with no
top-p/top-k renormalisation, and log_softmax(logits)[token] when T == 0
(greedy). Filtering only changes which token is drawn, never the number
reported for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_env.engines.base import SamplingParams

__all__ = ["sample_token", "StopChecker"]


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Return logits with the tokens outside top-k / top-p set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Draw one token from a 1-D logits row; return (token_id, logprob)."""
    logits = logits.float()
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = _filter(scaled, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


class StopChecker:
    """Finds the first output token that completes a stop string.

    Only a tail window of the output is decoded at each step: a stop string
    that completes now must end inside the newest token's text, and any
    earlier match would have stopped an earlier step.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stops if s)
        self._window = max((len(s) for s in self._stops), default=0) + 8

    def __bool__(self) -> bool:
        return bool(self._stops)

    def matched(self, output_ids: Sequence[int]) -> str | None:
        if not self._stops:
            return None
        tail = list(output_ids[-self._window :])
        text = self._tokenizer.decode(tail, skip_special_tokens=False)
        for stop in self._stops:
            if stop in text:
                return stop
        return None
