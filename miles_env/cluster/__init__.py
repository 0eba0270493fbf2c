"""Scale-out of `miles-env train` on a Ray cluster (the `cluster` section; `scale` extra).

`config.py` is the section (pydantic only, composed by the run config); `driver.py` joins the
cluster from the `miles-env train` process, serves its engine to the workers and dispatches
groups to them; `worker.py` is the `RolloutWorker` actor. Ray is imported only by the latter two.
"""

from miles_env.cluster.config import ClusterConfig

__all__ = ["ClusterConfig"]
