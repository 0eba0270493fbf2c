"""The SGLang native HTTP API (the subset RL frameworks use) over any Engine.

Concept: `create_app(engine)` serves `POST /generate` (token ids in, token ids
and logprobs out), `POST /update_weights_from_disk`, `POST /load_lora_adapter`,
`POST /unload_lora_adapter`, `GET|POST /flush_cache`,
`GET /get_model_info`, `GET /get_weight_version`, `GET /get_server_info`,
`GET /health` and `GET /health_generate`, with SGLang's field names, response
shapes, request rules and refusals, so a client written for a real SGLang
server (slime, miles, our `SGLangEngine`) meets here what it meets there.
The server's context length C is the engine's `info().max_context`.

Rules a real SGLang server applies, and this one too (SGLang python/sglang/srt/):
| rule | where in SGLang |
|---|---|
| prompt >= C: 400 "The input (P tokens) is longer than the model's context length (C tokens)." | managers/tokenizer_manager.py `_validate_one_request` |
| prompt + max_new_tokens >= C (strict; only when max_new_tokens is sent): 400 "Requested token count exceeds the model's maximum context length of C tokens. You requested a total of T tokens: P tokens from the input messages and M tokens for the completion. ..." | same (`>=` through v0.5.x; newest main: `>` behind `validate_total_tokens`) |
| an unknown `sampling_params` key: TypeError in `SamplingParams(**kw)`, not caught: 500 "Internal Server Error" | sampling/sampling_params.py; entrypoints/http_server.py catches ValueError only |
| value checks (temperature >= 0, top_p in (0, 1], top_k -1 or >= 1, min_p, penalties, max_new_tokens >= 0): 400 with SGLang's message | sampling_params.py `SamplingParams.verify` |
| prompt >= max_req_input_len (C - 6): 400 "Input length (P tokens) exceeds the maximum allowed length (M tokens). ..." | managers/scheduler.py `validate_input_length` (abort with 400, raised as ValueError) |
| max_new_tokens (absent: unbounded) clamped to C - 2 - P | scheduler.py `init_req_max_new_tokens` (max_req_len - P - 1) |
| a refusal's body: `{"error": {"message": ...}}`; a malformed body: 400 `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`; unknown top-level fields ignored | http_server.py `_create_error_response`, RequestValidationError handler; GenerateReqInput is a dataclass |
| finish_reason `{"type": "stop", "matched": id or str}`, `{"type": "length", "length": max_new_tokens}`, `{"type": "abort", "message", "status_code", "err_type"}` | managers/schedule_batch.py `FINISH_*.to_json` |
| `meta_info.output_token_logprobs`: `[logprob, token_id, None]` per output token (text with `return_text_in_logprobs`) | tokenizer_manager.py `detokenize_logprob_tokens` |
| weight_version: "default" until weights are updated with a version; in meta_info, /get_model_info, /get_weight_version, /get_server_info | server_args.py `weight_version`; http_server.py |
| /get_server_info: server args, scheduler info (`max_total_num_tokens`, `max_req_input_len`), `internal_states`, `version`; no EOS ids | http_server.py `get_server_info` |

Scoring (what OPD teachers send, slime's on_policy_distillation): `max_new_tokens: 0` with
`return_logprob: true` and `logprob_start_len: 0` on an engine that is a PromptScorer returns, per
prompt, `meta_info.input_token_logprobs` `[[null, id0, null], [lp, id1, null], ...]`, nothing
generated; `input_ids` may be a batch (a list of lists), answered by a list, one engine call.

Invariant: the ids and logprobs in a response are exactly the Generation's.
Differences from SGLang: one request per call (a batch list only to score, no
streaming, no top logprobs, input logprobs only to score); sampling features the
engine cannot honour (penalties, min_p, n > 1, grammars, ignore_eos, logit_bias,
max_new_tokens = 0 other than to score) are refused with a 400 naming them; the optional
`X-Session-Id` header (else sglang-router's `X-SMG-Routing-Key`) is the
KV-reuse hint; "default" is the engine's version 0, and an update without a
version bumps the engine's integer version. `meta_info.cached_tokens` is the
engine's own count of prompt tokens served from its KV prefix cache.

LoRA: `/load_lora_adapter` and `/unload_lora_adapter` as SGLang has them (_sglang_lora.py).

Lifecycle: `serve()` runs uvicorn until cancelled; `running_server()` starts
it on a loopback port for the duration of an `async with` block.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from miles_env.engines._sglang_lora import lora_routes
from miles_env.engines._sglang_wire import (
    RESERVED_TAIL,
    SAMPLING_KEYS,
    GenerateRequest,
    WireSamplingParams,
    check_context,
    check_scheduler,
)
from miles_env.engines.base import Engine, Generation, PromptScorer, SamplingParams
from miles_env.engines.router import ROUTING_KEY_HEADER
from miles_env.engines.sglang import SESSION_HEADER
from miles_env.errors import EngineError, EngineRefused

__all__ = [
    "GenerateRequest",
    "WireSamplingParams",
    "create_app",
    "serve",
    "running_server",
    "SESSION_HEADER",
]


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _version(v: int) -> str:
    return "default" if v == 0 else str(v)


def _finish_reason(gen: Generation, max_new_tokens: int) -> dict[str, Any]:
    if gen.finish_reason == "stop":
        return {"type": "stop", "matched": gen.meta.get("matched")}
    if gen.finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    message = str(gen.meta.get("message", "Aborted"))
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class _Tokenizer:
    """The engine's tokenizer, or the one of its model path, loaded on first use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tok: Any = getattr(engine, "tokenizer", None)

    async def get(self) -> Any:
        if self.tok is None:
            from miles_env.models import load_tokenizer

            model = (await self.engine.info()).model
            self.tok = await anyio.to_thread.run_sync(load_tokenizer, model)
        return self.tok


