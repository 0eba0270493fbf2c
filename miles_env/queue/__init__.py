"""The replay queue: episodes in, leased GRPO groups out, on SQLite or Redis.

Layout: `contract.py` is the surface every backend offers (`ReplayQueue`) and the values it
trades in (`Lease`, `OpenGroup`, `QueueStats`, `GroupState`, `QueueError`, `group_version`);
`codec.py` is an episode's stored bytes and their checksum; `sqlite.py` (with `sqlite_db.py`,
the connection per thread, and `sqlite_schema.py`, the tables) is the embedded default;
`redis.py` (with `redis_scripts.py`, its Lua) the shared one; `aio.py` the anyio face of either;
`config.py` the run config's `queue:` section and `build_queue`, which imports a backend only
when it is chosen.

Layering: the backends import the contract, the codec and the async face, never each other;
nothing here imports the rest of the project but `miles_env.types`, `errors` and `jsonio`. This
package imports nothing on its own, so `miles_env.queue.config` loads no backend.
"""
