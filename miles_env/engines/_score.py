"""Prefill-only scoring for the hf engine: the logprob of every token of a sequence, no sampling.

Concept: sequences are packed longest first into right-padded batches of at most `token_budget`
padded tokens and run through the model once each (no KV cache kept). With right padding a real
token never attends to a pad (causal attention), so a row's logprobs are those of the sequence
alone. Logits are taken in float32 like the sampler's (`_batch.py`), and the result follows
`PromptScorer`: `log_softmax(logits)` at temperature 1, position 0 is 0.0.

Lifecycle: called by the engine's worker thread between decode steps, under inference mode, so a
score never races a weight update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_env.packing import pack_by_budget

__all__ = ["score_sequences"]


def _score_batch(model: Any, device: Any, rows: list[list[int]]) -> list[list[float]]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    ids = ids.to(device)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = picked.cpu().tolist()
    return [[0.0, *out[i][: len(r) - 1]] for i, r in enumerate(rows)]


def score_sequences(
    model: Any, device: Any, sequences: Sequence[Sequence[int]], token_budget: int
) -> list[list[float]]:
    """`PromptScorer.score` on an HF causal LM: one forward pass per packed batch."""
    rows = [[int(t) for t in s] for s in sequences]
    result: list[list[float]] = [[] for _ in rows]
    nonempty = [i for i, r in enumerate(rows) if r]
    for batch in pack_by_budget([len(rows[i]) for i in nonempty], token_budget):
        idx = [nonempty[j] for j in batch]
        for i, lps in zip(idx, _score_batch(model, device, [rows[i] for i in idx]), strict=True):
            result[i] = lps
    return result