def _response(
    gen: Generation, req: GenerateRequest, rid: str, tok: Any, sp: WireSamplingParams, max_new: int
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(gen, max_new),
        "prompt_tokens": gen.prompt_len,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": gen.cached_tokens,
        "weight_version": _version(gen.weight_version),
        "e2e_latency": gen.latency_s,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, str(tok.decode([tid])) if req.return_text_in_logprobs else None]
            for lp, tid in zip(gen.logprobs, gen.output_ids, strict=True)
        ]
    return {"text": _text(tok, gen, sp), "output_ids": list(gen.output_ids), "meta_info": meta}


def _text(tok: Any, gen: Generation, sp: WireSamplingParams) -> str:
    skip = True if sp.skip_special_tokens is None else sp.skip_special_tokens
    text = str(tok.decode(gen.output_ids, skip_special_tokens=skip))
    matched = gen.meta.get("matched")
    if isinstance(matched, str) and matched and not sp.no_stop_trim and matched in text:
        text = text[: text.rfind(matched)]  # SGLang leaves the stop string out of the text
    return text


def _sampling(raw: dict[str, Any], prompt_len: int, context: int) -> tuple[WireSamplingParams, int]:
    """SGLang's order: the context rules, SamplingParams(**kw) and verify(), then the scheduler's."""
    check_context(prompt_len, raw.get("max_new_tokens"), context)
    if set(raw) - SAMPLING_KEYS:
        raise TypeError(f"Unexpected keyword argument {sorted(set(raw) - SAMPLING_KEYS)[0]!r}")
    try:
        sp = WireSamplingParams.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"invalid sampling_params: {e.errors(include_url=False)}") from e
    sp.verify()
    if (why := sp.unsupported()) is not None:
        raise ValueError(why)
    return sp, check_scheduler(prompt_len, sp.max_new_tokens, context)


def _is_score(req: GenerateRequest) -> bool:
    sp = req.sampling_params or {}
    return (
        sp.get("max_new_tokens") == 0
        and req.return_logprob
        and req.logprob_start_len == 0
        and bool(req.input_ids)
    )


async def _score(engine: PromptScorer, req: GenerateRequest) -> Any:
    """Prefill only: each prompt's input_token_logprobs (the first is null), one engine call."""
    raw = req.input_ids or []
    batch = [list(r) if isinstance(r, list) else [] for r in raw] if isinstance(raw[0], list) else [raw]
    seqs: list[list[int]] = [[int(i) for i in r] for r in batch]
    try:
        scored = await engine.score(seqs)
    except EngineRefused as e:
        return _error(400, str(e))
    except EngineError as e:
        return _error(500, str(e))
    out = []
    for ids, lps in zip(seqs, scored, strict=True):
        pairs = [[lp if t else None, i, None] for t, (lp, i) in enumerate(zip(lps, ids, strict=True))]
        meta = {
            "id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": 0,
            "finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": pairs,
            "output_token_logprobs": [],
        }  # fmt: skip
        out.append({"text": "", "output_ids": [], "meta_info": meta})
    return out if isinstance(raw[0], list) else out[0]


