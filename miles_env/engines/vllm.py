"""An Engine over a vLLM server's token-in/token-out API, launched as a managed subprocess or attached.

Concept: `generate()` posts token ids to `/inference/v1/generate` (vLLM's
scale-out API, `--enable-scale-out`) with `logprobs=0` and reads the sampled ids,
their logprobs and the weight-version spans. A launched server runs with
`--logprobs-mode processed_logprobs` (vllm_launch.py), so the logprob of a sampled id is
log_softmax(logits / T)[id] as in our embedded engine (`_sampling.py`); vLLM's
default, `raw_logprobs`, is log_softmax(logits) whatever T is, which agrees only
at T == 1 or greedy. With top_p < 1 or top_k on, vLLM renormalises over the
kept tokens (our engine does not); harness defaults leave both off.

Weight sync (`update_weights_from_disk`): close the gate (new requests wait),
drain this client's in-flight requests, `/pause?mode=wait` (drains other
clients), `/collective_rpc reload_weights {weights_path}`, `/reset_prefix_cache`,
`/update_weight_version`, `/resume`, open the gate. So no request sees mixed
weights and every Generation's `weight_version` is the version that sampled it.

Context (vLLM 0.32 v1/engine/input_processor.py, v1/core/sched/utils.py): a
prompt >= max_model_len is refused (HTTP 400); a longer max_tokens is not, the
generation stops at max_model_len tokens in all (finish "length"). So
`info().max_context` is max_model_len and max_tokens is sent as asked.

Failure: a 400 is the server refusing the request (prompt too long, bad
parameter): an EngineRefused, not retried and no reason to restart anything.
Any other transport/HTTP error or timeout is an EngineError naming the URL
(the TITO proxy answers 502, the harness aborts the episode). For a launched
server a failed request then checks it: a dead or stalled (health check fails)
server is restarted, up to `max_restarts`, and the last synced weights and
version are restored; after that the engine is dead and every call raises an
EngineError saying so (a training run stops at its next weight sync).

Lifecycle: `await VLLMEngine.launch(spec, model_dir)` (the server's command line:
vllm_launch.py) or `VLLMEngine(url=...)`; `close()` stops a launched server (its process
group) and closes the client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx

from miles_env.engines._gate import Gate
from miles_env.engines._http import request
from miles_env.engines._launch import ManagedServer, ServerSpec
from miles_env.engines._model_dir import local_model_dir, model_eos_ids
from miles_env.engines.base import EngineInfo, Generation, PrefixCacheStats, SamplingParams
from miles_env.errors import EngineError, EngineRefused

__all__ = ["VLLMEngine"]


def _wire_sampling(s: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "logprobs": 0,  # the sampled token's logprob only
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["seed"] = s.seed
    return out


class VLLMEngine:
    """Engine over one vLLM server; see the module docstring."""

    name = "vllm"

    def __init__(
        self,
        url: str,
        *,
        server: ManagedServer | None = None,
        model_dir: Path | None = None,
        timeout_s: float = 600.0,
        max_restarts: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.server = server
        self.model_dir = model_dir
        self.max_restarts = max_restarts
        self.restarts = 0
        self.weight_version = 0  # last version set through this client (or read from the server)
        self._weights_path: Path | None = None  # last synced weights, restored after a restart
        self.lora_name: str | None = None  # the adapter generate asks for (load_lora_adapter)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport)
        self._gate = Gate()
        self._epoch = 0  # bumped by each restart: failures seen in an older epoch are already handled
        self._dead: str | None = None
        self._info: EngineInfo | None = None
        self._cache = PrefixCacheStats()  # summed cached_tokens of the generations returned

    @classmethod
    async def launch(cls, spec: ServerSpec, model_dir: Path, **kw: Any) -> VLLMEngine:
        server = ManagedServer(spec)
        await server.start()
        engine = cls(spec.url, server=server, model_dir=model_dir, **kw)
        try:
            await engine._set_version(0)
        except BaseException:
            await engine.close()
            raise
        return engine

    # -- HTTP -------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return await request(self._client, "vllm", method, self.url + path, **kw)

    def _parse_version(self, raw: Any) -> int:
        try:
            return int(raw)
        except (TypeError, ValueError):
            return self.weight_version

    async def _set_version(self, version: int) -> None:
        await self._request("POST", "/update_weight_version", json={"new_version": str(version)})
        self.weight_version = version

    # -- generate ---------------------------------------------------------------------------
    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if self._dead is not None:
            raise EngineError(self._dead)
        payload: dict[str, Any] = {"token_ids": list(input_ids), "sampling_params": _wire_sampling(sampling)}
        if self.lora_name is not None:
            payload["model"] = self.lora_name  # vLLM serves a loaded LoRA adapter under its name
        t0 = time.perf_counter()
        async with self._gate.shared():
            epoch = self._epoch
            try:
                resp = await self._request("POST", "/inference/v1/generate", json=payload)
            except EngineRefused:
                raise  # the server answered: nothing to recover
            except EngineError as e:
                failure = e
            else:
                return self._generation(resp, len(input_ids), time.perf_counter() - t0)
        raise await self._recover(failure, epoch)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """PromptScorer through vLLM's /v1/completions (tests/test_opd_vllm.py): the sequences as one
        batch of token prompts with `prompt_logprobs: 0` (per prompt a list, the first entry null, then
        {"<prompt token id>": {logprob, rank, decoded_token}}: log_softmax of the raw logits, whatever
        the temperature) and one generated token that is dropped. vLLM refuses a prompt of
        max_model_len tokens (no room for that token), the length a generation that hit the context
        limit ends at: such a sequence is scored without its last token, whose logprob is then read at
        the generated position (`logprob_token_ids`, temperature 1) in a request of its own; a longer
        one is an EngineRefused (context_length)."""
        if self._dead is not None:
            raise EngineError(self._dead)
        seqs = [[int(i) for i in s] for s in sequences if len(s)]
        if not seqs:
            return [[] for _ in sequences]
        limit = (await self.info()).max_context
        if (longest := max(map(len, seqs))) > limit:  # vLLM's own refusal would blame max_tokens
            msg = f"vllm {self.url}: a sequence of {longest} tokens to score is longer than {limit} (max_model_len)"
            raise EngineRefused(msg, "context_length", longest, limit)
        short = [i for i, s in enumerate(seqs) if len(s) < limit]
        async with self._gate.shared():  # one at a time: an error stays itself, not an ExceptionGroup
            scored = dict(zip(short, await self._score_batch([seqs[i] for i in short]), strict=True))
            for i in (i for i, s in enumerate(seqs) if len(s) == limit):  # rare: hit the context limit
                scored[i] = await self._score_full(seqs[i])
        it = iter(scored[i] for i in range(len(seqs)))
        return [next(it) if len(s) else [] for s in sequences]

    def _malformed(self, resp: httpx.Response, e: Exception) -> EngineError:
        return EngineError(f"vllm {self.url}: malformed prompt_logprobs response: {e!r}: {resp.text[:300]}")

    @staticmethod
    def _prompt_logprobs(choice: dict[str, Any], ids: list[int]) -> list[float]:
        pos = choice["prompt_logprobs"]
        return [0.0, *(float(p[str(t)]["logprob"]) for p, t in zip(pos[1:], ids[1:], strict=True))]

    async def _score_batch(self, seqs: list[list[int]]) -> list[list[float]]:
        if not seqs:
            return []
        payload = {"prompt": seqs, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        resp = await self._request("POST", "/v1/completions", json=payload)
        try:
            choices = sorted(resp.json()["choices"], key=lambda c: int(c["index"]))
            return [self._prompt_logprobs(c, ids) for c, ids in zip(choices, seqs, strict=True)]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise self._malformed(resp, e) from e

    async def _score_full(self, ids: list[int]) -> list[float]:
        payload = {
            "prompt": ids[:-1], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "logprobs": 0,
            "logprob_token_ids": [ids[-1]], "return_tokens_as_token_ids": True,
        }  # fmt: skip
        resp = await self._request("POST", "/v1/completions", json=payload)
        try:
            c = resp.json()["choices"][0]
            last = float(c["logprobs"]["top_logprobs"][0][f"token_id:{ids[-1]}"])
            return [*self._prompt_logprobs(c, ids[:-1]), last]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise self._malformed(resp, e) from e

    def _generation(self, resp: httpx.Response, prompt_len: int, latency: float) -> Generation:
        try:
            body = resp.json()
            choice = body["choices"][0]
            output_ids = [int(i) for i in choice.get("token_ids") or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            spans = choice.get("weight_versions") or []
            usage = body.get("usage") or {}
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise EngineError(
                f"vllm {self.url}: malformed generate response: {e!r}: {resp.text[:300]}"
            ) from e
        if len(logprobs) != len(output_ids):
            raise EngineError(f"vllm {self.url}: {len(output_ids)} output ids but {len(logprobs)} logprobs")
        versions = sorted({self._parse_version(s.get("version")) for s in spans}) or [self.weight_version]
        finish = choice.get("finish_reason") or "abort"
        details = usage.get("prompt_tokens_details") or {}
        gen = Generation(
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=finish if finish in ("stop", "length", "abort") else "abort",
            weight_version=versions[0],  # one span unless something bypassed our pause
            prompt_len=int(usage.get("prompt_tokens") or prompt_len),
            cached_tokens=int(details.get("cached_tokens") or 0),
            latency_s=latency,
            meta={"id": body.get("request_id"), "url": self.url, "weight_versions": versions},
        )
        self._cache = self._cache.add(gen)
        return gen

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._cache

    # -- failure handling -------------------------------------------------------------------
    async def _recover(self, failure: EngineError, epoch: int) -> EngineError:
        """Restart a launched server that died or stalled; return the error the failed request raises."""
        if self.server is None:
            return failure
        async with self._gate.exclusive():
            if self._dead is not None:
                return EngineError(f"{failure}; {self._dead}")
            if self._epoch != epoch:  # another request already restarted it
                return EngineError(f"{failure}; the vllm server was restarted meanwhile")
            if self.server.exit_code() is None and await self.server.healthy():
                return failure  # slow or refused, not dead
            code = await self._exit_code(grace_s=2.0)  # a killed server may still be exiting
            what = f"exited with status {code}" if code is not None else "stalled (health check failed)"
            log = self.server.spec.log_path
            if self.restarts >= self.max_restarts:
                self._dead = (
                    f"vllm engine: the server {what} after {self.restarts} restarts "
                    f"(max_restarts={self.max_restarts}); giving up (log {log})"
                )
                await self.server.stop()
                return EngineError(f"{failure}; {self._dead}")
            self.restarts += 1
            self._epoch += 1
            try:
                await self.server.restart()
                await self._restore()
            except EngineError as e:
                self._dead = f"vllm engine: restart failed: {e}"
                await self.server.stop()
                return EngineError(f"{failure}; {self._dead}")
            return EngineError(
                f"{failure}; the vllm server {what} and was restarted "
                f"({self.restarts}/{self.max_restarts}, weight version {self.weight_version}, log {log})"
            )

    async def _exit_code(self, grace_s: float) -> int | None:
        assert self.server is not None
        deadline = time.monotonic() + grace_s
        while (code := self.server.exit_code()) is None and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        return code

    async def _restore(self) -> None:
        if self._weights_path is not None:
            await self._reload(self._weights_path)
        await self._set_version(self.weight_version)

    # -- weights ----------------------------------------------------------------------------
    async def _reload(self, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self._request("POST", "/collective_rpc", json=body)
        await self._request("POST", "/reset_prefix_cache")

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        """Reload the server's weights from an HF checkpoint dir (model.safetensors + config.json)."""
        if self._dead is not None:
            raise EngineError(self._dead)
        target = Path(path).resolve()
        version = weight_version if weight_version is not None else self.weight_version + 1
        async with self._gate.exclusive():  # no request of ours in flight from here on
            await self._request("POST", "/pause", params={"mode": "wait"})
            try:
                await self._reload(target)
                await self._set_version(version)
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(EngineError):
                    await self._request("POST", "/resume")  # the reload's error is the one to report
                raise
            await self._request("POST", "/resume")
        self._weights_path = target
        return version

    async def load_lora_adapter(self, lora_name: str, lora_path: str | Path, weight_version: int) -> int:
        """LoRA sync through vLLM's runtime adapter loading (server launched with `--enable-lora
        --max-lora-rank R` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): `/v1/load_lora_adapter` under a
        new name, every later generate names it as its `model`, the previous one is unloaded; the
        base weights are never reloaded. Same gate and pause as a full update, so no turn mixes them."""
        if self._dead is not None:
            raise EngineError(self._dead)
        async with self._gate.exclusive():
            await self._request("POST", "/pause", params={"mode": "wait"})
            try:
                body = {"lora_name": lora_name, "lora_path": str(Path(lora_path).resolve())}
                await self._request("POST", "/v1/load_lora_adapter", json=body)
                await self._request("POST", "/reset_prefix_cache")
                await self._set_version(weight_version)
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(EngineError):
                    await self._request("POST", "/resume")
            previous, self.lora_name = self.lora_name, lora_name
        if previous is not None and previous != lora_name:
            with contextlib.suppress(EngineError):  # a leftover adapter costs memory, not correctness
                await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": previous})
        return weight_version

    async def info(self) -> EngineInfo:
        if self._info is None:
            models = (await self._request("GET", "/v1/models")).json()
            card = (models.get("data") or [{}])[0]
            model_dir = local_model_dir(card.get("root"), self.model_dir)
            self._info = EngineInfo(
                name="vllm",
                model=str(card.get("root") or card.get("id") or self.model_dir or ""),
                weight_version=self.weight_version,
                max_context=int(card.get("max_model_len") or 2048),
                eos_token_ids=await anyio.to_thread.run_sync(model_eos_ids, model_dir),
            )
        info = self._info
        return EngineInfo(info.name, info.model, self.weight_version, info.max_context, info.eos_token_ids)

    async def close(self) -> None:
        self._dead = self._dead or "vllm engine closed"
        try:
            await self._client.aclose()
        finally:
            if self.server is not None:
                with anyio.CancelScope(shield=True):
                    await self.server.stop()
