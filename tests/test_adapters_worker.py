"""The worker protocol under failure: a worker that crashes, hangs or writes garbage (injected)."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from miles_env.adapters.framework_harness import FrameworkHarness
from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient, WorkerError, call_once
from miles_env.adapters.worker_pool import _POOL
from miles_env.types import Status, Task

FAULTY = """
import asyncio, os, sys
sys.path.insert(0, {workers!r})
import _rpc

async def echo(p): return p
async def crash(p): os._exit(3)
async def hang(p): await asyncio.sleep(3600)
async def stoppable(p):
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        with open(p["flag"], "w") as f:
            f.write("cleaned up")
        raise
async def late(p):  # answers a cancel only after the caller has gone
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(p["delay"])
        raise
async def quick(p):  # finishes while its caller is being cancelled: the result goes out anyway
    await asyncio.sleep(p["delay"])
    return "done"
async def pid(p): return os.getpid()
async def garbage(p):
    _rpc._out.write("this is not json\\n"); _rpc._out.flush(); await asyncio.sleep(3600)
async def noisy(p):
    print("framework chatter on stdout"); os.system("echo child chatter"); return "clean"
async def boom(p): raise ValueError("bad input: " + str(p))
async def ask_host(p): return await _rpc.host_call("double", {{"x": p["x"]}})
_rpc.serve(dict(echo=echo, crash=crash, hang=hang, stoppable=stoppable, late=late, quick=quick, pid=pid, garbage=garbage, noisy=noisy, boom=boom, ask_host=ask_host,
                info=crash),
           {{"framework": "faulty"}})
"""


@pytest.fixture
def faulty(tmp_path: Path) -> list[str]:
    path = tmp_path / "faulty_worker.py"
    path.write_text(FAULTY.format(workers=str(WORKERS_DIR)))
    return [sys.executable, "-u", str(path)]


def test_calls_errors_and_recovery(faulty: list[str]) -> None:
    async def main() -> None:
        w = WorkerClient(faulty, name="faulty")
        assert await w.call("echo", {"a": 1}) == {"a": 1}
        assert w.ready_info["framework"] == "faulty"
        assert await w.call("noisy") == "clean"  # stdout chatter cannot corrupt the stream
        with pytest.raises(WorkerError, match="ValueError: bad input"):
            await w.call("boom", {"k": 2})
        assert await w.call("echo", 5) == 5  # an error answer keeps the worker
        with pytest.raises(WorkerError, match="exited with code 3"):
            await w.call("crash")
        assert await w.call("echo", "again") == "again"  # restarted on the next call
        with pytest.raises(WorkerError, match="did not answer 'hang' within 0.5s"):
            await w.call("hang", timeout=0.5)
        with pytest.raises(WorkerError, match="protocol error: not JSON"):
            await w.call("garbage", timeout=10)
        w.callbacks["double"] = _double
        assert await w.call("ask_host", {"x": 21}) == 42
        await w.aclose()

    anyio.run(main)


async def _double(p: dict) -> int:
    return int(p["x"]) * 2


def test_concurrent_calls_and_crash_fails_all_pending(faulty: list[str]) -> None:
    async def main() -> None:
        w = WorkerClient(faulty, name="faulty")
        results: list[object] = []

        async def one(i: int) -> None:
            results.append(await w.call("echo", i))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
        assert sorted(results) == list(range(20))  # type: ignore[type-var]
        errors: list[str] = []

        async def crash() -> None:
            with pytest.raises(WorkerError, match="exited with code 3"):
                await w.call("crash")

        async def pending() -> None:
            try:
                await w.call("hang", timeout=30)
            except WorkerError as e:
                errors.append(str(e))

        async with anyio.create_task_group() as tg:
            tg.start_soon(pending)
            await anyio.sleep(0.3)
            tg.start_soon(crash)
        assert errors and "exited with code 3" in errors[0]
        await w.aclose()

    anyio.run(main)


def test_call_once_and_missing_python(faulty: list[str]) -> None:
    assert call_once(faulty, "echo", {"z": 1}) == {"z": 1}
    with pytest.raises(WorkerError, match="could not start"):
        call_once(["/nonexistent/python"], "echo", {})


def test_faulty_worker_fails_the_episode_and_the_run_goes_on(faulty: list[str]) -> None:
    """An adapter episode whose worker crashes is FAILED with the error kept; the next one runs.

    The real OpenEnv episode (`isolation="none"`) on the pooled worker for target T, which is
    the faulty one: its `info` (the episode's first call) exits the process.
    """
    from miles_env.harness import Endpoint

    task = Task(
        id="seed-0",
        env="openenv:x",
        instruction="x",
        metadata={"adapter": "openenv", "target": "T", "seed": 0},
    )
    key = ("openenv", "openenv_worker.py", "T")
    _POOL.clear()
    _POOL[key] = WorkerClient(faulty, name="openenv")

    async def main() -> list[object]:
        harness = FrameworkHarness(isolation="none")
        ep = Endpoint("http://127.0.0.1:9/v1", "k", "s")
        out = [await harness.run(task, None, ep)]  # type: ignore[arg-type]
        out.append(await _POOL[key].call("echo", "still alive"))
        await _POOL[key].aclose()
        return out

    try:
        res, alive = anyio.run(main)
    finally:
        _POOL.clear()
    assert res.status is Status.FAILED and "exited with code 3" in (res.error or "")  # type: ignore[attr-defined]
    assert alive == "still alive"


@pytest.mark.parametrize("method", ["late", "quick"])
def test_a_late_reply_to_a_cancelled_call_is_dropped_and_the_worker_lives_on(
    faulty: list[str], method: str
) -> None:
    """The worker's answer to a cancelled id arrives after the caller forgot it: not a protocol error.

    `late` answers the cancel with CancelledError 0.3 s later; `quick` sends its result while the
    caller is being cancelled. Either way the same worker (same pid) serves the next calls: one
    episode's timeout must not kill the pooled worker every other episode shares.
    """

    async def main() -> tuple[int, int, str]:
        client = WorkerClient(faulty, name="faulty")
        try:
            before = int(await client.call("pid"))
            with anyio.move_on_after(0.2):
                await client.call(method, {"delay": 0.25 if method == "quick" else 0.3})
            await anyio.sleep(0.6)  # the late reply lands here, after the call has returned
            after = int(await client.call("pid"))
            return before, after, str(await client.call("echo", "still here"))
        finally:
            await client.aclose()

    before, after, echo = anyio.run(main)
    assert echo == "still here" and before == after


def test_a_cancelled_call_cancels_the_request_in_the_worker(faulty: list[str], tmp_path: Path) -> None:
    """The caller's cancellation reaches the worker's handler, which can clean up; the worker lives on."""
    flag = tmp_path / "flag.txt"

    async def main() -> str:
        client = WorkerClient(faulty, name="faulty")
        try:
            with anyio.move_on_after(1.0):
                await client.call("stoppable", {"flag": str(flag)})
            for _ in range(100):
                if flag.exists():
                    break
                await anyio.sleep(0.05)
            return str(await client.call("echo", "still here"))
        finally:
            await client.aclose()

    assert anyio.run(main) == "still here"
    assert flag.read_text() == "cleaned up"
