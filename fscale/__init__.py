"""fscale: large-scale training in PyTorch as pure, composable transformations of a train step."""

from typing import TYPE_CHECKING

from fscale import data as data
from fscale import distributed as distributed
from fscale import functional as functional
from fscale import memory as memory
from fscale import offload as offload
from fscale import optim as optim
from fscale import parallel as parallel
from fscale import precision as precision
from fscale import random as random
from fscale import remat as remat
from fscale import spmd as spmd
from fscale import tracking as tracking
from fscale import tree as tree
from fscale.distributed import Mesh as Mesh
from fscale.distributed import init as init
from fscale.distributed import launch as launch
from fscale.distributed import shutdown as shutdown
from fscale.functional import FunctionalModule as FunctionalModule
from fscale.functional import functionalize as functionalize
from fscale.gain import AdaScaleState as AdaScaleState
from fscale.gain import adascale as adascale
from fscale.loss_scaling import LossScaleState as LossScaleState
from fscale.loss_scaling import loss_scale as loss_scale
from fscale.nonfinite import NonFiniteGradientError as NonFiniteGradientError
from fscale.offload import offload_optimizer as offload_optimizer
from fscale.offload import offload_params as offload_params
from fscale.parallel import DeferredBatchNorm as DeferredBatchNorm
from fscale.parallel import Schedule as Schedule
from fscale.parallel import ShardedOptState as ShardedOptState
from fscale.parallel import accumulate as accumulate
from fscale.parallel import balance_by_size as balance_by_size
from fscale.parallel import balance_by_time as balance_by_time
from fscale.parallel import consolidate as consolidate
from fscale.parallel import data_parallel as data_parallel
from fscale.parallel import deferred_batch_norm as deferred_batch_norm
from fscale.parallel import expert_parallel as expert_parallel
from fscale.parallel import fully_shard as fully_shard
from fscale.parallel import moe_dispatch as moe_dispatch
from fscale.parallel import pipeline_chart as pipeline_chart
from fscale.parallel import shard_optimizer as shard_optimizer
from fscale.parallel import shard_state as shard_state
from fscale.parallel import tensor_parallel as tensor_parallel
from fscale.parallel import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fscale.parallel.pipeline import pipeline as pipeline
from fscale.plan import Context as Context
from fscale.plan import GradAux as GradAux
from fscale.plan import Plan as Plan
from fscale.precision import mixed_precision as mixed_precision
from fscale.remat import checkpoint as checkpoint
from fscale.train import Step as Step
from fscale.train import TrainState as TrainState
from fscale.train import train_step as train_step
from fscale.train import value_and_grad as value_and_grad

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fscale import ckpt as ckpt
    from fscale import models as models
    from fscale import testing as testing
    from fscale.ckpt import CheckpointError as CheckpointError
    from fscale.ckpt import latest as latest
    from fscale.ckpt import load as load
    from fscale.ckpt import save as save
    from fscale.ckpt import wait_saves as wait_saves

# The reference models, the rank pool (a multiprocessing test harness) and the checkpoint files
# (torch.distributed.checkpoint takes about a second to import) are imported on first access,
# so `import fscale` loads none of them.
_LAZY_SUBMODULES = ("ckpt", "models", "testing")
_LAZY_NAMES = dict.fromkeys(("CheckpointError", "latest", "load", "save", "wait_saves"), "ckpt")


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"fscale.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"fscale.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module 'fscale' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES, *_LAZY_NAMES})
