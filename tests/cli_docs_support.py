"""Helpers for running docs/harnesses.md as written (a helpers module, not a test module).

`doc_blocks(text)` are the page's ```sh blocks and `doc_commands(block)` a block's commands
(continuation lines joined, heredoc bodies kept inside their command, comments dropped);
`run_doc(cmd, cwd, ...)` runs a command or a whole block with bash in a scratch directory,
`/path/to/ckpt` standing for the checkpoint given, and returns the process; `run_cli(cmd)` runs
a plain `miles-env ...` command in this process (the same argv, without the interpreter's start). `make_done_model(path)` writes the checkpoint the commands that name `--model
/path/to/ckpt` get: a real HF Llama checkpoint (one layer, hidden 32, the SmolLM2 tokenizer, 32k
positions) whose weights are set so that it answers every prompt "Done." and stops, the way
a scripted policy would, but through the hf engine: prefill of a CLI's 12k-token prompt costs it
milliseconds, and its sampled ids and logprobs are the engine's like any model's.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

__all__ = ["DOCS", "doc_blocks", "doc_commands", "make_done_model", "run_cli", "run_doc"]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "harnesses.md"
_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def doc_blocks(text: str) -> list[str]:
    return [str(b) for b in _BLOCK.findall(text)]


def doc_commands(block: str) -> list[str]:
    """Each command of a ```sh block: a line, its backslash continuations, and a heredoc's body."""
    out: list[str] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cmd = [line]
        while cmd[-1].rstrip().endswith("\\") and i < len(lines):
            cmd.append(lines[i])
            i += 1
        heredoc = re.search(r"<<-?'?(\w+)'?", " ".join(cmd))
        if heredoc:
            while i < len(lines):
                cmd.append(lines[i])
                i += 1
                if lines[i - 1].strip() == heredoc.group(1):
                    break
        out.append("\n".join(cmd))
    return out


def run_doc(
    cmd: str,
    cwd: Path,
    checkpoint: Path | None = None,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`cmd` as a user would run it (bash, in `cwd`, this venv's `miles-env` on PATH)."""
    if checkpoint is not None:
        cmd = cmd.replace("/path/to/ckpt", str(checkpoint))
    bindir = str(Path(os.sys.executable).parent)
    full = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", cmd], cwd=cwd, env=full, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def run_cli(cmd: str, checkpoint: Path | None = None) -> tuple[int, str]:
    """A `miles-env ...` command (no shell syntax but a trailing comment) run in this process, in
    the current directory: (exit code, output)."""
    import shlex

    from typer.testing import CliRunner

    from miles_env.cli.main import app

    if checkpoint is not None:
        cmd = cmd.replace("/path/to/ckpt", str(checkpoint))
    argv = shlex.split(cmd.replace("\\\n", " "), comments=True)
    assert argv[0] == "miles-env", argv
    res = CliRunner().invoke(app, argv[1:], catch_exceptions=False)
    return res.exit_code, res.output


def make_done_model(path: Path) -> Path:
    """A checkpoint that answers "Done." to every chat prompt (SmolLM2's template ends it with
    "<|im_start|>assistant\\n"), then its end-of-turn token.

    How: the layers add nothing to the residual stream (zero output projections), so the next
    token depends on the last one alone; every embedding has a constant first coordinate, which the
    untied head maps to <|im_end|>, and "\\n" and "Done" have one coordinate of their own each,
    which the head maps to "Done" and "." with twice the weight: a bigram table, sharp enough
    (logit gaps > 200) that sampling at temperature 1 follows it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles_env.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    newline, done, dot = tok.encode("\n")[-1], *tok.encode("Done.")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=False, eos_token_id=end, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 0] = 1.0
        head[end, 0] = 30.0
        for slot, (token, successor) in enumerate(((newline, done), (done, dot)), start=1):
            emb[token, slot] = 2.0
            head[successor, slot] = 60.0
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
