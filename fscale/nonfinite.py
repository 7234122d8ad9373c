"""Non-finite gradients: one verdict that every rank agrees on, and what a step does with it.

A step's gradients are checked once they are reduced, in the plan's own layout (full gradients,
ZeRO's bucket shards, FSDP's unit shards): each rank checks what it holds, and the ranks of the
step's mesh (every axis: data, pipeline stages, tensor shards) exchange their findings in one
small all-reduce, so every rank takes the same decision even when only one rank's shard or one
pipeline stage holds the NaN. `train_step`'s ``on_nonfinite`` chooses it:

- ``"propagate"`` (default): no check, no collective; the update runs as torch.optim's would.
- ``"skip"``: no rank updates: params and optimizer state are returned unchanged (the optimizer's
  own count, which drives schedules and bias correction, does not advance, as torch's GradScaler
  skips ``optimizer.step()``); ``state.step`` advances, since it counts the batches consumed and
  folds the next step's key; buffers take the forward's values (as torch's BatchNorm would).
  The metric ``skipped`` is 1.0 on a skipped step and 0.0 otherwise.
- ``"raise"``: `NonFiniteGradientError` on every rank before the update, naming the ranks whose
  gradients hold the values; the state stays usable.

The local check is one sum per contiguous run of gradient memory (a reduction as fast as a
copy); a non-finite sum is confirmed leaf by leaf with ``isfinite``, so a sum of finite values
that overflows is never taken for a NaN.

Loss scaling (`fscale.loss_scaling`) reuses the mechanism: `agree` is "all ranks agreed this
step's gradients are (not) finite", and a layer that decides to skip passes
``ctx.replace(skip_update=True)`` inward; the innermost layer then returns the state unchanged
but for its step counter (`skipped_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.readback import to_list

if TYPE_CHECKING:
    from fscale.distributed.mesh import Mesh

__all__ = [
    "ON_NONFINITE",
    "Agreement",
    "NonFiniteGradientError",
    "agree",
    "check_on_nonfinite",
    "has_nonfinite",
    "raise_nonfinite",
    "skipped_state",
]

PyTree = Any
ON_NONFINITE = ("propagate", "skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A step's reduced gradients hold NaN or infinity and the step was built to raise."""


class Agreement(NamedTuple):
    """What the ranks of a step's mesh agreed on about one step's gradients.

    Attributes:
        nonfinite_ranks: the ranks (row-major indices along the axes the verdict was exchanged
            over) whose gradients hold a NaN or an infinity; empty when every gradient is finite.
        used: per state leaf, whether some rank's loss used it (None when not asked).
    """

    nonfinite_ranks: tuple[int, ...]
    used: tuple[bool, ...] | None

    @property
    def nonfinite(self) -> bool:
        return bool(self.nonfinite_ranks)


def check_on_nonfinite(caller: str, value: Any) -> str:
    """`value` if it is one of `ON_NONFINITE`, else a ValueError naming the argument."""
    if not isinstance(value, str) or value not in ON_NONFINITE:
        raise ValueError(f"{caller}: `on_nonfinite` must be one of {ON_NONFINITE}, got {value!r}")
    return value


