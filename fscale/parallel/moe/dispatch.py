"""`moe_dispatch(expert_fn, mesh, ...)`: a mixture-of-experts layer as a pure function, dense or
expert parallel.

``moe = moe_dispatch(expert_fn, mesh, num_experts=E, k=2)`` returns a callable
``moe(params, x, key=None, *, training=True) -> (y, aux)`` for tokens ``x`` of shape
``(S, d_model)`` and ``params = {"gate": {"weight": (d_model, E)}, "experts": experts}``, where
every leaf of ``experts`` has a leading expert dimension: all E experts stacked when
``mesh=None`` (or the axis has size 1), this rank's contiguous E/N slice under expert
parallelism over N ranks. ``expert_fn(one_expert_params, tokens) -> tokens`` is one expert
(its params without the leading dimension) on a ``(n, d_model)`` block of tokens.

One call is: gate (`fscale.parallel.moe.gating`), capacity and weights
(`fscale.parallel.moe.capacity`), the size exchange, dispatch to the experts' ranks, the
experts, the reverse exchange (`fscale.parallel.moe.exchange`), and the combine
``y_s = sum_c w_sc * expert_{e_sc}(x_s)``. Dispatch and combine are index gathers into and out
of the slot layout, ``O(S k d)`` work, rather than FairScale's dense ``(S, E, C)`` one-hot
einsums, ``O(S E C d)``.

Collectives over the expert axis (N > 1), forward: one all-gather of ``N * (E + 2)`` int64 sizes,
then two all-to-alls of the token rows (fixed: ``E * C * d`` elements each way; dropless: the
``k * S`` kept rows); backward: the two reverse all-to-alls. The router and the gate weight are
local: under data-parallel training the gate's gradient is averaged like any replicated
parameter's, and each expert's gradient arrives at its owner summed over the ranks that sent it
tokens (see `fscale.parallel.moe.plan` for the reduction a training step needs).

Evaluation: ``training=False`` selects ``eval_capacity_factor`` and turns off the noise of the
second choice. The flag is an argument of the call, not state, so one `MoEDispatch` serves both;
`fscale.parallel.moe.layer.MoE` passes its module's ``.training``.

Exactness: the gate, positions and combine of a rank's tokens are computed locally, so expert
parallelism over N ranks equals the dense call on each rank's tokens — outputs, and gradients
summed over the ranks — up to the order of the sums inside each expert's matrix products.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from fscale import tree
from fscale.distributed.mesh import Mesh
from fscale.parallel.moe import capacity as capacity_lib
from fscale.parallel.moe import gating
from fscale.parallel.moe.exchange import (
    Sizes,
    exchange_sizes,
    through_experts_dropless,
    through_experts_fixed,
)

__all__ = ["CAPACITY_MODES", "MoEDispatch", "moe_dispatch"]

Tensor = torch.Tensor
CAPACITY_MODES = ("fixed", "dropless")


@dataclasses.dataclass(frozen=True)
class MoEDispatch:
    """A mixture-of-experts layer; build it with `moe_dispatch`, call it as documented there."""

    expert_fn: Callable[[Any, Tensor], Tensor]
    mesh: Mesh | None
    axis: str
    num_experts: int
    k: int
    capacity_factor: float
    eval_capacity_factor: float
    aux_loss_weight: float
    z_loss_weight: float
    capacity: str
    noisy: bool

    @property
    def ranks(self) -> int:
        """Ranks along the expert axis (1 for the dense layer)."""
        return 1 if self.mesh is None else self.mesh.size(self.axis)

    @property
    def local_experts(self) -> int:
        """Experts held by this rank: ``num_experts / ranks``."""
        return self.num_experts // self.ranks

    def __call__(
        self, params: Any, x: Tensor, key: Tensor | None = None, *, training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(y, aux)`` for tokens `x` ``(S, d_model)``; see `moe_dispatch`."""
        gate_weight, experts = self._check_call(params, x, training)
        logits = x.to(torch.float32) @ gate_weight.to(torch.float32)
        noise = None
        if self.k == 2 and self.noisy and training:
            noise = gating.gumbel_noise(tuple(logits.shape), key, logits.device)
        routing = gating.route(logits, self.k, noise)
        factor = self.capacity_factor if training else self.eval_capacity_factor
        tokens = x.shape[0]
        cap = None
        if self.capacity == "fixed":
            cap = capacity_lib.capacity_for(tokens, self.num_experts, self.k, factor)
        assignment = capacity_lib.assign(routing.experts, self.num_experts, cap)
        counts = torch.bincount(routing.experts[assignment.kept], minlength=self.num_experts).to(
            torch.int64
        )
        not_finite = not bool(torch.isfinite(logits.detach()).all())
        sizes = exchange_sizes(tokens, counts, not_finite, self.axis, self.mesh)
        if sizes.not_finite:
            raise ValueError(
                f"moe_dispatch: the gate's logits are not finite (NaN or inf) on rank(s) "
                f"{list(sizes.not_finite)} of axis {self.axis!r}; check the input tokens and "
                "`params['gate']['weight']` (a router z-loss, `z_loss_weight`, keeps logits small)"
            )
        if self.capacity == "fixed":
            out = self._fixed(x, routing, assignment, sizes, experts, factor)
        else:
            out = self._dropless(x, routing, assignment, sizes, experts)
        weights = capacity_lib.combine_weights(routing.gates, assignment.kept)
        y = (out * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)
        return y, self._aux(routing, assignment, counts)

    # ---- the two exchanges ---------------------------------------------------------------

    def _fixed(self, x, routing, assignment, sizes: Sizes, experts, factor) -> Tensor:
        """``(S, k, d)`` expert outputs per assignment (zeros where dropped)."""
        slots_per_expert = max(
            capacity_lib.capacity_for(n, self.num_experts, self.k, factor) for n in sizes.tokens
        )
        slot = routing.experts * slots_per_expert + assignment.position
        kept = assignment.kept.reshape(-1)
        slot = torch.where(assignment.kept, slot, 0).reshape(-1)
        rows = x.repeat_interleave(self.k, dim=0)
        buffer = x.new_zeros((self.num_experts * slots_per_expert, x.shape[1]))
        buffer = buffer.index_copy(0, slot[kept], rows[kept])
        buffer = buffer.view(self.num_experts, slots_per_expert, x.shape[1])
        outputs = through_experts_fixed(self.expert_fn, experts, buffer, self.axis, self.mesh)
        gathered = outputs.reshape(-1, x.shape[1]).index_select(0, slot)
        gathered = torch.where(kept.unsqueeze(-1), gathered, 0.0)
        return gathered.view(x.shape[0], self.k, x.shape[1])

    def _dropless(self, x, routing, assignment, sizes: Sizes, experts) -> Tensor:
        """``(S, k, d)`` expert outputs per assignment."""
        flat_experts = routing.experts.reshape(-1)
        # Stable, so rows of one expert stay in token order (the dense reference's order).
        order = torch.argsort(flat_experts, stable=True)
        rows = x.repeat_interleave(self.k, dim=0).index_select(0, order)
        outputs = through_experts_dropless(
            self.expert_fn, experts, rows, sizes, self.axis, self.mesh
        )
        outputs = outputs.index_select(0, torch.argsort(order))
        return outputs.view(x.shape[0], self.k, x.shape[1])

    def _aux(self, routing, assignment, counts) -> dict[str, Tensor]:
        balance = gating.balance_loss(routing)
        z = gating.z_loss(routing)
        aux_loss = self.aux_loss_weight * balance
        if self.z_loss_weight:
            aux_loss = aux_loss + self.z_loss_weight * z
        return {
            "aux_loss": aux_loss,
            "balance_loss": balance.detach(),
            "z_loss": z.detach(),
            "tokens_per_expert": counts,
            "dropped_assignments": (~assignment.kept).sum(),
            "dropped_tokens": (~assignment.kept.any(dim=1)).sum(),
        }

    # ---- checks --------------------------------------------------------------------------

    def _check_call(self, params: Any, x: Any, training: Any) -> tuple[Tensor, Any]:
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise ValueError(
                "moe_dispatch: `x` must be a floating-point tensor of shape (tokens, d_model), "
                "got "
                + (
                    f"{x.dtype} of shape {tuple(x.shape)}"
                    if isinstance(x, Tensor)
                    else type(x).__name__
                )
            )
        if not isinstance(training, bool):
            raise TypeError(f"moe_dispatch: `training` must be a bool, got {training!r}")
        if not isinstance(params, dict) or set(params) != {"gate", "experts"}:
            raise ValueError(
                "moe_dispatch: `params` must be {'gate': {'weight': (d_model, E)}, 'experts': "
                f"pytree}}, got {_keys(params)}"
            )
        gate = params["gate"]
        weight = gate.get("weight") if isinstance(gate, dict) else None
        expected = (x.shape[1], self.num_experts)
        if not isinstance(weight, Tensor) or tuple(weight.shape) != expected:
            raise ValueError(
                f"moe_dispatch: `params['gate']['weight']` must be a tensor of shape "
                f"(d_model, num_experts) = {expected}, got "
                + (f"{tuple(weight.shape)}" if isinstance(weight, Tensor) else _keys(gate))
            )
        paths, leaves, _ = tree.flatten_with_paths(params["experts"])
        if not leaves:
            raise ValueError("moe_dispatch: `params['experts']` holds no tensors")
        for path, leaf in zip(paths, leaves):
            if (
                not isinstance(leaf, Tensor)
                or leaf.dim() == 0
                or leaf.shape[0] != self.local_experts
            ):
                where = "this rank's slice of" if self.ranks > 1 else "all"
                raise ValueError(
                    f"moe_dispatch: every leaf of `params['experts']` needs a leading dimension "
                    f"of {self.local_experts} ({where} {self.num_experts} experts over "
                    f"{self.ranks} rank(s) of axis {self.axis!r}); leaf `{path}` has "
                    + (f"shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else "no shape")
                )
        return weight, params["experts"]


def _keys(value: Any) -> str:
    return f"keys {sorted(map(str, value))}" if isinstance(value, dict) else type(value).__name__


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"moe_dispatch: `{name}` must be a finite number, got {value!r}")
    if value <= 0:
        raise ValueError(
            f"moe_dispatch: `{name}` must be > 0 (a capacity of 0 slots drops every token), "
            f"got {value!r}; use capacity='dropless' to keep every token"
        )
    return float(value)


