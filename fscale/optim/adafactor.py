"""Adafactor: factored second moments and relative step sizes (Shazeer & Stern, 2018).

For a tensor with two or more dimensions the second moment is kept as row and column sums over
the last two dimensions (earlier dimensions are a batch of matrices), which costs ``R + C`` per
matrix instead of ``R * C``. Everything per element is local, but three statistics span a
tensor: the row/column sums of ``g^2 + eps1``, RMS(p) for the relative step, and RMS(u) for
update clipping. Under a `Sharding` a rank holds a contiguous range of a tensor's flattening (or
of a tensor-parallel shard's), so each element is mapped to its (matrix, row, column) of the full
tensor (`Fragment.element_indices`) and the partial sums are accumulated with ``index_add_``; the
row/column factors are the full tensor's, replicated on every rank.

Reduction rounds under a sharding: one batched ``all_reduce`` carries all row sums, column sums and
squared parameter norms. Update clipping needs a second one, because ``u = g / sqrt(v_hat)``
depends on the *completed* factors; with ``clip_threshold=None`` a step makes one call.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from fscale.flat import Fragment
from fscale.optim import core, hyper, packing
from fscale.optim.base import Optimizer, Sharding, counted_only, described, resolve_sharding

__all__ = ["AdafactorState", "adafactor"]

PyTree = Any


class AdafactorState(NamedTuple):
    """State of `adafactor`; every field but `count` has the params' structure.

    Attributes:
        count: number of updates applied so far (a host int64 scalar).
        row: for factored tensors of shape ``(..., R, C)``, the running row sums, shape
            ``(..., R)``; an empty tensor for unfactored ones.
        col: likewise the running column sums, shape ``(..., C)``.
        v: for unfactored tensors (fewer than two dimensions, or ``factored=False``) the full
            running second moment, shaped like the param; an empty tensor for factored ones.
        exp_avg: the momentum of the clipped update when `beta1` is set, else None.
    """

    count: torch.Tensor
    row: PyTree
    col: PyTree
    v: PyTree
    exp_avg: PyTree


@described
def adafactor(
    lr: hyper.LearningRate | None = None,
    *,
    decay_rate: float = 0.8,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float | None = 1.0,
    beta1: float | None = None,
    weight_decay: float = 0.0,
    scale_parameter: bool = True,
    factored: bool = True,
) -> Optimizer:
    """Adafactor (Shazeer & Stern, 2018, Algorithms 4 and 5, with sections 6 and 7).

    With ``t`` the 1-based step, per tensor::

        beta2_t = 1 - t^(-decay_rate)
        R = beta2_t R + (1 - beta2_t) rowsum(g^2 + eps1)    (matrices; else the full
        C = beta2_t C + (1 - beta2_t) colsum(g^2 + eps1)     V = beta2_t V + (1-beta2_t)(g^2+eps1))
        v_hat = R C / sum(R)
        u = g / sqrt(v_hat);   u = u / max(1, RMS(u) / clip_threshold)
        u = beta1 m + (1 - beta1) u                          (only when beta1 is set)
        alpha = rho_t * max(eps2, RMS(p))                     (rho_t alone if not scale_parameter)
        p = p - alpha * (u + weight_decay * p)

    where ``rho_t = min(1e-2, 1/sqrt(t))`` when `lr` is None (relative step) and ``lr(count)``
    otherwise.

    How it differs from ``torch.optim.Adafactor`` (so it is tested against the paper's
    equations, not against torch): torch keeps row/column *means* (the same ``v_hat``) and clamps
    ``v_hat`` at ``eps1**2`` instead of adding eps1 to ``g^2``; torch has no update clipping and
    no momentum; torch's `lr` is the cap of the relative step (``min(lr, 1/sqrt(t))``) rather
    than a replacement for it; torch's weight decay multiplies by ``1 - rho_t * weight_decay``
    (without the RMS scale), and it has a `maximize` flag.

    Args:
        lr: None for the paper's relative step, else a learning rate or schedule ``count -> lr``.
        decay_rate: ``beta2_t = 1 - t^(-decay_rate)``, >= 0.
        eps: ``(eps1, eps2)``: added to ``g^2``, and the floor of RMS(p) in the relative step.
        clip_threshold: the update-clipping threshold d, or None to disable clipping.
        beta1: momentum of the update, in [0, 1), or None for none (the paper's default).
        weight_decay: decoupled weight decay, >= 0.
        scale_parameter: scale the step by ``max(eps2, RMS(p))``.
        factored: factor the second moment of tensors with two or more dimensions.

    Returns:
        An `Optimizer` (``pointwise=False``) whose state is an `AdafactorState`.

    Raises:
        ValueError: for negative hyper-parameters or `beta1` outside [0, 1).
    """
    name = "adafactor"
    lr_at = None if lr is None else hyper.learning_rate(name, lr)
    decay_rate = hyper.check_non_negative(name, "decay_rate", decay_rate)
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"adafactor: `eps` must be a pair (eps1, eps2), got {eps!r}")
    eps1 = hyper.check_non_negative(name, "eps[0]", eps[0])
    eps2 = hyper.check_non_negative(name, "eps[1]", eps[1])
    if clip_threshold is not None:
        clip_threshold = hyper.check_non_negative(
            name, "clip_threshold", clip_threshold, finite=False
        )
        if clip_threshold == 0:
            raise ValueError("adafactor: `clip_threshold` must be > 0 (or None for no clipping)")
    if beta1 is not None:
        beta1 = hyper.check_unit_interval(name, "beta1", beta1)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)

    def is_factored(frag: Fragment) -> bool:
        return factored and len(frag.shape) >= 2

    def init(params: PyTree, *, sharding: Sharding | None = None) -> AdafactorState:
        leaves, treedef = core.float_leaves(name, params)
        fragments, _ = resolve_sharding(name, sharding, leaves, treedef)
        rows, cols, vs = [], [], []
        for leaf, frag in zip(leaves, fragments):
            if is_factored(frag):
                rows.append(leaf.new_zeros(frag.shape[:-1]))
                cols.append(leaf.new_zeros((*frag.shape[:-2], frag.shape[-1])))
                vs.append(leaf.new_zeros(0))
            else:
                rows.append(leaf.new_zeros(0))
                cols.append(leaf.new_zeros(0))
                vs.append(torch.zeros_like(leaf))
        unflatten = core.unflattener(treedef)
        return AdafactorState(
            count=core.new_count(),
            row=unflatten(rows),
            col=unflatten(cols),
            v=unflatten(vs),
            exp_avg=unflatten(packing.packed_full(leaves)) if beta1 is not None else None,
        )

    def apply(
        grads: PyTree,
        state: AdafactorState,
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, AdafactorState]:
        core.check_state_type(name, state, AdafactorState)
        count = core.read_count(name, state.count)
        inputs = core.step_inputs(
            name,
            grads,
            params,
            {"row": state.row, "col": state.col, "v": state.v, "exp_avg": state.exp_avg},
            donate=donate,
            # Factored leaves keep a row and a column, not a tensor of the param's shape.
            param_shaped=("exp_avg",),
        )
        fragments, all_reduce = resolve_sharding(name, sharding, inputs.params, inputs.treedef)
        t = count + 1
        rho = min(1e-2, 1 / math.sqrt(t)) if lr_at is None else lr_at(count)
        beta2_t = 1.0 - t ** (-decay_rate)
        states = inputs.states
        if inputs.params:
            rows = core.required_state(name, inputs, "row")
            cols = core.required_state(name, inputs, "col")
            vs = core.required_state(name, inputs, "v")
            with torch.no_grad():
                leaves = [
                    _Leaf(p, g, frag, is_factored(frag))
                    for p, g, frag in zip(inputs.params, inputs.grads, fragments)
                ]
                param_rms = _second_moments(leaves, rows, cols, vs, all_reduce, beta2_t, eps1)
                updates = [
                    leaf.scaled_grad(row, col, v)
                    for leaf, row, col, v in zip(leaves, rows, cols, vs)
                ]
                if clip_threshold is not None:
                    _clip(leaves, updates, all_reduce, clip_threshold)
                if beta1 is not None:
                    exp_avg = core.required_state(name, inputs, "exp_avg")
                    momentum = [m.view(-1) for m in exp_avg]
                    torch._foreach_lerp_(
                        momentum, [u.to(m) for u, m in zip(updates, momentum)], 1 - beta1
                    )
                    updates = momentum
                for leaf, update, rms in zip(leaves, updates, param_rms.tolist()):
                    alpha = rho * max(eps2, rms) if scale_parameter else rho
                    leaf.step(update, alpha, weight_decay)
        unflatten = core.unflattener(inputs.treedef)
        return unflatten(inputs.params), AdafactorState(
            count=core.next_count(count),
            row=unflatten(states["row"]),
            col=unflatten(states["col"]),
            v=unflatten(states["v"]),
            exp_avg=unflatten(states["exp_avg"]),
        )

    return Optimizer(init=init, update=core.derive_update(apply), apply=apply, pointwise=False)


class _Leaf:
    """One param's fragment, viewed flat, with the index maps a factored moment needs."""

    def __init__(
        self, param: torch.Tensor, grad: torch.Tensor, frag: Fragment, factored: bool
    ) -> None:
        self.param = param
        # float32 or wider: statistics of low-precision grads are kept in float32
        self.grad = grad.reshape(-1).to(torch.promote_types(grad.dtype, torch.float32))
        self.frag = frag
        self.factored = factored
        if factored:
            *batch, self.rows, self.cols = frag.shape
            self.matrices = math.prod(batch)
            if not frag.is_whole:
                # element index -> (matrix, row, column) of the full tensor's flattening
                index = frag.element_indices(param.device)
                self.row_index = index // self.cols
                self.col_index = (index // (self.rows * self.cols)) * self.cols + index % self.cols
                self.matrix_index = index // (self.rows * self.cols)

    def partial_sums(self, eps1: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column sums of ``g^2 + eps1`` over this fragment (flattened factors)."""
        squared = self.grad.square().add_(eps1)
        if self.frag.is_whole:
            matrices = squared.view(self.matrices, self.rows, self.cols)
            return matrices.sum(-1).reshape(-1), matrices.sum(-2).reshape(-1)
        row = squared.new_zeros(self.matrices * self.rows).index_add_(0, self.row_index, squared)
        col = squared.new_zeros(self.matrices * self.cols).index_add_(0, self.col_index, squared)
        return row, col

    def scaled_grad(self, row: torch.Tensor, col: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``u = g / sqrt(v_hat)`` over this fragment, flat, in the dtype of `self.grad`."""
        dtype = self.grad.dtype
        if not self.factored:
            return self.grad / v.reshape(-1).to(dtype).sqrt()
        row = row.reshape(self.matrices, self.rows).to(dtype)
        col = col.reshape(self.matrices, self.cols).to(dtype)
        row_total = row.sum(-1)
        if self.frag.is_whole:
            v_hat = row[:, :, None] * col[:, None, :] / row_total[:, None, None]
            return self.grad / v_hat.reshape(-1).sqrt()
        flat_row, flat_col = row.reshape(-1), col.reshape(-1)
        v_hat = flat_row[self.row_index] * flat_col[self.col_index] / row_total[self.matrix_index]
        return self.grad / v_hat.sqrt()

    def step(self, update: torch.Tensor, alpha: float, weight_decay: float) -> None:
        """``p = p - alpha * (update + weight_decay * p)``, in place on the writable param."""
        flat = self.param.view(-1)
        if weight_decay:
            flat.mul_(1 - alpha * weight_decay)
        flat.sub_(update.to(flat.dtype), alpha=alpha)


def _second_moments(
    leaves: list[_Leaf],
    rows: list[torch.Tensor],
    cols: list[torch.Tensor],
    vs: list[torch.Tensor],
    all_reduce: Any,
    beta2_t: float,
    eps1: float,
) -> torch.Tensor:
    """Update the moments in place (one all-reduce round); return RMS(p) per tensor."""
    device = leaves[0].param.device
    pieces: list[torch.Tensor] = []
    sizes: list[int] = []
    for leaf in leaves:
        if leaf.factored:
            for part in leaf.partial_sums(eps1):
                # A replica's sums are left out: another rank's copy adds them.
                pieces.append(part.to(device) if leaf.frag.counted else part.new_zeros(part.shape))
                sizes.append(part.numel())
    param_squares = torch.stack([core.sum_of_squares(leaf.param, device) for leaf in leaves])
    param_squares = counted_only(param_squares, [leaf.frag for leaf in leaves])
    totals = all_reduce(torch.cat([*pieces, param_squares]))
    sums = iter(totals[: sum(sizes)].split(sizes))
    for leaf, row, col, v in zip(leaves, rows, cols, vs):
        if leaf.factored:
            row.view(-1).lerp_(next(sums).to(row), 1 - beta2_t)
            col.view(-1).lerp_(next(sums).to(col), 1 - beta2_t)
        else:
            v.view(-1).lerp_(leaf.grad.square().add_(eps1).to(v), 1 - beta2_t)
    numels = torch.tensor([leaf.frag.shape.numel() for leaf in leaves], device=device)
    return (totals[sum(sizes) :] / numels.clamp(min=1)).sqrt()


def _clip(
    leaves: list[_Leaf], updates: list[torch.Tensor], all_reduce: Any, threshold: float
) -> None:
    """``u /= max(1, RMS(u) / threshold)`` per tensor, RMS over the full tensor (one round)."""
    device = leaves[0].param.device
    squares = torch.stack([torch.dot(u, u).to(device) for u in updates])
    squares = all_reduce(counted_only(squares, [leaf.frag for leaf in leaves]))
    numels = torch.tensor([leaf.frag.shape.numel() for leaf in leaves], device=device)
    rms = (squares / numels.clamp(min=1)).sqrt()
    divisors = (rms / threshold).clamp(min=1.0)
    torch._foreach_div_(updates, divisors.tolist())
