"""HUD's own grader on a recorded answer: the env file's task started and graded by HUD's TaskRunner.

argv: IN.json {"env_file", "template", "args", "answer"} OUT.json {"score"}.
"""

import asyncio
import json
import sys

from hud.environment import Environment
from hud.environment.server import TaskRunner
from hud.utils.modules import load_module


async def main() -> None:
    p = json.loads(open(sys.argv[1]).read())
    module = load_module(p["env_file"])
    (env,) = [v for v in vars(module).values() if isinstance(v, Environment)]
    runner = TaskRunner(env.tasks[p["template"]], p["args"])
    await runner.start()
    frame = await runner.grade({"answer": p["answer"]})
    open(sys.argv[2], "w").write(json.dumps({"score": frame["score"]}))


asyncio.run(main())
