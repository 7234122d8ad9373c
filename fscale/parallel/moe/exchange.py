"""Tokens to the ranks that own their experts and back: the size exchange, fixed and dropless.

Expert parallelism over an axis of N ranks gives rank r the contiguous experts
``[r * E/N, (r + 1) * E/N)``. Before any token moves, the ranks all-gather one small int64 row
each — ``[tokens, gate_not_finite, kept assignments per expert (E)]`` — so every rank knows
every other's sizes (a receive cannot be posted for an unknown size; ranks with different token
counts would otherwise hang) and a non-finite gate on any rank fails on all of them at once.

Fixed capacity. Each rank fills a ``(E, C, d)`` buffer (zeros in unused slots), where C is the
largest capacity among the ranks (equal to each rank's own when the token counts are equal;
the slots beyond a rank's own capacity stay empty). `fscale.distributed.all_to_all` sends the
slice of experts ``[j E/N, (j+1) E/N)`` to rank j, which runs each of its experts once on the
``N * C`` rows the ranks sent it; the inverse all-to-all brings the outputs home.

Dropless. Each rank sorts its kept assignments by expert, so the rows for rank j are
contiguous, and `fscale.distributed.uneven.all_to_all_uneven` sends rank j exactly its rows.
The rows a rank receives are grouped by source rank, then by expert; one gather regroups them
by expert, each expert runs once on exactly its rows (no padding), and the inverse permutation
and the reverse exchange bring them home.

Every step is differentiable: the exchanges are fscale's collectives (backward: the reverse
exchange), the regrouping is an index gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.distributed.uneven import all_to_all_uneven
from fscale.readback import to_list

__all__ = [
    "Sizes",
    "exchange_sizes",
    "run_experts",
    "through_experts_dropless",
    "through_experts_fixed",
]

Tensor = torch.Tensor
ExpertFn = Callable[[Any, Tensor], Tensor]


class Sizes(NamedTuple):
    """What the ranks of the expert axis told each other before exchanging tokens.

    Attributes:
        tokens: each rank's token count, in axis order.
        counts: ``(N, E)`` int64 kept assignments per expert, row r from rank r (on the host).
        not_finite: the indices of the ranks whose router logits were not all finite.
    """

    tokens: tuple[int, ...]
    counts: Tensor
    not_finite: tuple[int, ...]


def exchange_sizes(
    tokens: int, counts: Tensor, not_finite: bool, axis: str, mesh: Mesh | None
) -> Sizes:
    """Every rank's token count, per-expert counts and finiteness flag (no collective without a
    mesh or over an axis of size 1)."""
    # On the data's device (NCCL exchanges device tensors only); read on the host once.
    head = torch.tensor([tokens, int(not_finite)], dtype=torch.int64, device=counts.device)
    row = torch.cat([head, counts.to(torch.int64)])
    if mesh is not None and mesh.size(axis) > 1:
        row = collectives.all_gather(row, axis, mesh=mesh)
    rows = row.cpu().view(-1, counts.numel() + 2)
    flags = to_list(rows[:, 1])
    return Sizes(
        tuple(to_list(rows[:, 0])), rows[:, 2:], tuple(i for i, f in enumerate(flags) if f)
    )


def run_experts(expert_fn: ExpertFn, experts: Any, blocks: list[Tensor]) -> list[Tensor]:
    """``expert_fn(experts[e], blocks[e])`` for each local expert e (leading dim of `experts`)."""
    outputs = []
    for index, rows in enumerate(blocks):
        one_expert = tree.map(lambda leaf, index=index: leaf[index], experts)
        out = expert_fn(one_expert, rows)
        if not isinstance(out, Tensor) or out.shape != rows.shape:
            raise ValueError(
                f"moe_dispatch: `expert_fn` must map tokens of shape (n, d_model) to the same "
                f"shape; expert {index} got {tuple(rows.shape)} and returned "
                + (f"{tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__)
            )
        outputs.append(out)
    return outputs


def through_experts_fixed(
    expert_fn: ExpertFn, experts: Any, buffer: Tensor, axis: str, mesh: Mesh | None
) -> Tensor:
    """The expert outputs for a ``(E, C, d)`` slot buffer, in the same layout."""
    ranks = 1 if mesh is None else mesh.size(axis)
    num_experts, capacity, d_model = buffer.shape
    local = num_experts // ranks
    if ranks > 1:
        # Chunk j of dim 0 (rank j's experts) to rank j; dim 0 comes back as (source, expert).
        buffer = collectives.all_to_all(buffer, axis, 0, 0, mesh=mesh)
    by_expert = buffer.view(ranks, local, capacity, d_model).transpose(0, 1)
    blocks = [by_expert[e].reshape(ranks * capacity, d_model) for e in range(local)]
    outputs = torch.stack(run_experts(expert_fn, experts, blocks))
    outputs = outputs.view(local, ranks, capacity, d_model).transpose(0, 1)
    outputs = outputs.reshape(num_experts, capacity, d_model)
    if ranks > 1:
        outputs = collectives.all_to_all(outputs, axis, 0, 0, mesh=mesh)
    return outputs


def _regroup(received_counts: Tensor) -> Tensor:
    """The gather that orders rows grouped (source, expert) as (expert, source)."""
    sources, local = received_counts.shape
    flat = received_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    blocks = torch.arange(sources * local).view(sources, local).t().reshape(-1)
    sizes, block_starts = flat[blocks], starts[blocks]
    total = int(flat.sum())
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return torch.repeat_interleave(block_starts, sizes) + within


def through_experts_dropless(
    expert_fn: ExpertFn, experts: Any, rows: Tensor, sizes: Sizes, axis: str, mesh: Mesh | None
) -> Tensor:
    """The expert outputs for this rank's kept assignments `rows`, sorted by expert."""
    ranks = 1 if mesh is None else mesh.size(axis)
    me = 0 if mesh is None else mesh.rank(axis)
    num_experts = sizes.counts.shape[1]
    local = num_experts // ranks
    mine = slice(me * local, (me + 1) * local)
    # (source rank, local expert) -> rows this rank receives.
    received_counts = sizes.counts[:, mine]
    per_expert = to_list(received_counts.sum(0))
    if ranks == 1:  # already grouped by expert: no exchange, no regrouping
        return torch.cat(run_experts(expert_fn, experts, list(torch.split(rows, per_expert))))
    # Rows rank i sends rank j: its assignments to j's experts. Every rank holds the whole
    # table (the counts were gathered), so the exchange need not gather its sizes again.
    table = to_list(sizes.counts.view(ranks, ranks, local).sum(2))
    send, recv = table[me], [row[me] for row in table]
    received = all_to_all_uneven(rows, axis, send, recv, mesh=mesh, all_sizes=table)
    order = _regroup(received_counts).to(rows.device)
    grouped = received.index_select(0, order)
    outputs = torch.cat(
        run_experts(expert_fn, experts, list(torch.split(grouped, per_expert))), dim=0
    )
    outputs = outputs.index_select(0, torch.argsort(order))
    back = [list(column) for column in zip(*table)]
    outputs = all_to_all_uneven(outputs, axis, recv, send, mesh=mesh, all_sizes=back)
    return outputs