def _runs(leaves: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`leaves` cut into runs of consecutive memory (a bucket's views are one run)."""
    runs: list[list[torch.Tensor]] = []
    end = None
    for leaf in leaves:
        if not leaf.numel():
            continue
        start = leaf.data_ptr()
        contiguous = leaf.is_contiguous()
        if (
            runs
            and contiguous
            and start == end
            and leaf.dtype == runs[-1][0].dtype
            and leaf.untyped_storage().data_ptr() == runs[-1][0].untyped_storage().data_ptr()
        ):
            runs[-1].append(leaf)
        else:
            runs.append([leaf])
        end = start + leaf.numel() * leaf.element_size() if contiguous else None
    return runs


def _span(run: list[torch.Tensor]) -> torch.Tensor:
    if len(run) == 1:
        return run[0]
    first = run[0]
    numel = sum(t.numel() for t in run)
    return first.as_strided((numel,), (1,))


def has_nonfinite(grads: PyTree) -> bool:
    """Whether a tensor leaf of `grads` holds a NaN or an infinity (one sum per memory run)."""
    leaves = [g for g in tree.leaves(grads) if isinstance(g, torch.Tensor)]
    with torch.no_grad():
        for run in _runs(leaves):
            flat = _span(run)
            # Low-precision sums accumulate in float32, where finite gradients cannot overflow.
            accumulate = torch.promote_types(flat.dtype, torch.float32)
            if bool(torch.isfinite(flat.sum(dtype=accumulate))):
                continue
            # A non-finite sum: a NaN or an infinity, or finite values whose sum overflowed.
            if any(not bool(torch.isfinite(t).all()) for t in run):
                return True
    return False


def agree(
    nonfinite: bool,
    used: Sequence[bool] | None,
    mesh: Mesh | None,
    axes: tuple[str, ...],
    *,
    verdict_axes: tuple[str, ...] | None = None,
) -> Agreement:
    """Every rank's finding, exchanged in one all-reduce (two when the axes differ; none on one
    process).

    `nonfinite` is this rank's verdict on the gradients it holds, exchanged over `verdict_axes`
    (default `axes`): a step skips or raises on every rank of its mesh alike, pipeline stages
    and tensor-parallel shards included, so none updates while another does not. `used`, if
    given, is whether its loss used each state leaf, exchanged over the data `axes`: a leaf
    counts as used when any rank used it (the gradient it gets is the mean over the ranks, as
    torch DDP's ``find_unused_parameters``).
    """
    verdict_axes = tuple(axes) if verdict_axes is None else tuple(verdict_axes)
    if verdict_axes == tuple(axes):
        return Agreement(*_exchange(nonfinite, used, mesh, verdict_axes))
    ranks, _ = _exchange(nonfinite, None, mesh, verdict_axes)
    agreed_used = None if used is None else _exchange(None, used, mesh, tuple(axes))[1]
    return Agreement(ranks, agreed_used)


def _exchange(
    nonfinite: bool | None, used: Sequence[bool] | None, mesh: Mesh | None, axes: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[bool, ...] | None]:
    """The ranks along `axes` that found non-finite values (none asked when `nonfinite` is
    None), and which leaves some rank used, in one all-reduce over `axes`."""
    if mesh is None or not axes or mesh.size(_axis(axes)) == 1:
        return ((0,) if nonfinite else ()), None if used is None else tuple(used)
    axis = _axis(axes)
    size = 0 if nonfinite is None else mesh.size(axis)
    flags = torch.zeros(size + (0 if used is None else len(used)), dtype=torch.float32)
    if nonfinite is not None:
        flags[mesh.rank(axis)] = float(nonfinite)
    if used is not None:
        flags[size:] = torch.tensor(used, dtype=torch.float32)
    counts = to_list(collectives.all_reduce(flags, axis, "sum", mesh=mesh))
    ranks = tuple(r for r in range(size) if counts[r] > 0)
    return ranks, None if used is None else tuple(c > 0 for c in counts[size:])


def _axis(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def raise_nonfinite(agreement: Agreement, step_count: int) -> None:
    """The error of ``on_nonfinite="raise"``, raised on every rank alike."""
    ranks = ", ".join(map(str, agreement.nonfinite_ranks))
    raise NonFiniteGradientError(
        f"the gradients of step {step_count} hold NaN or infinity (in the reduced gradients "
        f"held by rank(s) {ranks} of the step's mesh); the state was not updated. Look for the "
        "source in the loss (log(0), division by zero, an overflow in low precision), or build "
        "the step with train_step(..., on_nonfinite='skip') to skip such steps."
    )


def skipped_state(state: Any, buffers: PyTree) -> Any:
    """`state` after a skipped update: the forward's `buffers`, the step counter advanced."""
    return tree.with_fields(state, buffers=buffers, step=state.step + 1)
