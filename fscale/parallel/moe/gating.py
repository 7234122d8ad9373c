"""Top-k gating of a mixture of experts: which experts each token goes to, and the router losses.

The router is a linear map to one logit per expert, ``logits = x @ W_gate``, computed and
normalised in float32 whatever the input dtype (a softmax over E experts in bfloat16 loses the
small probabilities the load-balancing loss is made of). With ``probs = softmax(logits)``:

- top-1 (Switch Transformer): the first choice is ``argmax(probs)``;
- top-2 (GShard): the second choice is the argmax over the other experts, of the logits plus
  Gumbel noise when ``noisy=True`` in training (FairScale's ``Top2Gate``), so that the second
  expert is sampled in proportion to its probability rather than always the runner-up.

Ties go to the lowest expert index. The gate value of a choice is ``probs`` at that expert; it
is the only differentiable path from the output back to the router (the choices are argmaxes).

Load-balancing loss (Switch eq. 4, GShard's ``l_aux``)::

    balance_loss = E * sum_e f_e * P_e

with ``f_e`` the fraction of this rank's tokens whose FIRST choice is expert e (before any
capacity drop) and ``P_e`` the mean router probability of expert e over the same tokens. It is
1 for a perfectly uniform router and E for one that sends everything to one expert; its gradient
flows through ``P_e`` only. Router z-loss (ST-MoE eq. 5): ``z_loss = mean_s logsumexp(logits_s)^2``,
which keeps the logits small so the float32 softmax stays exact. The caller adds
``aux_loss_weight * balance_loss + z_loss_weight * z_loss`` to its task loss (Switch uses 0.01
and ST-MoE 0.001 for the two weights). Both are means over this rank's tokens, so under data or
expert parallelism they follow the same per-rank-mean convention as the task loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fscale import random as fsrandom

__all__ = ["Routing", "balance_loss", "gumbel_noise", "route", "z_loss"]

Tensor = torch.Tensor


class Routing(NamedTuple):
    """The gate's decision for S tokens.

    Attributes:
        logits: ``(S, E)`` float32 router logits.
        probs: ``(S, E)`` float32 softmax of the logits.
        experts: ``(S, k)`` int64 chosen experts, first choice in column 0.
        gates: ``(S, k)`` float32 router probability of each choice (differentiable).
    """

    logits: Tensor
    probs: Tensor
    experts: Tensor
    gates: Tensor


def gumbel_noise(shape: tuple[int, ...], key: Tensor | None, device: torch.device) -> Tensor:
    """Standard Gumbel samples drawn from `key` (from the ambient RNG when None).

    Drawn on the CPU from a generator seeded by the key, so the same key gives the same noise on
    every device and in every process.
    """
    if key is None:
        uniform = torch.rand(shape, dtype=torch.float32)
    else:
        generator = torch.Generator().manual_seed(fsrandom.seed(key))
        uniform = torch.rand(shape, dtype=torch.float32, generator=generator)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log(-torch.log(uniform.clamp_min(tiny)).clamp_min(tiny)).to(device)


def route(logits: Tensor, k: int, noise: Tensor | None = None) -> Routing:
    """The top-`k` choices (k = 1 or 2) for float32 `logits` ``(S, E)``; `noise` ``(S, E)`` is
    added to the logits when choosing the second expert."""
    probs = torch.softmax(logits, dim=-1)
    first = torch.argmax(probs, dim=-1, keepdim=True)
    choices = [first]
    if k == 2:
        second_scores = logits.detach() if noise is None else logits.detach() + noise
        # The first choice is out of the running for the second one.
        second_scores = second_scores.scatter(-1, first, float("-inf"))
        choices.append(torch.argmax(second_scores, dim=-1, keepdim=True))
    experts = torch.cat(choices, dim=-1)
    return Routing(logits, probs, experts, torch.gather(probs, -1, experts))


def balance_loss(routing: Routing) -> Tensor:
    """``E * sum_e f_e * P_e`` over this rank's tokens (0 for no token); see the module doc."""
    tokens, num_experts = routing.probs.shape
    if tokens == 0:
        return routing.probs.sum() * 0.0
    first_counts = torch.bincount(routing.experts[:, 0], minlength=num_experts)
    fraction = first_counts.to(routing.probs.dtype) / tokens
    mean_prob = routing.probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


def z_loss(routing: Routing) -> Tensor:
    """``mean_s logsumexp(logits_s)^2`` over this rank's tokens (0 for no token)."""
    if routing.logits.shape[0] == 0:
        return routing.logits.sum() * 0.0
    return torch.logsumexp(routing.logits, dim=-1).square().mean()
