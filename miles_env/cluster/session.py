"""Joining the Ray cluster once per driver process, whoever asks first.

Concept: the placed engines (engines.py) are built before the rollout workers (driver.py), and
both need the driver connected to Ray. `join(address)` connects if this process is not connected
yet and says whether this call did; the caller that joined is the one that leaves (`leave`), so
the engines' client, closed last, keeps the connection until its actors are killed.
"""

from __future__ import annotations

import logging

from miles_env.errors import ClusterError, ConfigError

__all__ = ["join", "leave"]


def join(address: str) -> bool:
    """Connect this process to the Ray cluster at `address`; False if it already was."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"cluster.address: Ray is not installed ({e}); pip install 'miles-env[scale]'"
        ) from e
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cluster.address={address!r}: cannot join the Ray cluster: {e}") from e
    return True


def leave(joined: bool) -> None:
    """Disconnect, if `joined` says this caller's `join` connected."""
    if joined:
        import ray

        ray.shutdown()
