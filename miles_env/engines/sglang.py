"""An Engine client of the SGLang native HTTP API.

Concept: `generate()` posts token ids to `/generate` with `return_logprob`
and reads the sampled ids and logprobs from `meta_info.output_token_logprobs`,
so it works against a real SGLang server and against our embedded server
(`sglang_server.create_app`, which applies SGLang's request rules) alike.

Context: SGLang refuses `prompt + max_new_tokens >= context_length` (strict), so
`info().max_context` is `context_length - 1` (without `--context-length`, the
server's `max_req_input_len`), and `generate()` clamps max_new_tokens to that
limit: a caller capping at `max_context - prompt` is accepted. A server's 400 is
an EngineRefused (`_http.py`); EOS ids come from the model directory
(`_model_dir.py`): SGLang does not report them.

Invariant: requests of one session always go to the same server, so that
server's prefix cache serves the session's next turn: either our consistent-hash
ring over the URLs (_ring.py) picks it, or, with `router=URL`, every `/generate` goes to
SGLang's router (router.py), which keeps the session (`X-SMG-Routing-Key`) on
one worker. Requests without a session rotate over the servers. Every transport
or HTTP failure becomes an EngineError naming the URL: the turn in flight fails,
recorded. A server that then fails its `/health` probe leaves the ring (its
sessions move to the next server on it) and the weight updates and flushes
(which go to every worker, bypassing a router); the engine fails only when every
server is down. A weight update goes to every server in parallel, each timed
(`last_sync()`); a live server that fails the load is an EngineError naming it.
Requests in flight during an update finish on the old weights and report the
old version: SGLang's `/update_weights_from_disk` takes its model-update lock as
writer, so it waits for running requests (readers) unless `abort_all_requests`;
our embedded server's hf engine drains the same way. Each Generation's `cached_tokens` is summed (`prefix_cache_stats`).

Lifecycle: one httpx.AsyncClient per engine; `close()` closes it, and stops
the servers `launch_sglang` started (sglang_launch.py: managed subprocesses, `_launch.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from miles_env.engines._http import request
from miles_env.engines._model_dir import local_model_dir, model_eos_ids
from miles_env.engines._ring import HashRing
from miles_env.engines.base import EngineInfo, Generation, PrefixCacheStats, SamplingParams, ServerSync
from miles_env.engines.router import ROUTING_KEY_HEADER
from miles_env.errors import ConfigError, EngineError, EngineRefused

if TYPE_CHECKING:
    from miles_env.engines._launch import ManagedServer

__all__ = ["SGLangEngine", "SESSION_HEADER"]

SESSION_HEADER = "X-Session-Id"  # KV-reuse hint for our server; a real SGLang ignores it


def _wire_sampling(s: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang refuses 0 ("-1 (disable) or at least 1")
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    return out


class SGLangEngine:
    """Engine over one or more SGLang-compatible servers."""

    name = "sglang"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        servers: Sequence[ManagedServer] = (),
        model_dir: Path | None = None,
        router: str | None = None,
    ) -> None:
        self.servers = list(servers)  # launched by us: stopped on close()
        self.router = router.rstrip("/") if router else None  # every /generate goes there when set
        self.model_dir = model_dir  # EOS ids are read here unless the server's model path is local
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else list(urls))]
        if not self.urls:
            raise ConfigError("sglang engine: urls is empty")
        self.down: list[str] = []  # servers dropped after a failed health probe
        self.down_reasons: dict[str, str] = {}  # and why
        self._last_sync: tuple[ServerSync, ...] = ()
        self._ring = HashRing(self.urls)
        self._rotation = itertools.cycle(self.urls)
        self._cache = PrefixCacheStats()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport)
        self.weight_version = 0  # last known; a server reporting a non-integer version leaves it as is
        self.lora_name: str | None = None  # the adapter every /generate names (load_lora_adapter)
        self._limits: dict[str, int] = {}  # base URL -> the most prompt + max_new_tokens it accepts

    def url_for(self, session_id: str | None) -> str:
        if self.router is not None:
            return self.router
        return self._ring.pick(session_id) if session_id else next(self._rotation)

    def set_urls(self, urls: Sequence[str]) -> None:
        """Serve from exactly `urls` from now on (a placed engine replaced, cluster/engine_faults.py);
        the ring is consistent, so only the sessions of a URL that left or joined move."""
        new = [u.rstrip("/") for u in urls]
        if not new:
            raise ConfigError("sglang engine: urls is empty")
        self.urls = new
        self._ring = HashRing(new)
        self._rotation = itertools.cycle(new)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._cache

    async def _is_down(self, base: str) -> bool:
        try:
            await request(self._client, "sglang", "GET", f"{base}/health", timeout=2.0)
        except EngineError:
            return True
        return False

    async def _drop_if_down(self, base: str, reason: str = "a request failed") -> None:
        """After a failed request: a server that fails its health probe leaves the ring."""
        if base in self.urls and len(self.urls) > 1 and await self._is_down(base):
            self.urls = [u for u in self.urls if u != base]
            self.down.append(base)
            self.down_reasons[base] = f"{reason}; /health failed"
            self._ring = HashRing(self.urls)
            self._rotation = itertools.cycle(self.urls)

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        return await request(self._client, "sglang", method, url, **kw)

    @staticmethod
    def _context_limit(server: dict[str, Any]) -> int:
        context = server.get("context_length")
        if context:
            return int(context) - 1  # SGLang refuses prompt + max_new_tokens >= context_length
        return int(server.get("max_req_input_len") or 8192)

    async def _limit(self, base: str) -> int | None:
        """The server's limit (fetched once); None when unknown, and the server then judges alone."""
        if base not in self._limits:
            try:
                server = (await self._request("GET", f"{base}/get_server_info")).json()
                self._limits[base] = self._context_limit(server)
            except (EngineError, ValueError, TypeError):
                return None
        return self._limits[base]

    def _version(self, raw: Any) -> int:
        try:
            self.weight_version = int(raw)
        except (TypeError, ValueError):
            pass
        return self.weight_version

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        base = self.url_for(session_id)
        max_new = sampling.max_new_tokens
        limit = await self._limit(self.urls[0] if self.router else base)
        if limit is not None:  # at least 1: a prompt without room gets the server's own refusal
            max_new = max(1, min(max_new, limit - len(input_ids)))
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": _wire_sampling(sampling, max_new),
            "return_logprob": True,
        } | ({"lora_path": self.lora_name} if self.lora_name is not None else {})
        headers = {SESSION_HEADER: session_id, ROUTING_KEY_HEADER: session_id} if session_id else None
        try:
            resp = await self._request("POST", f"{base}/generate", json=payload, headers=headers)
        except EngineRefused:
            raise
        except EngineError:
            if self.router is None:
                await self._drop_if_down(base)
            raise
        try:
            body = resp.json()
            if isinstance(body, list):  # a batch-shaped answer to a single request
                body = body[0]
            meta = body["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            output_ids = [int(p[1]) for p in pairs] if pairs else [int(i) for i in body.get("output_ids", [])]
            logprobs = [float(p[0]) for p in pairs]
            finish = meta.get("finish_reason") or {}
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise EngineError(f"sglang {base}/generate: malformed response: {e!r}: {resp.text[:300]}") from e
        if len(logprobs) != len(output_ids):
            raise EngineError(
                f"sglang {base}/generate: {len(output_ids)} output ids but {len(logprobs)} logprobs"
            )
        kind = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
        gen = Generation(
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=kind if kind in ("stop", "length", "abort") else "abort",
            weight_version=self._version(meta.get("weight_version")),
            prompt_len=int(meta.get("prompt_tokens", len(input_ids))),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            latency_s=float(meta.get("e2e_latency", 0.0) or 0.0),
            meta={
                "matched": finish.get("matched") if isinstance(finish, dict) else None,
                "url": base,
                "id": meta.get("id"),
            },
        )
        self._cache = self._cache.add(gen)
        return gen

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """PromptScorer through SGLang's native /generate: `max_new_tokens: 0`, `return_logprob`,
        `logprob_start_len: 0`, the sequences as one batch; `input_token_logprobs[0]` is null (0.0)."""
        seqs = [[int(i) for i in s] for s in sequences if len(s)]
        if not seqs:
            return [[] for _ in sequences]
        base = self.url_for(None)
        payload = {
            "input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0,
        }  # fmt: skip
        resp = await self._request("POST", f"{base}/generate", json=payload)
        try:
            body = resp.json()
            outs = body if isinstance(body, list) else [body]
            pairs = [o["meta_info"]["input_token_logprobs"] for o in outs]
            scored = [[0.0, *(float(p[0]) for p in ps[1:])] for ps in pairs]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise EngineError(
                f"sglang {base}/generate (score): malformed response: {e!r}: {resp.text[:300]}"
            ) from e
        if [len(s) for s in scored] != [len(s) for s in seqs]:
            raise EngineError(
                f"sglang {base}/generate (score): logprobs do not match the {len(seqs)} sequences"
            )
        it = iter(scored)
        return [next(it) if len(s) else [] for s in sequences]

    async def _each_server(self, method: str, path: str, **kw: Any) -> list[httpx.Response]:
        """One request to every live server; a server found down on the way is dropped, not fatal."""
        out = []
        for base in list(self.urls):
            try:
                out.append(await self._request(method, f"{base}{path}", **kw))
            except EngineRefused:
                raise
            except EngineError:
                await self._drop_if_down(base)
                if base in self.urls:  # alive (or the last one): the failure is the server's answer
                    raise
        return out

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        """Ask every server, in parallel, to load `path`; SGLang bumps nothing by itself, so the
        version is sent along. A server that fails and then fails its health probe leaves the ring
        (`down_reasons` says why); one that answers but fails the load is an EngineError naming it,
        since the servers would otherwise serve two versions under one number."""
        version = weight_version if weight_version is not None else self.weight_version + 1
        payload = {"model_path": str(path), "weight_version": str(version)}
        timed: dict[str, float] = {}
        failed: dict[str, EngineError] = {}

        async def one(base: str) -> None:
            t0 = time.perf_counter()
            try:
                body = (await self._request("POST", f"{base}/update_weights_from_disk", json=payload)).json()
                if not body.get("success", False):
                    raise EngineRefused(str(body.get("message")), "invalid_request")
            except EngineRefused as e:  # alive, and it said no: the message with the server's URL
                failed[base] = EngineRefused(
                    f"sglang {base}/update_weights_from_disk: {e}", "invalid_request"
                )
                return
            except EngineError as e:
                failed[base] = e
                return
            timed[base] = time.perf_counter() - t0

        async with anyio.create_task_group() as tg:
            for base in list(self.urls):
                tg.start_soon(one, base)
        for base, err in failed.items():  # one at a time: the last live server is never dropped
            if not isinstance(err, EngineRefused):
                await self._drop_if_down(base, reason=f"update_weights_from_disk: {err}")
            if base in self.urls:
                raise err
        self._last_sync = tuple(ServerSync(u, timed[u]) for u in self.urls)
        self.weight_version = version
        return version

    async def load_lora_adapter(self, lora_name: str, lora_path: str | Path, weight_version: int) -> int:
        """LoRA sync (SGLang's `/load_lora_adapter` on every server, the server started with
        `--enable-lora`): load the adapter under a new name, serve it from then on (`lora_path` in
        each /generate), unload the previous one. `weight_version` rides along (our server reads
        it; a real SGLang ignores the field, so `/update_weight_version` is sent too)."""
        load = {"lora_name": lora_name, "lora_path": str(lora_path), "weight_version": str(weight_version)}
        for resp in await self._each_server("POST", "/load_lora_adapter", json=load):
            body = resp.json()
            if not body.get("success", False):
                raise EngineRefused(
                    f"sglang load_lora_adapter: {body.get('error_message')}", "invalid_request"
                )
        with contextlib.suppress(EngineError):  # an old server without it: the adapter name says it
            await self._each_server(
                "POST", "/update_weight_version", json={"new_version": str(weight_version)}
            )
        previous, self.lora_name = self.lora_name, lora_name
        if previous is not None and previous != lora_name:
            await self._each_server("POST", "/unload_lora_adapter", json={"lora_name": previous})
        self.weight_version = weight_version
        return weight_version

    def last_sync(self) -> tuple[ServerSync, ...]:
        """Each live server's seconds in the last weight update (PerServerSync)."""
        return self._last_sync

    async def flush_cache(self) -> None:
        await self._each_server("POST", "/flush_cache")

    async def _first_server(self, path: str) -> tuple[str, httpx.Response]:
        """GET `path` from the first live server (a server found down on the way is dropped)."""
        while True:
            base = self.urls[0]
            try:
                return base, await self._request("GET", f"{base}{path}")
            except EngineRefused:
                raise
            except EngineError:
                await self._drop_if_down(base)
                if base in self.urls:
                    raise

    async def info(self) -> EngineInfo:
        base, resp = await self._first_server("/get_model_info")
        model = resp.json()
        server = (await self._request("GET", f"{base}/get_server_info")).json()
        self._limits[base] = self._context_limit(server)
        model_dir = local_model_dir(model.get("model_path"), self.model_dir)
        return EngineInfo(
            name="sglang",
            model=str(model.get("model_path", "")),
            weight_version=self._version(model.get("weight_version")),
            max_context=self._limits[base],
            eos_token_ids=await anyio.to_thread.run_sync(model_eos_ids, model_dir),
        )

    async def close(self) -> None:
        try:
            await self._client.aclose()
        finally:
            for server in self.servers:
                await server.stop()
