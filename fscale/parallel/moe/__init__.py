"""Mixture of experts: top-k gating, capacity or dropless dispatch, expert parallelism.

- `moe_dispatch` (`fscale.parallel.moe.dispatch`): the layer as a pure function, dense or over an
  expert-parallel mesh axis; gating in `gating`, capacity in `capacity`, the exchanges in
  `exchange`.
"""

from fscale.parallel.moe.dispatch import MoEDispatch as MoEDispatch
from fscale.parallel.moe.dispatch import moe_dispatch as moe_dispatch
