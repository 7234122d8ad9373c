"""Optimizers as pure functions over explicit pytree state, bit-exact with torch.optim.

``opt = adamw(3e-4)``; ``state = opt.init(params)``;
``params, state = step(opt, grads, state, params)``. See `fscale.optim.base` for the
`Optimizer` contract and the `Sharding` hook that sharded wrappers use. ``adam`` and ``adamw``
take ``exact=False`` for one fused call per flat buffer, within rounding of torch.optim instead
of equal to it (`fscale.optim.flat_group`).
"""

from fscale.optim import schedules as schedules
from fscale.optim.adadelta import AdadeltaState as AdadeltaState
from fscale.optim.adadelta import adadelta as adadelta
from fscale.optim.adafactor import AdafactorState as AdafactorState
from fscale.optim.adafactor import adafactor as adafactor
from fscale.optim.adagrad import AdagradState as AdagradState
from fscale.optim.adagrad import adagrad as adagrad
from fscale.optim.adam import AdamState as AdamState
from fscale.optim.adam import adam as adam
from fscale.optim.adam import adamw as adamw
from fscale.optim.adamax import AdamaxState as AdamaxState
from fscale.optim.adamax import adamax as adamax
from fscale.optim.base import EmptyState as EmptyState
from fscale.optim.base import Optimizer as Optimizer
from fscale.optim.base import Sharding as Sharding
from fscale.optim.base import apply_updates as apply_updates
from fscale.optim.base import chain as chain
from fscale.optim.base import counted_only as counted_only
from fscale.optim.base import step as step
from fscale.optim.lamb import LambState as LambState
from fscale.optim.lamb import lamb as lamb
from fscale.optim.partition import PartitionState as PartitionState
from fscale.optim.partition import partition as partition
from fscale.optim.rmsprop import RMSpropState as RMSpropState
from fscale.optim.rmsprop import rmsprop as rmsprop
from fscale.optim.sgd import SGDState as SGDState
from fscale.optim.sgd import sgd as sgd
from fscale.optim.transforms import clip_by_global_norm as clip_by_global_norm
from fscale.optim.transforms import scale as scale
