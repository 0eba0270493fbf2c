"""Scale-out of `miles-env train` on a Ray cluster (the `cluster` section; `scale` extra).

`config.py` is the section (pydantic only, composed by the run config); `session.py` joins the
cluster once per driver; `driver.py` serves the engine to the workers, dispatches groups to them
and replaces the ones that die; `worker.py` is the `RolloutWorker` actor; `engines.py` places the
engines as actors (`cluster.engines`) and `engine_faults.py` replaces one that dies, on the current
weights, before it joins any ring; `trainer.py` places the trainer as one (`cluster.trainer`).
Ray is imported only by the modules that need it, and lazily.
"""

from miles_env.cluster.config import ClusterConfig

__all__ = ["ClusterConfig"]