def _session_id(request: Request) -> str | None:
    """The KV-reuse hint: our client's `X-Session-Id`, else the key sglang-router routed by."""
    return request.headers.get(SESSION_HEADER) or request.headers.get(ROUTING_KEY_HEADER) or None


def create_app(engine: Engine) -> FastAPI:
    """A FastAPI app serving the SGLang native API subset over `engine`."""
    app = FastAPI(title="miles-env engine (SGLang native API)")
    tokenizer = _Tokenizer(engine)
    lora_routes(app, engine)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body = {"object": "error", "message": f"{exc} {exc.errors()}", "type": "Bad Request", "param": None}
        return JSONResponse({**body, "code": 400}, status_code=400)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        tok = await tokenizer.get()
        if isinstance(engine, PromptScorer) and _is_score(req):
            return await _score(engine, req)
        if req.input_ids and isinstance(req.input_ids[0], list):
            return _error(400, "a batch of input_ids is served only to score (max_new_tokens=0)")
        if req.input_ids is not None:
            ids = [int(i) for i in req.input_ids if isinstance(i, int)]
        elif req.text is not None:
            ids = list(tok.encode(req.text, add_special_tokens=False))
        else:
            return _error(400, "Either text, input_ids or input_embeds should be provided.")
        try:
            sp, max_new = _sampling(req.sampling_params or {}, len(ids), (await engine.info()).max_context)
        except TypeError:  # SGLang's TypeError (an unknown sampling key) is not caught: a bare 500
            return PlainTextResponse("Internal Server Error", status_code=500)
        except ValueError as e:
            return _error(400, str(e))
        try:
            gen = await engine.generate(ids, sp.to_sampling(max_new), session_id=_session_id(request))
        except EngineRefused as e:
            return _error(400, str(e))
        except EngineError as e:
            return _error(500, str(e))
        return _response(gen, req, req.rid or uuid.uuid4().hex, tok, sp, max_new)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateFromDiskRequest) -> JSONResponse:
        version = int(req.weight_version) if req.weight_version is not None else None
        can_abort = "abort_in_flight" in inspect.signature(engine.update_weights_from_disk).parameters
        kw = {"abort_in_flight": True} if req.abort_all_requests and can_abort else {}
        try:
            new = await engine.update_weights_from_disk(req.model_path, version, **kw)
        except (EngineError, ValueError) as e:
            return JSONResponse(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400
            )
        message = f"Succeeded to update model weights. Weight version updated to {new}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        flush = getattr(engine, "flush_cache", None)
        if flush is not None:
            await flush()
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        info = await engine.info()
        return {
            "model_path": info.model,
            "tokenizer_path": info.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": _version(info.weight_version),
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": _version((await engine.info()).weight_version)}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        info = await engine.info()
        return {  # the server args and scheduler info that apply here; SGLang reports no EOS ids
            "model_path": info.model,
            "tokenizer_path": info.model,
            "context_length": info.max_context,
            "weight_version": _version(info.weight_version),
            "max_total_num_tokens": info.max_context,
            "max_req_input_len": info.max_context - 1 - RESERVED_TAIL,
            "internal_states": [{}],
            "version": "miles-env",
        }

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        t0 = time.perf_counter()
        try:
            await engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=-1))
        except EngineError as e:
            return PlainTextResponse(str(e), status_code=503)
        return PlainTextResponse(f"ok {time.perf_counter() - t0:.3f}s\n")

    return app


def _uvicorn_server(engine: Engine, host: str, port: int) -> Any:
    import uvicorn

    config = uvicorn.Config(create_app(engine), host=host, port=port, log_level="warning", lifespan="off")
    return uvicorn.Server(config)


async def serve(engine: Engine, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Serve `engine` over HTTP until cancelled."""
    await _uvicorn_server(engine, host, port).serve()


@asynccontextmanager
async def running_server(engine: Engine, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run the server in this event loop for the block; yield its base URL (port 0 picks a free port)."""
    server = _uvicorn_server(engine, host, port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(30):
            while not server.started:
                if server.should_exit:
                    raise EngineError(f"engine server failed to start on {host}:{port}")
                await anyio.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://{host}:{bound}"
        finally:
            server.should_exit = True
