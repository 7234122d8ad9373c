"""Expert capacity: how many of a rank's tokens each expert takes, which ones, and their weights.

With S tokens on a rank, E experts, k choices per token and a capacity factor f, every expert
has ``C = ceil(f * k * S / E)`` slots for this rank's tokens (FairScale's ``Top2Gate`` fixes
``C = 2S/E``, i.e. f = 1 for k = 2). Slots are filled in priority order: all first choices in
token order, then all second choices in token order (GShard), so a token loses its second
choice before any token loses its first. An assignment whose position within its expert is
``>= C`` is dropped; a token all of whose choices are dropped passes through the layer as zero
(the residual connection around it carries it on).

Combine weights: for k = 1 the gate probability of the kept choice (Switch: the output is
scaled by the router's confidence); for k = 2 the gate probabilities of the kept choices
renormalised to sum to 1 (FairScale; a token with one choice dropped gives the other all the
weight). ``capacity="dropless"`` keeps every assignment: the same weights with nothing dropped.

Training and evaluation use different factors (``capacity_factor`` and
``eval_capacity_factor``): evaluation batches are often smaller and less balanced, and dropping
tokens there changes the metric being measured.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Assignment", "assign", "capacity_for", "combine_weights"]

Tensor = torch.Tensor


def capacity_for(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Slots per expert for `tokens` tokens: ``ceil(factor * k * tokens / num_experts)``."""
    # Rounded to 1e-9 first so that e.g. 1.25 * 2 * 8 / 4 is 5, not ceil(5.000000000000001).
    return math.ceil(round(factor * k * tokens / num_experts, 9))


class Assignment(NamedTuple):
    """Where each of the S*k (token, choice) assignments goes.

    Attributes:
        position: ``(S, k)`` int64 index of the assignment among its expert's, in priority
            order (first choices first).
        kept: ``(S, k)`` bool, False for an assignment beyond the capacity.
    """

    position: Tensor
    kept: Tensor


def assign(experts: Tensor, num_experts: int, capacity: int | None) -> Assignment:
    """Positions of the `experts` choices ``(S, k)`` in their experts; `capacity` None keeps all."""
    tokens, k = experts.shape
    positions = []
    offset = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    for choice in range(k):
        one_hot = torch.nn.functional.one_hot(experts[:, choice], num_experts)
        # Inclusive running count minus one: this token's rank among the choice's tokens.
        running = torch.cumsum(one_hot, dim=0) - 1 + offset
        positions.append(torch.gather(running, 1, experts[:, choice : choice + 1]))
        offset = offset + one_hot.sum(dim=0)
    position = torch.cat(positions, dim=1) if k else experts.new_zeros((tokens, 0))
    kept = torch.ones_like(position, dtype=torch.bool) if capacity is None else position < capacity
    return Assignment(position, kept)


def combine_weights(gates: Tensor, kept: Tensor) -> Tensor:
    """``(S, k)`` float32 weights of the kept choices (see the module docstring)."""
    weights = gates * kept.to(gates.dtype)
    if gates.shape[1] == 1:
        return weights
    total = weights.sum(dim=1, keepdim=True)
    return weights / total.clamp_min(torch.finfo(gates.dtype).eps)
