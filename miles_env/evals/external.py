"""`eval.mode: external`: each eval point's checkpoint goes to a user command or URL.

Concept: at an eval point the trainer's weights are exported, in line, as an HF model directory
(model.safetensors, config.json and the model's tokenizer files) to RUN_DIR/exports/step_NNNNNNNN
(the trainer's own checkpoints are its optimizer state, not a model another program loads). The
evaluator then runs in the evaluator's own task, one at a time, so training never waits for it:
- command: argv with `{checkpoint}` and `{step}` filled in (the path appended when no argument
  names it), env MILES_ENV_CHECKPOINT, MILES_ENV_STEP and MILES_ENV_EVAL_RESULTS (a file it may
  write); its stdout and stderr go to RUN_DIR/eval_external/step_NNNNNNNN.{stdout,stderr}. Its
  results are that file's JSON object, else the last JSON object line of its stdout.
- url: POST {"checkpoint": path, "step": step}; the response's JSON object is the results.
Results become `eval/<key>` metrics (nested keys joined by "/") in an `eval` row under the step,
with eval/external_s and eval/checkpoint. Invariant: a failing evaluator never stops the run: a
timeout (the command's process group killed) is `eval/external_error: "timeout after Ns"`, a
non-zero exit the exit code and its stderr's tail, each in that step's row. Only the newest
`keep_exports` evaluated exports are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import Process

from miles_env.errors import ConfigError
from miles_env.evals.base import EvalSetup, Evaluator, Metrics
from miles_env.evals.config import ExternalEvalConfig

__all__ = ["ExternalEval", "results_of"]

ERROR = "eval/external_error"
_TOKENIZER_FILES = (
    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "chat_template.jinja",
)  # fmt: skip


def _flatten(data: Mapping[str, Any], prefix: str = "eval/") -> Metrics:
    out: Metrics = {}
    for key, value in data.items():
        name = prefix + str(key).removeprefix("eval/")
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "/"))
        elif isinstance(value, bool | int | float):
            out[name] = float(value)
        elif isinstance(value, str):
            out[name] = value
    return out


def results_of(stdout: str, results_file: Path | None = None) -> dict[str, Any] | None:
    """The evaluator's JSON object: `results_file`'s if it holds one, else stdout's last JSON
    object (the last line that is one, or the whole stdout); None if there is none."""
    texts = [results_file.read_text(errors="replace")] if results_file and results_file.is_file() else []
    texts += [line for line in reversed(stdout.splitlines()) if line.strip().startswith("{")] + [stdout]
    for text in texts:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def _tail(text: str, lines: int = 5, chars: int = 500) -> str:
    kept = [line.strip() for line in text.strip().splitlines()[-lines:] if line.strip()]
    return " | ".join(kept)[-chars:]


def _kill(proc: Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: `sh -c 'sleep 1000'` leaves no sleeper
    except ProcessLookupError:
        pass


class ExternalEval(Evaluator):
    def __init__(self, setup: EvalSetup) -> None:
        super().__init__(setup)
        if setup.cfg.eval.external is None:
            raise ConfigError("eval.external: eval.mode=external needs external.command or external.url")
        self.ext: ExternalEvalConfig = setup.cfg.eval.external
        # argv, or the URL to POST to (ExternalEvalConfig holds exactly one of them)
        self.target: list[str] | str = self.ext.command if self.ext.command is not None else str(self.ext.url)
        self.exports = setup.cfg.run_dir / "exports"
        self.logs = setup.cfg.run_dir / "eval_external"
        self._one_at_a_time = anyio.Lock()
        self._evaluated: list[Path] = []  # exports whose eval finished, oldest first

    async def evaluate(self, step: int) -> None:
        try:
            path = await anyio.to_thread.run_sync(self._export, step)  # in line: the weights of `step`
        except Exception as e:  # recorded: nothing to hand over at this step; training goes on
            self.fail(step, e)
            return
        self.in_background(step, partial(self._evaluate, step, path))

    def _export(self, step: int) -> Path:
        path = self.setup.trainer.export_weights(self.exports / f"step_{step:08d}")
        for src in self.setup.model_path.iterdir():  # the tokenizer, so the export loads on its own
            if src.is_file() and (src.name.startswith("tokenizer") or src.name in _TOKENIZER_FILES):
                shutil.copy2(src, path / src.name)
        return path

    async def _evaluate(self, step: int, path: Path) -> Metrics:
        async with self._one_at_a_time:
            t0 = time.perf_counter()
            if isinstance(self.target, list):
                found = await self._run_command(self.target, step, path)
            else:
                found = await self._post(self.target, step, path)
            row = {**found, "eval/external_s": time.perf_counter() - t0, "eval/checkpoint": str(path)}
            self.setup.log.log(step, "eval", row)
            if ERROR in row:
                self.setup.say(f"[bold red]eval[/] step {step}: external evaluator: {row[ERROR]}")
            else:
                self.setup.say(f"[bold]eval[/] step {step}: external evaluator: {len(found)} metrics")
            self._evaluated.append(path)
            while len(self._evaluated) > self.ext.keep_exports:
                shutil.rmtree(self._evaluated.pop(0), ignore_errors=True)
            return row

    async def _run_command(self, command: list[str], step: int, path: Path) -> Metrics:
        argv = [a.replace("{checkpoint}", str(path)).replace("{step}", str(step)) for a in command]
        if not any("{checkpoint}" in a for a in command):
            argv.append(str(path))
        self.logs.mkdir(parents=True, exist_ok=True)
        base = self.logs / f"step_{step:08d}"
        out, err, results = (base.with_suffix(s) for s in (".stdout", ".stderr", ".results.json"))
        results.unlink(missing_ok=True)
        env = {**os.environ, "MILES_ENV_CHECKPOINT": str(path), "MILES_ENV_STEP": str(step),
               "MILES_ENV_EVAL_RESULTS": str(results)}  # fmt: skip
        with out.open("wb") as fo, err.open("wb") as fe:
            try:
                proc = await anyio.open_process(argv, stdout=fo, stderr=fe, env=env, start_new_session=True)
            except OSError as e:
                return {ERROR: f"cannot start {argv[0]!r}: {e.strerror or e}"}
            code = await self._wait(proc)
        if code is None:
            return {ERROR: f"timeout after {self.ext.timeout_s:g}s"}
        if code != 0:
            return {ERROR: f"exit code {code}: {_tail(err.read_text(errors='replace'))}",
                    "eval/external_exit_code": float(code)}  # fmt: skip
        data = results_of(out.read_text(errors="replace"), results)
        if data is None:
            return {ERROR: f"no JSON object in its stdout ({out}) or in MILES_ENV_EVAL_RESULTS"}
        return _flatten(data)

    async def _wait(self, proc: Process) -> int | None:
        """The exit code, or None once `timeout_s` passed (the process group killed)."""
        try:
            with anyio.move_on_after(self.ext.timeout_s):
                return await proc.wait()
            _kill(proc)
            return None
        except BaseException:  # cancelled with the run: leave no evaluator behind
            _kill(proc)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await proc.wait()

    async def _post(self, url: str, step: int, path: Path) -> Metrics:
        import httpx

        try:
            with anyio.fail_after(self.ext.timeout_s):
                async with httpx.AsyncClient(timeout=self.ext.timeout_s) as client:
                    resp = await client.post(url, json={"checkpoint": str(path), "step": step})
        except (TimeoutError, httpx.TimeoutException):
            return {ERROR: f"timeout after {self.ext.timeout_s:g}s"}
        except httpx.HTTPError as e:
            return {ERROR: f"{url}: {type(e).__name__}: {e}"}
        if resp.status_code >= 400:
            return {ERROR: f"HTTP {resp.status_code}: {_tail(resp.text)}"}
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return {ERROR: f"{url}: the response is not a JSON object"}
        return _flatten(data)
