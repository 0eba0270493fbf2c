#!/usr/bin/env bash
# One-shot end-to-end check of the `sglang` engine against a REAL SGLang server on a GPU machine.
# It does not run on CPU-only machines (SGLang installs from PyPI there but cannot serve).
#
# Steps: install sglang into its own venv (CACHE/engines/sglang, found by SGLangEngineConfig launch),
# launch it as a managed subprocess on the SmolLM2 checkpoint (our GGUF-converted one, shadowed
# without its stale quantization_config), then drive it through the TITO proxy with the official
# openai client: a 2-turn session, a weight reload from disk with a version bump, a 3rd turn, and
# `tito audit` on the store. Then two real SGLang servers behind sglang-router (engine.router:
# sglang-router; needs the `scale` extra): 4 sessions x 3 turns, each turn after the first must find
# its session's previous prompt in SGLang's own meta_info.cached_tokens (the other server never saw
# it, so the turn reached the server holding its prefix). Prints one JSON line per stage and exits 0
# on success.
# Usage: bash scripts/gpu-sglang-check.sh [OUT_DIR]     (env: SGLANG_VERSION, PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-sglang-check}"
SGLANG_VERSION="${SGLANG_VERSION:-}"
PYTHON="${PYTHON:-python3.11}"
venv="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/engines/sglang"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv || {
  echo "gpu-sglang-check: no nvidia-smi: this check needs a GPU" >&2; exit 2; }
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import sglang" 2>/dev/null; then
  echo "gpu-sglang-check: installing sglang${SGLANG_VERSION:+==$SGLANG_VERSION} into $venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "sglang[all]${SGLANG_VERSION:+==$SGLANG_VERSION}"
fi
"$venv/bin/python" -c "import sglang; print('gpu-sglang-check: sglang', sglang.__version__)"
mkdir -p "$out"
timeout 1500 python - "$out" <<'PY'
import json, sys, time
from pathlib import Path

import anyio
import openai

from miles_env.engines import SGLangEngineConfig, build_engine
from miles_env.engines._launch import servable_model_dir
from miles_env.http import serve_app
from miles_env.models import load_tokenizer, resolve_model
from miles_env.tito import TitoProxy, audit, create_app

out = Path(sys.argv[1]).resolve()


async def main() -> dict:
    t0 = time.perf_counter()
    engine = await build_engine(
        SGLangEngineConfig(launch=True, dtype="bfloat16", log_dir=str(out / "engine"),
                     server_args=["--mem-fraction-static", "0.5"])
    )
    started = time.perf_counter() - t0
    try:
        proxy = TitoProxy(engine, load_tokenizer(), store_dir=out / "sessions")
        async with serve_app(create_app(proxy)) as url:
            sid = proxy.create_session().session_id
            ep = proxy.endpoint(sid, url)
            client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            messages = [{"role": "user", "content": "Name a color."}]
            versions = []
            for i, follow in enumerate(["And another one?", "Which is warmer?", "Thanks."]):
                if i == 2:  # reload the same weights from disk under a new version
                    versions.append(await engine.update_weights_from_disk(servable_model_dir(resolve_model()), 1))
                r = await client.chat.completions.create(model=ep.model, messages=messages, max_tokens=24)
                messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                             {"role": "user", "content": follow}]
            await client.close()
            (traj,) = proxy.export(sid)
    finally:
        await engine.close()
    report = audit(out)
    turns = [(t.engine, t.weight_version) for t in traj.turns]
    ok = report.ok and len(turns) == 3 and turns[0] == ("sglang", 0) and turns[-1] == ("sglang", 1)
    return {"ok": ok, "start_s": round(started, 1), "turns": turns, "audit_drifts": report.by_kind(),
            "sampled_tokens": report.sampled_tokens, "transcript": messages}


result = anyio.run(main)
print(json.dumps(result))
(out / "result.json").write_text(json.dumps(result, indent=2))
sys.exit(0 if result["ok"] else 1)
PY

# Stage 2: the router in front of two real SGLang servers.
timeout 1500 python - "$out" <<'PY'
import json, sys
from pathlib import Path

import anyio

from miles_env.engines import SGLangEngineConfig
from miles_env.engines.base import SamplingParams
from miles_env.engines.router import start_router
from miles_env.engines.sglang import SGLangEngine, launch_sglang
from miles_env.http import free_port
from miles_env.models import load_tokenizer

out = Path(sys.argv[1]).resolve()
NEXT = "<|im_end|>\n<|im_start|>user\nAnd one more?<|im_end|>\n<|im_start|>assistant\n"


async def main() -> dict:
    cfg = SGLangEngineConfig(launch=True, dtype="bfloat16", log_dir=str(out / "engine-router"),
                             server_args=["--mem-fraction-static", "0.3"])
    workers = [await launch_sglang(cfg) for _ in range(2)]
    urls = [w.urls[0] for w in workers]
    router = await start_router(urls, free_port(), out / "engine-router" / "router.log")
    client = SGLangEngine(urls, router=router.spec.url, model_dir=workers[0].model_dir, servers=[router])
    tok, turns = load_tokenizer(), []
    try:
        for s in range(4):
            ids = tok.encode(f"<|im_start|>user\nSession {s}: name {s + 2} colors.<|im_end|>\n<|im_start|>assistant\n")
            prev = 0
            for t in range(3):
                gen = await client.generate(ids, SamplingParams(max_new_tokens=24, temperature=0.0), session_id=f"s{s}")
                turns.append({"session": s, "turn": t, "prompt": len(ids), "cached": gen.cached_tokens,
                              "sticky": t == 0 or gen.cached_tokens >= prev})
                prev = len(ids)
                ids = [*ids, *gen.output_ids, *tok.encode(NEXT)]
        stats = client.prefix_cache_stats()
    finally:
        await client.close()
        for w in workers:
            await w.close()
    return {"ok": all(t["sticky"] for t in turns), "prefix_cache_hit_rate": round(stats.hit_rate, 3),
            "turns": turns}


result = anyio.run(main)
print(json.dumps(result))
(out / "result-router.json").write_text(json.dumps(result, indent=2))
sys.exit(0 if result["ok"] else 1)
PY
