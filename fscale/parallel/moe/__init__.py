"""Mixture of experts: top-k gating, capacity or dropless dispatch, expert parallelism.

- `moe_dispatch` (`dispatch`): the layer as a pure function, dense or over an expert-parallel
  mesh axis; gating in `gating`, capacity in `capacity`, the exchanges in `exchange`.
- `MoE` (`layer`): the layer as an ``nn.Module`` of stacked MLP experts.
- `expert_parallel` (`plan`): the Step transformation that shards the experts over an axis.
"""

from fscale.parallel.moe.dispatch import MoEDispatch as MoEDispatch
from fscale.parallel.moe.dispatch import moe_dispatch as moe_dispatch
from fscale.parallel.moe.layer import MoE as MoE
from fscale.parallel.moe.layer import expert_mlp as expert_mlp
from fscale.parallel.moe.plan import ExpertParallelPlan as ExpertParallelPlan
from fscale.parallel.moe.plan import expert_parallel as expert_parallel
from fscale.parallel.moe.plan import is_expert_name as is_expert_name
