"""Executors: where an operation's shards of prompts run (in this process, or on a Ray cluster).

    contract.py   Sharded: the hooks a sharded operation states (prepare_for, shard_batches, phases,
                  before_phase, execute_shard, summarise) and what passes between them
    config.py     InProcess (the default) and Ray (address, workers, resources_per_worker, shard_size, ...)
    spec.py       the model spec a worker loads its replica from (never the model itself)
    shards.py     shard planning (whole length-grouped batches), the PerPrompt intermediate, merge
    store.py      per-shard Parquet files in RUN/shards (resume skips those already there)
    ray_pool.py   Ray actors holding one replica each; restarts and retries for killed workers
    driver.py     phases, the driver's global steps, merge and summarise
"""

from .config import Executor, InProcess, Ray, as_executor
from .contract import Sharded
from .shards import PerPrompt


def shutdown() -> None:
    """End the Ray workers this process started (and its local Ray cluster)."""
    from .ray_pool import shutdown as _shutdown

    _shutdown()


__all__ = ["Executor", "InProcess", "PerPrompt", "Ray", "Sharded", "as_executor", "shutdown"]
