"""The SGLang native HTTP API (the subset RL frameworks use) over any Engine.

Concept: `create_app(engine)` serves `POST /generate` (token ids in, token ids
and logprobs out), `POST /update_weights_from_disk`, `GET|POST /flush_cache`,
`GET /get_model_info`, `GET /get_weight_version`, `GET /get_server_info`,
`GET /health` and `GET /health_generate`, with SGLang's field names and
response shapes, so a client written for a real SGLang server (slime, miles,
our `SGLangEngine`) works unchanged against the embedded engine.

Invariant: the ids and logprobs in a response are exactly the Generation's.
Differences from SGLang: one request per call (no batch lists, no streaming);
the optional `X-Session-Id` header is the KV-reuse hint (SGLang ignores it and
reuses prefixes through its radix cache); `weight_version` is reported as a
string, as SGLang does.

Lifecycle: `serve()` runs uvicorn until cancelled; `running_server()` starts
it on a loopback port for the duration of an `async with` block.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from miles_env.engines.base import Engine, Generation, SamplingParams
from miles_env.engines.sglang import SESSION_HEADER
from miles_env.errors import EngineError

__all__ = ["GenerateRequest", "WireSamplingParams", "create_app", "serve", "running_server", "SESSION_HEADER"]


class WireSamplingParams(BaseModel):
    """SGLang's `sampling_params`; fields we cannot honour are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None
    seed: int | None = None  # alias of sampling_seed
    # text rendering only: they never change the ids
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # accepted for compatibility at their neutral value only
    ignore_eos: bool = False
    min_new_tokens: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1

    @field_validator("ignore_eos", "min_new_tokens", "min_p", "frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral_zero(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported by this engine (only the neutral value is accepted)")
        return v

    @field_validator("repetition_penalty", "n")
    @classmethod
    def _neutral_one(cls, v: Any) -> Any:
        if v != 1:
            raise ValueError("not supported by this engine (only the neutral value 1 is accepted)")
        return v

    def to_sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            seed=self.sampling_seed if self.sampling_seed is not None else self.seed,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] | None = None
    text: str | None = None  # tokenized without special tokens when input_ids is absent
    sampling_params: WireSamplingParams = Field(default_factory=WireSamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=0)
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False  # streaming is not served
    rid: str | None = None


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _finish_reason(gen: Generation) -> dict[str, Any]:
    matched = gen.meta.get("matched")
    if gen.finish_reason == "stop":
        return {"type": "stop", "matched": matched}
    if gen.finish_reason == "length":
        return {"type": "length", "length": len(gen.output_ids)}
    return {"type": "abort", "message": str(gen.meta.get("message", "aborted"))}


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


def _response(gen: Generation, req: GenerateRequest, rid: str, text: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(gen),
        "prompt_tokens": gen.prompt_len,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": gen.cached_tokens,
        "weight_version": str(gen.weight_version),
        "e2e_latency": gen.latency_s,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(gen.logprobs, gen.output_ids, strict=True)
        ]
    return {"text": text, "output_ids": list(gen.output_ids), "meta_info": meta}


def _text(tok: Any, gen: Generation, sp: WireSamplingParams) -> str:
    text = str(tok.decode(gen.output_ids, skip_special_tokens=sp.skip_special_tokens))
    matched = gen.meta.get("matched")
    if isinstance(matched, str) and matched and not sp.no_stop_trim and matched in text:
        text = text[: text.rfind(matched)]  # SGLang leaves the stop string out of the text
    return text


def create_app(engine: Engine) -> FastAPI:
    """A FastAPI app serving the SGLang native API subset over `engine`."""
    app = FastAPI(title="miles-env engine (SGLang native API)")
    tokenizer = _Tokenizer(engine)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()}")

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        try:
            sampling = req.sampling_params.to_sampling()
        except ValidationError as e:
            return _error(400, f"invalid sampling_params: {e.errors()}")
        tok = await tokenizer.get()
        if req.input_ids is None:
            if req.text is None:
                return _error(400, "one of input_ids or text is required")
            ids = list(tok.encode(req.text, add_special_tokens=False))
        else:
            ids = req.input_ids
        rid = req.rid or uuid.uuid4().hex
        try:
            gen = await engine.generate(ids, sampling, session_id=request.headers.get(SESSION_HEADER))
        except EngineError as e:
            return _error(400, str(e))
        return _response(gen, req, rid, _text(tok, gen, req.sampling_params))

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
            "weight_version": str(info.weight_version),
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str((await engine.info()).weight_version)}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        info = await engine.info()
        return {
            "model_path": info.model,
            "context_length": info.max_context,
            "max_req_input_len": info.max_context - 1,
            "eos_token_ids": list(info.eos_token_ids),
            "engine": info.name,
            "weight_version": str(info.weight_version),
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
