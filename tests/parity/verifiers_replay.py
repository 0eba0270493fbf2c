"""verifiers' own offline re-scoring (what `vf-replay` does) of a recorded episode trace.

argv: IN.json {"trace", "taskset", "path"} OUT.json {"reward", "rewards"}. The trace is
verifiers' own record of our episode (`keep_trace`); its scores are cleared and recomputed by
the taskset's Task.score, as vf-replay re-scores a saved run.
"""

import asyncio
import json
import sys

p = json.loads(open(sys.argv[1]).read())
sys.path.insert(0, p["path"])


async def main() -> None:
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import WireAgentConfig
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.task import WireTaskData
    from verifiers.v1.trace import Trace

    task_cls = vf.task_type(p["taskset"])
    trace = Trace[WireTaskData, state_cls(task_cls), WireAgentConfig].model_validate(p["trace"])
    row = task_cls.data_type().model_validate(trace.task.data.model_dump())
    trace.rewards, trace.metrics = {}, {}
    await task_cls(row, config=TasksetConfig(id=p["taskset"]).task).score(trace)
    rewards = {k: (v.score if v is not None else None) for k, v in trace.rewards.items()}
    open(sys.argv[2], "w").write(json.dumps({"reward": trace.reward, "rewards": rewards}))


asyncio.run(main())
