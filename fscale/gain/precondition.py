"""The Adam variant's preconditioner: gradient noise measured in the metric Adam steps in.

Adam moves each coordinate by its gradient divided by ``sqrt(v̂) + eps``, so the noise that
matters to it is that of the preconditioned gradient ``w · g``, with
``w = 1 / (sqrt(v) / sqrt(1 − beta2^t) + eps)`` from the optimizer's second moment v after t
updates (AdaptDL's ``AdamGradientNoiseScale``; Pollux, Qiao et al., OSDI 2021). The estimate of
v is poor for the first few updates, so w = 1 until `warmup` updates have been applied.

What is AdaptDL's here: the preconditioned norms and the learning rate times r^0.5 (its
``AdamScale`` rule). What is not: the estimator, its smoothing (FairScale's max(1 − n/1000, 0),
not AdaptDL's 0.999^S) and debiasing are the SGD rule's; there is no differenced estimate for
one replica without accumulation, and the Adam moments are not rescaled when S changes.

The preconditioner is read from the state's one `fscale.optim.AdamState` (Adam or AdamW, alone
or at the end of a `fscale.optim.chain`), whose leaves mirror the parameters.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fscale import tree
from fscale.optim import AdamState
from fscale.plan import TrainState

__all__ = ["adam_weights", "find_adam_state"]


def find_adam_state(opt_state: Any) -> AdamState:
    """The one `AdamState` inside `opt_state`; a ValueError if there is none or several."""
    found = [
        node
        for node in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, AdamState), none_is_leaf=True
        )
        if isinstance(node, AdamState)
    ]
    if len(found) != 1:
        raise ValueError(
            "adascale: rule='adam' reads the preconditioner from the optimizer's Adam state, but "
            f"the step's optimizer state holds {len(found)} AdamState; use fscale.optim.adam or "
            "adamw (possibly at the end of a chain), or rule='sgd'"
        )
    return found[0]


def adam_weights(
    state: TrainState, beta2: float, eps: float, warmup: int
) -> dict[str, torch.Tensor] | None:
    """Per parameter path, the weight w of the preconditioned gradient (None: all ones)."""
    adam = find_adam_state(state.opt_state)
    count = int(adam.count)
    if count < max(warmup, 1):  # before the first update v is zero and 1 - beta2^0 is too
        return None
    root_correction = math.sqrt(1.0 - beta2**count)
    paths, params, _ = tree.flatten_with_paths(state.params)
    second = tree.leaves(adam.exp_avg_sq)
    if len(second) != len(params):
        raise ValueError(
            "adascale: the Adam state does not mirror the parameters (one second moment per "
            "parameter leaf); rule='adam' needs the full optimizer state, as data_parallel keeps"
        )
    with torch.no_grad():
        return {
            # torch.optim.Adam's denominator, term for term.
            path: 1.0 / (v.sqrt() / root_correction + eps)
            for path, v in zip(paths, second)
        }
