"""Parallel strategies as Step transformations: data parallel (DDP), ZeRO-1/2, fully sharded.

`consolidate(step, state)` turns a sharded TrainState into the full one a single-process step
takes, and `shard_state(step, full_state)` shards a full state for any world size; both work for
every strategy here.
"""

from fscale.parallel.ddp import data_parallel as data_parallel
from fscale.parallel.fsdp import fully_shard as fully_shard
from fscale.parallel.zero import ShardedOptState as ShardedOptState
from fscale.parallel.state import consolidate as consolidate
from fscale.parallel.state import shard_state as shard_state
from fscale.parallel.zero import shard_optimizer as shard_optimizer

__all__ = [
    "ShardedOptState",
    "consolidate",
    "data_parallel",
    "fully_shard",
    "shard_optimizer",
    "shard_state",
]
