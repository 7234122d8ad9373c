"""Parallel strategies as Step transformations: data parallel (DDP), ZeRO-1/2, fully sharded,
gradient accumulation. Each wraps the step's plan in a layer, so they compose in any order
that makes sense (see `fscale.plan` and `fscale.parallel.layers`). Megatron tensor parallelism
(`tensor_parallel`, `fscale.parallel.tensor`) transforms the module instead, and any of the
Step transformations trains its result over another axis.

`consolidate(step, state)` turns a sharded TrainState into the full one a single-process step
takes, and `shard_state(step, full_state)` shards a full state for any world size; both work for
every plan.
"""

from fscale.parallel import tensor as tensor
from fscale.parallel.accumulate import AccumulatePlan as AccumulatePlan
from fscale.parallel.accumulate import accumulate as accumulate
from fscale.parallel.ddp import DataParallelPlan as DataParallelPlan
from fscale.parallel.ddp import HookState as HookState
from fscale.parallel.ddp import data_parallel as data_parallel
from fscale.parallel.fsdp import FullyShardPlan as FullyShardPlan
from fscale.parallel.fsdp import fully_shard as fully_shard
from fscale.parallel.moe import ExpertParallelPlan as ExpertParallelPlan
from fscale.parallel.moe import MoEDispatch as MoEDispatch
from fscale.parallel.moe import expert_parallel as expert_parallel
from fscale.parallel.moe import moe_dispatch as moe_dispatch
from fscale.parallel.pipeline import DeferredBatchNorm as DeferredBatchNorm
from fscale.parallel.pipeline import PipelinePlan as PipelinePlan
from fscale.parallel.pipeline import Schedule as Schedule
from fscale.parallel.pipeline import ScheduleError as ScheduleError
from fscale.parallel.pipeline import StageContractError as StageContractError
from fscale.parallel.pipeline import balance_by_size as balance_by_size
from fscale.parallel.pipeline import balance_by_time as balance_by_time
from fscale.parallel.pipeline import deferred_batch_norm as deferred_batch_norm
from fscale.parallel.pipeline import pipeline_chart as pipeline_chart
from fscale.parallel.reduce import BucketInfo as BucketInfo
from fscale.parallel.state import consolidate as consolidate
from fscale.parallel.state import shard_state as shard_state
from fscale.parallel.tensor import gpt_plan as gpt_plan
from fscale.parallel.tensor import llama_plan as llama_plan
from fscale.parallel.tensor import tensor_parallel as tensor_parallel
from fscale.parallel.tensor import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fscale.parallel.zero import ShardedOptimizerPlan as ShardedOptimizerPlan
from fscale.parallel.zero import ShardedOptState as ShardedOptState
from fscale.parallel.zero import shard_optimizer as shard_optimizer

__all__ = [
    "AccumulatePlan",
    "BucketInfo",
    "DataParallelPlan",
    "DeferredBatchNorm",
    "ExpertParallelPlan",
    "FullyShardPlan",
    "HookState",
    "MoEDispatch",
    "PipelinePlan",
    "Schedule",
    "ScheduleError",
    "ShardedOptState",
    "ShardedOptimizerPlan",
    "StageContractError",
    "accumulate",
    "balance_by_size",
    "balance_by_time",
    "consolidate",
    "data_parallel",
    "deferred_batch_norm",
    "expert_parallel",
    "fully_shard",
    "gpt_plan",
    "llama_plan",
    "moe_dispatch",
    "pipeline_chart",
    "shard_optimizer",
    "shard_state",
    "tensor",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
