"""Distribution: named-axis meshes, differentiable collectives, the comm ledger, launching.

- `Mesh` arranges the ranks on named axes (``Mesh(dp=2, pp=2)``); collectives name an axis.
- `fscale.dist.collectives`: each collective beside its dual (the gradient), sync and async.
- `comm_ledger` records what every collective sends, for tests and tuning.
- `launch` / `init` start or join the process group.
"""

from fscale.dist.collectives import CollectiveMismatchError as CollectiveMismatchError
from fscale.dist.collectives import Pending as Pending
from fscale.dist.collectives import all_gather as all_gather
from fscale.dist.collectives import all_gather_start as all_gather_start
from fscale.dist.collectives import all_reduce as all_reduce
from fscale.dist.collectives import all_reduce_start as all_reduce_start
from fscale.dist.collectives import all_to_all as all_to_all
from fscale.dist.collectives import debug_enabled as debug_enabled
from fscale.dist.collectives import ppermute as ppermute
from fscale.dist.collectives import recv as recv
from fscale.dist.collectives import reduce_scatter as reduce_scatter
from fscale.dist.collectives import reduce_scatter_start as reduce_scatter_start
from fscale.dist.collectives import replicate as replicate
from fscale.dist.collectives import send as send
from fscale.dist.collectives import set_debug as set_debug
from fscale.dist.spawn import RankError as RankError
from fscale.dist.spawn import RankTimeoutError as RankTimeoutError
from fscale.dist.spawn import init as init
from fscale.dist.spawn import launch as launch
from fscale.dist.spawn import rank as rank
from fscale.dist.spawn import world_size as world_size
from fscale.dist.ledger import CommLedger as CommLedger
from fscale.dist.ledger import CommRecord as CommRecord
from fscale.dist.ledger import comm_ledger as comm_ledger
from fscale.dist.mesh import Mesh as Mesh
from fscale.dist.mesh import current_mesh as current_mesh

__all__ = [
    "CollectiveMismatchError",
    "CommLedger",
    "CommRecord",
    "Mesh",
    "Pending",
    "RankError",
    "RankTimeoutError",
    "all_gather",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "comm_ledger",
    "current_mesh",
    "debug_enabled",
    "init",
    "launch",
    "ppermute",
    "rank",
    "recv",
    "reduce_scatter",
    "reduce_scatter_start",
    "replicate",
    "send",
    "set_debug",
    "world_size",
]
