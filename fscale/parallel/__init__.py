"""Parallel strategies as Step transformations: data parallel (DDP), ZeRO, fully sharded."""

from fscale.parallel.data import data_parallel as data_parallel
from fscale.parallel.fsdp import fully_shard as fully_shard
from fscale.parallel.zero import ShardedOptState, consolidate, shard_optimizer, shard_state  # noqa: F401

__all__ = ["data_parallel", "fully_shard"]
