#!/usr/bin/env bash
# GPU check of the megatron backend's mixture-of-experts and context-parallel paths (issue 30): what
# the CPU tests cannot reach. Run by scripts/gpu-sglang-check.sh as its last stage, or alone. None of
# it has run on a GPU yet (no GPU was lent while it was written): read its first output with care.
#
# Stage 1 (one GPU): the tiny random Qwen3-MoE (miles_env.models.make_tiny_moe) on CUDA: megatron-core
# builds it with the all-to-all token dispatcher (the CPU runs use all-gather), its logits match HF's,
# one megatron step matches the torch backend's (aux loss included), and the hf engine on CUDA is
# reproduced by the torch trainer (zero KL) with the same routed experts.
# Stage 2 (two GPUs, nccl): expert parallel 2 (all-to-all over nccl) takes the single process's steps
# (tests/test_megatron_pp.py's worker, megatron_support.assert_same_run).
# Stage 3 (two GPUs + TransformerEngine): context parallel 2 (TE ring attention) takes the single
# process's steps. TE is installed into the venv if missing (pip builds its torch extension: slow).
# A stage that lacks its GPUs prints {"stage": ..., "skipped": "needs 2 GPUs, found 1"}: a skip for a
# missing GPU, as the tests' rule allows. Prints one JSON line per stage; exits non-zero on a failure.
# Usage: bash scripts/gpu-megatron-check.sh [OUT_DIR]      (env: PYTHON, the project venv's python)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-megatron-check}"
PY="${PYTHON:-python}"
command -v nvidia-smi >/dev/null || { echo "gpu-megatron-check: no nvidia-smi: this check needs a GPU" >&2; exit 2; }
gpus=$(nvidia-smi -L | wc -l)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "from miles_env.models import make_tiny_moe; make_tiny_moe('$out/moe', tokenizer=None)"

# Stage 1: one GPU.
timeout 900 "$PY" - "$out" <<'PY'
import json, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.megatron.backend import MegatronTrainer
from miles_env.trainer.torch_backend import TorchTrainer
from tests.megatron_support import odd_groups

out = Path(sys.argv[1])
model = out / "moe"
cfg = TrainerConfig(lr=1e-3, fused_adamw=False, max_tokens_per_microbatch=40)
mt = MegatronTrainer(model, cfg)
dispatcher = mt.model.decoder.layers[0].mlp.config.moe_token_dispatcher_type
hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1)).cuda()
with torch.no_grad():
    logit_diff = float((mt.logits(ids) - hf(input_ids=ids).logits).abs().max())
m_mc = mt.train_step(odd_groups())
m_pt = TorchTrainer(model, cfg).train_step(odd_groups())
rel = {k: abs(m_mc[k] - m_pt[k]) / max(abs(m_pt[k]), 1e-12) for k in ("loss", "grad_norm", "moe_aux_loss")}
ok = dispatcher == "alltoall" and logit_diff < 1e-4 and all(v < 1e-3 for v in rel.values())
result = {"stage": "moe-one-gpu", "ok": ok, "dispatcher": dispatcher, "logit_diff": logit_diff, "rel_diff": rel}
print(json.dumps(result))
(out / "result-moe.json").write_text(json.dumps(result, indent=2))
sys.exit(0 if ok else 1)
PY
timeout 600 "$PY" -m pytest -x -q tests/test_moe_engine.py -p no:cacheprovider  # the hf engine on CUDA (device auto)

# Stages 2 and 3: two GPUs.
compare() {  # compare OUT_ONE OUT_MANY STAGE
  "$PY" - "$1" "$2" "$3" <<'PY'
import json, sys
from pathlib import Path

from tests.megatron_support import assert_same_run

one, many, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, many))
try:
    assert_same_run(one, many, m1, m2, lr=1e-3)
    ok, why = True, ""
except AssertionError as e:
    ok, why = False, str(e)[:500]
print(json.dumps({"stage": stage, "ok": ok, "loss": [m1[0]["loss"], m2[0]["loss"]], "why": why}))
sys.exit(0 if ok else 1)
PY
}
run() {  # run NPROC OUT ARGS...   (tests/test_megatron_pp.py: MODEL PP KL D TP EP ODD CP)
  local n=$1 dir=$2; shift 2
  timeout 900 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" tests/test_megatron_pp.py "$dir" "$@" \
    > "$dir.log" 2>&1 || { tail -40 "$dir.log"; return 1; }
}
if (( gpus < 2 )); then
  echo "{\"stage\": \"ep2-nccl\", \"skipped\": \"needs 2 GPUs, found $gpus\"}"
  echo "{\"stage\": \"cp2-te\", \"skipped\": \"needs 2 GPUs, found $gpus\"}"
  exit 0
fi
run 1 "$out/one" "$out/moe" 1 0.1 0 1 1 1 1
run 2 "$out/ep2" "$out/moe" 1 0.1 0 1 2 1 1
compare "$out/one" "$out/ep2" ep2-nccl
"$PY" -c "import transformer_engine.pytorch" 2>/dev/null || {
  echo "gpu-megatron-check: installing transformer_engine[pytorch] (builds against this torch)"
  "$PY" -m pip install --quiet --no-build-isolation "transformer_engine[pytorch]"
}
run 2 "$out/cp2" "$out/moe" 1 0.1 0 1 1 1 2
compare "$out/one" "$out/cp2" cp2-te
