"""The running decode batch of the embedded engine (worker thread only).

A request is prefilled alone (batch 1, no padding, on top of the longest
cached prefix it extends), in chunks so running rows keep decoding; the last
chunk samples its first token and the row joins the left-padded batch.
`step()` feeds every row its last token, samples the next one and returns
the rows that finished, already removed from the batch. Row order never affects a row's numbers beyond float rounding: each
row has its own position ids, attention mask and generator.

Mixture-of-experts models: each forward also reads every router's logits (a forward hook on
transformers' `*TopKRouter` modules; `output_router_logits` would also compute the training aux
loss, which fails on a decode step's attention mask), and a row records, for every token it samples, the top-k experts each
layer routed the position that produced it to (`Row.routed`, [tokens][layers][k], sorted): the
engine's side of the rollout-vs-training routing check (trainer/moe.py's `router_agreement`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miles_env.engines._kv import KV, SessionEntry, common_prefix, crop, merge_rows, row_kv, select_rows
from miles_env.engines._sampling import StopChecker, sample_token
from miles_env.engines.base import SamplingParams

__all__ = ["Row", "Batch"]


@dataclass(slots=True, eq=False)
class Row:
    req: Any  # the engine's request record (input_ids, params, cancelled flag, ...)
    input_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    stops: StopChecker
    generator: torch.Generator | None
    version: int
    max_total: int  # context limit: input + output never exceeds it
    cached: int = 0  # prompt tokens served from a cached prefix
    fed: int = 0  # prompt tokens whose KV exists (prefill progress)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    kv: KV | None = None  # only while the row is outside the batch (prefilling or finished)
    routed: list[list[list[int]]] = field(default_factory=list)  # MoE: per sampled token, per layer

    @property
    def n_real(self) -> int:
        """Tokens whose KV exists: the prompt and every output token but the newest."""
        return len(self.input_ids) + len(self.output) - 1

    def accept(self, token: int, logprob: float) -> None:
        self.output.append(token)
        self.logprobs.append(logprob)
        if self.req.cancelled:
            self.finish = "abort"
        elif token in self.stop_ids:
            self.finish, self.matched = "stop", token
        elif (hit := self.stops.matched(self.output)) is not None:
            self.finish, self.matched = "stop", hit
        elif (
            len(self.output) >= self.params.max_new_tokens
            or len(self.input_ids) + len(self.output) >= self.max_total
        ):
            self.finish = "length"

    def session_entry(self) -> SessionEntry:
        assert self.kv is not None
        return SessionEntry(ids=self.input_ids + self.output[:-1], kv=self.kv)


class Batch:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        cache_kw: str,
        tokenizer: Any,
        eos: tuple[int, ...],
        seed: int | None,
    ) -> None:
        self.model = model
        self.device = device
        self.cache_kw = cache_kw
        self.tokenizer = tokenizer
        self.eos = frozenset(eos)
        self.default_gen = torch.Generator(device=device)
        self.default_gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        cfg = model.config
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if getattr(cfg, "num_experts", 0) else 0
        self.routers = (
            [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")] if self.top_k else []
        )
        self.rows: list[Row] = []
        self.kv: KV = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)

    def clear(self) -> None:
        self.rows, self.kv = [], []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def _forward(
        self, ids: torch.Tensor, kv: KV, mask: torch.Tensor | None, pos: torch.Tensor
    ) -> tuple[torch.Tensor, KV, list[list[list[int]]] | None]:
        """Last-position logits [B, V], the new KV, and (MoE) each row's last position's experts."""
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache(config=self.model.config)
        kwargs: dict[str, Any] = {self.cache_kw: cache}
        seen: list[torch.Tensor] = []  # each router's logits [B * L, E], in layer order
        hooks = [r.register_forward_hook(lambda _m, _a, o: seen.append(o[0])) for r in self.routers]
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        finally:
            for h in hooks:
                h.remove()
        layers: list[Any] = list(cache.layers)
        routed = None
        if seen:  # the last position of each row, per layer
            b, n = ids.shape
            last = torch.stack([lg.view(b, n, -1)[:, -1] for lg in seen], dim=1)  # [B, layers, E]
            routed = last.topk(self.top_k, dim=-1).indices.sort(-1).values.tolist()
        return out.logits[:, -1, :].float(), [(layer.keys, layer.values) for layer in layers], routed

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.temperature == 0.0:
            return None
        if params.seed is None:
            return self.default_gen
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed)
        return gen

    def start(self, req: Any, ids: list[int], params: SamplingParams, version: int, max_total: int) -> Row:
        """A row whose prompt is still to be prefilled (see `prefill_chunk`)."""
        return Row(
            req=req,
            input_ids=ids,
            params=params,
            stop_ids=self.eos | frozenset(params.stop_token_ids),
            stops=StopChecker(self.tokenizer, params.stop),
            generator=self._generator(params),
            version=version,
            max_total=max_total,
        )

    def reuse(self, row: Row, entry: SessionEntry | None) -> None:
        """Start the row's KV from the longest usable prefix of a cached entry."""
        if entry is None:
            return
        # keep at least one prompt token to feed: its logits give the first sample
        n = min(common_prefix(entry.ids, row.input_ids), len(row.input_ids) - 1)
        if n > 0:
            row.kv = crop(entry.kv, n)  # views: stored tensors are never written
            row.fed = row.cached = n

    def prefill_chunk(self, row: Row, budget: int) -> int:
        """Feed up to `budget` prompt tokens; after the last one, sample the first output token.

        Returns the number of tokens fed. Chunks let running rows decode between the pieces of
        a long prompt.
        """
        ids = row.input_ids
        end = min(len(ids), row.fed + budget)
        chunk = torch.tensor([ids[row.fed : end]], dtype=torch.long, device=self.device)
        pos = torch.arange(row.fed, end, device=self.device).unsqueeze(0)
        logits, row.kv, routed = self._forward(chunk, row.kv or [], None, pos)
        fed, row.fed = end - row.fed, end
        if end == len(ids):
            if routed is not None:
                row.routed.append(routed[0])
            row.accept(*sample_token(logits[0], row.params, row.generator))
        return fed

    def join(self, row: Row) -> None:
        assert row.kv is not None
        mask = torch.ones(1, row.n_real, dtype=torch.long, device=self.device)
        if self.rows:
            self.kv, self.mask = merge_rows(self.kv, self.mask, row.kv, mask)
        else:
            self.kv, self.mask = row.kv, mask
        row.kv = None
        self.rows.append(row)

    def abort_all(self) -> list[Row]:
        """End every running row now (finish "abort", output so far); the batch becomes empty."""
        rows = self.rows
        for row in rows:
            row.finish = "abort"
        self.clear()
        return rows

    def step(self) -> list[Row]:
        """One decode step for every row; return the rows that finished (removed from the batch)."""
        rows = self.rows
        ids = torch.tensor([[r.output[-1]] for r in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.n_real] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        padded = bool((mask == 0).any())
        logits, self.kv, routed = self._forward(ids, self.kv, mask if padded else None, pos)
        self.mask = mask
        done: list[int] = []
        for i, row in enumerate(rows):
            if routed is not None:
                row.routed.append(routed[i])
            row.accept(*sample_token(logits[i], row.params, row.generator))
            if row.finish is not None:
                done.append(i)
        if not done:
            return []
        finished = [rows[i] for i in done]
        for i, row in zip(done, finished, strict=True):
            row.kv = row_kv(self.kv, i, row.n_real)
        keep = [i for i in range(len(rows)) if i not in set(done)]
        self.rows = [rows[i] for i in keep]
        if self.rows:
            self.kv, self.mask = select_rows(self.kv, self.mask, keep)
        else:
            self.clear()
        return finished
