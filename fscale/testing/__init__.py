"""Tools for testing distributed code: a persistent pool of ranks and pytree assertions.

- `run_spmd(fn, world_size, *args, **kwargs)` runs a module-level function on every rank of a
  shared, persistent pool of gloo processes and returns the per-rank results; `RankPool` is
  the pool itself, for callers that want their own. A failure on any rank raises `RankError`
  with the rank's traceback. See `fscale.testing.pool` for how to property-test a strategy
  with hypothesis (draw the case in the test, pass it to every rank as arguments).
- `fscale.testing.strategies`: hypothesis strategies for random models (MLP, GPT-style, CNN with
  BatchNorm), their batches, and optimizers with the torch.optim twin each equals bit for bit.
- `assert_trees_equal` / `assert_trees_close` compare pytrees leaf by leaf and name the leaf
  path, the largest errors and the worst element when they differ.
"""

from typing import TYPE_CHECKING

from fscale.distributed.spawn import RankError as RankError
from fscale.distributed.spawn import RankTimeoutError as RankTimeoutError
from fscale.testing.assertions import assert_trees_close as assert_trees_close
from fscale.testing.assertions import assert_trees_equal as assert_trees_equal
from fscale.testing.pool import RankPool as RankPool
from fscale.testing.pool import run_spmd as run_spmd
from fscale.testing.probes import on_gradient as on_gradient

if TYPE_CHECKING:  # imported on first access at run time (see `__getattr__`)
    from fscale.testing import strategies as strategies

__all__ = [
    "RankError",
    "RankPool",
    "RankTimeoutError",
    "assert_trees_close",
    "assert_trees_equal",
    "on_gradient",
    "run_spmd",
    "strategies",
]


def __getattr__(name: str) -> object:
    # hypothesis is a test dependency, not a runtime one: import the strategies on first use.
    if name == "strategies":
        import importlib

        return importlib.import_module("fscale.testing.strategies")
    raise AttributeError(f"module 'fscale.testing' has no attribute {name!r}")
