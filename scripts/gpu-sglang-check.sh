#!/usr/bin/env bash
# One-shot end-to-end check of the `sglang` engine against a REAL SGLang server on a GPU machine.
# It does not run on CPU-only machines (SGLang installs from PyPI there but cannot serve).
#
# Steps: install sglang into its own venv (CACHE/engines/sglang, found by SGLangEngineConfig launch),
# launch it as a managed subprocess on the SmolLM2 checkpoint (our GGUF-converted one, shadowed
# without its stale quantization_config), then drive it through the TITO proxy with the official
# openai client: a 2-turn session, a weight reload from disk with a version bump, a 3rd turn, and
# `tito audit` on the store. Prints one JSON line and exits 0 on success.
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