def _weight(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"moe_dispatch: `{name}` must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"moe_dispatch: `{name}` must be >= 0, got {value!r}")
    return float(value)


def moe_dispatch(
    expert_fn: Callable[[Any, Tensor], Tensor],
    mesh: Mesh | None = None,
    axis: str = "ep",
    *,
    num_experts: int,
    k: int = 1,
    capacity_factor: float = 1.25,
    eval_capacity_factor: float = 2.0,
    aux_loss_weight: float = 0.01,
    z_loss_weight: float = 0.0,
    capacity: str = "fixed",
    noisy: bool = False,
) -> MoEDispatch:
    """A mixture-of-experts layer ``moe(params, x, key=None, *, training=True) -> (y, aux)``.

    Args:
        expert_fn: ``expert_fn(one_expert_params, tokens) -> tokens``, shape-preserving on
            ``(n, d_model)``; called once per local expert per call (n may be 0).
        mesh: the mesh whose `axis` holds the experts; None for the dense layer (every expert
            in this process).
        axis: the expert-parallel axis.
        num_experts: E, divisible by the size of `axis`.
        k: experts per token: 1 (Switch) or 2 (GShard); at most `num_experts`.
        capacity_factor: slots per expert in training, ``ceil(factor * k * S / E)`` (> 0).
        eval_capacity_factor: the same with ``training=False``.
        aux_loss_weight: weight of the load-balancing loss in ``aux["aux_loss"]``.
        z_loss_weight: weight of the router z-loss in ``aux["aux_loss"]`` (0: off).
        capacity: "fixed" (tokens over an expert's capacity are dropped) or "dropless" (every
            token is computed; variable-size exchange, no padding).
        noisy: for k = 2 in training, choose the second expert with Gumbel noise drawn from the
            call's `key` (from the ambient RNG when the key is None).

    Returns:
        A `MoEDispatch`. Its call returns ``y`` ``(S, d_model)`` in `x`'s dtype and ``aux``:
        ``aux_loss`` (differentiable, to add to the task loss), ``balance_loss`` and ``z_loss``
        (unweighted, detached), ``tokens_per_expert`` (``(E,)`` kept assignments of this rank's
        tokens), ``dropped_assignments`` and ``dropped_tokens`` (tokens with no kept choice).

    Raises:
        ValueError: `num_experts` not divisible by the axis size, `k` not 1 or 2 or above
            `num_experts`, a capacity factor <= 0, an unknown `capacity` mode or axis. At call:
            `x` or `params` of the wrong shape, or a gate whose logits are not finite on some
            rank (raised on every rank of the axis).

    Example:
        >>> import torch, fscale as fs
        >>> def expert(p, tokens):
        ...     return tokens @ p["w"]
        >>> moe = fs.moe_dispatch(expert, num_experts=4, k=2)
        >>> params = {"gate": {"weight": torch.randn(8, 4)}, "experts": {"w": torch.randn(4, 8, 8)}}
        >>> y, aux = moe(params, torch.randn(16, 8))
        >>> y.shape, aux["tokens_per_expert"].shape
        (torch.Size([16, 8]), torch.Size([4]))
    """
    if not callable(expert_fn):
        raise TypeError(
            f"moe_dispatch: `expert_fn` must be callable, got {type(expert_fn).__name__}"
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"moe_dispatch: `num_experts` must be a positive int, got {num_experts!r}")
    if k not in (1, 2) or isinstance(k, bool):
        raise ValueError(f"moe_dispatch: `k` must be 1 (top-1) or 2 (top-2), got {k!r}")
    if k > num_experts:
        raise ValueError(
            f"moe_dispatch: `k`={k} experts per token is more than `num_experts`={num_experts}"
        )
    if capacity not in CAPACITY_MODES:
        raise ValueError(
            f"moe_dispatch: `capacity` must be one of {CAPACITY_MODES}, got {capacity!r}"
        )
    if not isinstance(noisy, bool):
        raise TypeError(f"moe_dispatch: `noisy` must be a bool, got {noisy!r}")
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"moe_dispatch: `mesh` must be a Mesh or None, got {type(mesh).__name__}"
            )
        if axis not in mesh.axis_names:
            raise ValueError(
                f"moe_dispatch: `axis`={axis!r} is not an axis of {mesh!r} (axes "
                f"{list(mesh.axis_names)})"
            )
        if num_experts % mesh.size(axis):
            raise ValueError(
                f"moe_dispatch: `num_experts`={num_experts} is not divisible by the "
                f"{mesh.size(axis)} ranks of axis {axis!r}; every rank must hold the same "
                "number of experts"
            )
    return MoEDispatch(
        expert_fn=expert_fn,
        mesh=mesh,
        axis=axis,
        num_experts=num_experts,
        k=k,
        capacity_factor=_positive("capacity_factor", capacity_factor),
        eval_capacity_factor=_positive("eval_capacity_factor", eval_capacity_factor),
        aux_loss_weight=_weight("aux_loss_weight", aux_loss_weight),
        z_loss_weight=_weight("z_loss_weight", z_loss_weight),
        capacity=capacity,
        noisy=noisy,
    )
