"""Distribution: named-axis meshes, differentiable collectives, the comm ledger, launching.

- `Mesh` arranges the ranks on named axes (``Mesh(dp=2, pp=2)``); collectives name an axis.
- `fscale.distributed.collectives`: each collective beside its dual (the gradient), sync and async.
- `comm_ledger` records what every collective sends, for tests and tuning.
- `launch` / `init` start or join the process group; `shutdown` leaves it.
- Ranks of one host move host tensors' bucket collectives through shared memory
  (`fscale.distributed.shared_memory`; `set_shared_memory(False)` keeps gloo).
- Ranks that disagree on a collective fail on every rank within `collective_timeout()` seconds
  (`fscale.distributed.watchdog`); `set_debug` checks every collective.
"""

from fscale.distributed.collectives import CollectiveMismatchError as CollectiveMismatchError
from fscale.distributed.collectives import CollectiveTimeoutError as CollectiveTimeoutError
from fscale.distributed.collectives import Pending as Pending
from fscale.distributed.collectives import all_gather as all_gather
from fscale.distributed.collectives import all_gather_start as all_gather_start
from fscale.distributed.collectives import all_reduce as all_reduce
from fscale.distributed.collectives import all_reduce_start as all_reduce_start
from fscale.distributed.collectives import all_to_all as all_to_all
from fscale.distributed.collectives import broadcast as broadcast
from fscale.distributed.collectives import collective_timeout as collective_timeout
from fscale.distributed.collectives import debug_enabled as debug_enabled
from fscale.distributed.collectives import ppermute as ppermute
from fscale.distributed.collectives import recv as recv
from fscale.distributed.collectives import reduce_scatter as reduce_scatter
from fscale.distributed.collectives import reduce_scatter_start as reduce_scatter_start
from fscale.distributed.collectives import replicate as replicate
from fscale.distributed.collectives import replicate_many as replicate_many
from fscale.distributed.collectives import send as send
from fscale.distributed.collectives import set_collective_timeout as set_collective_timeout
from fscale.distributed.collectives import set_debug as set_debug
from fscale.distributed.ledger import CommLedger as CommLedger
from fscale.distributed.ledger import CommRecord as CommRecord
from fscale.distributed.ledger import comm_ledger as comm_ledger
from fscale.distributed.mesh import Mesh as Mesh
from fscale.distributed.mesh import current_mesh as current_mesh
from fscale.distributed.shared_memory import set_shared_memory as set_shared_memory
from fscale.distributed.shared_memory import shared_memory_enabled as shared_memory_enabled
from fscale.distributed.spawn import RankError as RankError
from fscale.distributed.spawn import RankTimeoutError as RankTimeoutError
from fscale.distributed.spawn import init as init
from fscale.distributed.spawn import launch as launch
from fscale.distributed.spawn import rank as rank
from fscale.distributed.spawn import shutdown as shutdown
from fscale.distributed.spawn import world_size as world_size
from fscale.distributed.uneven import all_to_all_uneven as all_to_all_uneven

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
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
    "all_to_all_uneven",
    "broadcast",
    "collective_timeout",
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
    "replicate_many",
    "send",
    "set_collective_timeout",
    "set_debug",
    "set_shared_memory",
    "shared_memory_enabled",
    "shutdown",
    "world_size",
]
