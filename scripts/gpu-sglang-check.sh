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
# it, so the turn reached the server holding its prefix). Then LoRA and OPD scoring (issue 19) on one
# server started with `--enable-lora --max-lora-rank 8 --lora-target-modules all`: the trainer's
# adapter (PEFT dir, all seven projections) loaded through /load_lora_adapter must make the server's
# logprobs the trainer's (float32 CPU reference, bf16 tolerance) and bump the weight version, and
# `score` (prefill-only /generate) must give the base model's logprobs. Prints one JSON line per
# stage and exits 0 on success. Stage 4 runs scripts/gpu-megatron-check.sh (MoE, ep, cp on GPUs).
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

# Stage 3: LoRA adapter sync and OPD scoring on a real SGLang server (issue 19).
timeout 1500 python - "$out" <<'PY'
import json, sys
from pathlib import Path

import anyio
import torch

from miles_env.engines import SGLangEngineConfig, build_engine
from miles_env.engines.base import SamplingParams
from miles_env.models import load_tokenizer
from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.lora import sync_adapter
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Trajectory

out = Path(sys.argv[1]).resolve()
ids = load_tokenizer().encode("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")


def reference(trainer: TorchTrainer, seq: list[int]) -> torch.Tensor:
    traj = Trajectory(token_ids=seq, loss_mask=[0] * len(ids) + [1] * (len(seq) - len(ids)), logprobs=[0.0] * len(seq))
    return trainer.logprobs([traj])[0]


async def main() -> dict:
    lora = TorchTrainer("smollm2", TrainerConfig(device="cpu", lora=LoraConfig(rank=8, alpha=16)))
    with torch.no_grad():  # a trained-looking adapter (B = 0 at init would change nothing)
        for p in lora.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.07)
    base = TorchTrainer("smollm2", TrainerConfig(device="cpu"))
    engine = await build_engine(SGLangEngineConfig(
        launch=True, dtype="bfloat16", log_dir=str(out / "engine-lora"),
        server_args=["--mem-fraction-static", "0.5", "--enable-lora", "--max-lora-rank", "8",
                     "--lora-target-modules", "all"]))
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    try:
        before = await engine.generate(ids, greedy)
        seq = [*ids, *before.output_ids]
        [scored] = await engine.score([seq])  # OPD's teacher call: prefill-only, the base model
        base_ref = reference(base, seq)
        score_diff = float((torch.tensor(scored[1:]) - base_ref[1:]).abs().mean())
        sync = await sync_adapter(lora, engine, 1, out / "lora-weights")
        after = await engine.generate(ids, greedy)
    finally:
        await engine.close()
    n = len(ids)
    lora_ref = reference(lora, [*ids, *after.output_ids])[n:]
    base_on_after = reference(base, [*ids, *after.output_ids])[n:]
    lora_diff = float((torch.tensor(after.logprobs) - lora_ref).abs().mean())
    adapter_effect = float((lora_ref - base_on_after).abs().mean())
    ok = (len(scored) == len(seq) and scored[0] == 0.0 and score_diff < 0.05 and before.weight_version == 0
          and after.weight_version == 1 and lora_diff < 0.05 and adapter_effect > 4 * lora_diff
          and sync["sync_bytes"] < 0.05 * sync["sync_full_bytes"])
    return {"ok": ok, "score_vs_base_mean_abs": round(score_diff, 4), "lora_vs_trainer_mean_abs": round(lora_diff, 4),
            "adapter_effect_mean_abs": round(adapter_effect, 4), "versions": [before.weight_version, after.weight_version],
            "sync_bytes": sync["sync_bytes"], "sync_full_bytes": sync["sync_full_bytes"]}


result = anyio.run(main)
print(json.dumps(result))
(out / "result-lora.json").write_text(json.dumps(result, indent=2))
sys.exit(0 if result["ok"] else 1)
PY

# Stage 4: the megatron backend's mixture-of-experts and context-parallel paths (issue 30), in their
# own script: the MoE on one GPU (all-to-all dispatch), and with two GPUs ep=2 over nccl and cp=2 (TE).
PYTHON=python bash scripts/gpu-megatron-check.sh "$out/megatron"
