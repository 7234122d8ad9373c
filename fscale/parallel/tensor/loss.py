"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel axis.

Rank r holds the logits of token ids ``[r * V/N, (r + 1) * V/N)``. The loss of one position is
``log sum_v exp(z_v - m) - (z_t - m)`` with ``m`` the maximum logit, so the softmax never
overflows; every term is a sum over the vocabulary, so each rank sums its own slice and one
all-reduce completes them (the target's logit is found on exactly one rank, the others add 0):

1. ``m`` = the maximum over the ranks of each rank's maximum (`all_reduce_max`, no gradient:
   the loss does not depend on it).
2. ``shifted = z - m`` (a new tensor: the caller's logits are never modified in place).
3. ``[sum exp(shifted), shifted_t]`` summed over the ranks with one `all_reduce` (its backward
   is the identity, as every rank holds the same replicated loss).
4. ``loss = log(sum_exp) - shifted_t``, averaged over the positions whose target is not
   `ignore_index`, as ``F.cross_entropy(reduction="mean")`` does.

Its gradient on each rank is that rank's slice of ``softmax(z) - onehot(t)`` (over the count),
with no further collective.
"""

from __future__ import annotations

import torch

from fscale.distributed import all_reduce
from fscale.distributed.comm import resolve_comm
from fscale.distributed.mesh import Mesh
from fscale.parallel.tensor.regions import all_reduce_max

__all__ = ["vocab_parallel_cross_entropy"]

Tensor = torch.Tensor


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    axis: str = "tp",
    *,
    mesh: Mesh | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Mean cross-entropy of vocab-sharded `logits` against global token ids `targets`.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(),
    ignore_index=ignore_index)`` on the gathered logits, up to rounding.

    Args:
        logits: ``[..., V / N]``: this rank's contiguous slice of the vocabulary.
        targets: ``[...]`` integer token ids in ``[0, V)`` (or `ignore_index`), the same on
            every rank.
        axis: the tensor-parallel mesh axis the vocabulary is split over.
        mesh: the mesh; None for the current one.
        ignore_index: targets with this value are left out of the mean.

    Returns:
        A scalar, the same on every rank of `axis`.

    Raises:
        ValueError: the shapes do not match, or a target is outside the vocabulary.
        TypeError: `targets` is not an integer tensor.
    """
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor):
        raise TypeError("vocab_parallel_cross_entropy: `logits` and `targets` must be tensors")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(
            f"vocab_parallel_cross_entropy: `targets` must hold integer ids, got {targets.dtype}"
        )
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            "vocab_parallel_cross_entropy: expected `logits` [..., V/N] and `targets` [...], got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    comm = resolve_comm(axis, mesh, "vocab_parallel_cross_entropy")
    local_vocab = logits.shape[-1]
    vocab = local_vocab * comm.size
    valid = targets != ignore_index
    if bool(((targets < 0) | (targets >= vocab))[valid].any()):
        raise ValueError(
            f"vocab_parallel_cross_entropy: `targets` must be in [0, {vocab}) or ignore_index="
            f"{ignore_index}; got values from {int(targets.min())} to {int(targets.max())}"
        )
    maximum = all_reduce_max(logits.amax(dim=-1), axis, mesh=comm.mesh)
    shifted = logits - maximum.unsqueeze(-1)
    local_targets = targets - comm.index * local_vocab
    mine = valid & (local_targets >= 0) & (local_targets < local_vocab)
    picked = shifted.gather(-1, torch.where(mine, local_targets, 0).unsqueeze(-1)).squeeze(-1)
    picked = picked * mine.to(picked.dtype)
    sums = torch.stack((shifted.exp().sum(dim=-1), picked))
    if comm.size > 1:
        sums = all_reduce(sums, axis, mesh=comm.mesh)
    sum_exp, target_logit = sums.unbind(0)
    per_position = (sum_exp.log() - target_logit) * valid.to(picked.dtype)
    return per_position.sum() / valid.sum()
