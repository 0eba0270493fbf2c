"""The main job, `miles-env train CONFIG`: agentic RL in one process (or a Ray cluster's driver).

Layout: `plan.py` resolves the run config and builds what it names (environment, harness, engine,
trainer, rollout dispatch); `run.py` wires them into the one training loop and runs it
(`run_training`); `sync.py` moves the trainer's weights to the engine after each step.
"""
