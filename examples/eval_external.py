"""An external evaluator for `eval.mode: external`: score one exported checkpoint, print JSON.

`miles-env train` runs it at every eval point with the export's path as its last argument (also
in MILES_ENV_CHECKPOINT, the step in MILES_ENV_STEP). It loads the checkpoint with transformers
on CPU and reports the mean negative log-likelihood of a few reference shell answers under the
chat template; its last stdout line, a JSON object, becomes `eval/nll` and `eval/answers` in
metrics.jsonl under that step. Replace the body with your own benchmark.

    python examples/eval_external.py RUN_DIR/exports/step_00000002
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PAIRS = [
    ("Create an empty file named notes.txt.", "```sh\ntouch notes.txt\n```"),
    ("Write the word hello into greeting.txt.", "```sh\necho hello > greeting.txt\n```"),
    ("Make a directory called build.", "```sh\nmkdir build\n```"),
]


def nll(model: torch.nn.Module, tok: Any, question: str, answer: str) -> float:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tok(answer, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + a_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logp.gather(1, targets[:, None])[:, 0][len(p_ids) - 1 :]
    return float(-picked.mean())


def main(path: str) -> None:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    scores = [nll(model, tok, q, a) for q, a in PAIRS]
    print(json.dumps({"nll": sum(scores) / len(scores), "answers": len(scores)}))


if __name__ == "__main__":
    main(sys.argv[-1])
