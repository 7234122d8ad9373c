"""ZeRO-1/2: optimizer state (and gradients) sharded over a data-parallel axis."""

from fscale.parallel.zero.plan import ShardedOptimizerPlan as ShardedOptimizerPlan
from fscale.parallel.zero.plan import ShardedOptState as ShardedOptState
from fscale.parallel.zero.transform import shard_optimizer as shard_optimizer

__all__ = ["ShardedOptState", "ShardedOptimizerPlan", "shard_optimizer"]
