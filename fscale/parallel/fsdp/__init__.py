"""ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded over an axis."""

from fscale.parallel.fsdp.gather import GatherStats as GatherStats
from fscale.parallel.fsdp.gather import track_gathers as track_gathers
from fscale.parallel.fsdp.transform import FullyShardPlan as FullyShardPlan
from fscale.parallel.fsdp.transform import fully_shard as fully_shard

__all__ = ["FullyShardPlan", "GatherStats", "fully_shard", "track_gathers"]
