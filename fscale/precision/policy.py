"""The mixed-precision policy: which dtype each gather, reduction and update of a step runs in.

A `Policy` names four dtypes (and two optional casts) and checks, once, that they can be
honoured together:

- ``param_dtype``: what the forward and backward compute in. The parameters the loss function
  receives are casts of the master weights (`fully_shard` casts each shard *before* its
  all-gather, so the wire carries ``param_dtype``).
- ``reduce_dtype``: what gradients are reduced (all-reduced, reduce-scattered) in.
- ``master_dtype``: the dtype of the state's parameters and hence of the optimizer state; the
  update runs on them.
- ``buffer_dtype`` / ``output_dtype``: casts of the buffers the loss function sees and of the
  loss it returns (None: as they are).

Widths form a partial order: float16 and bfloat16 are each narrower than float32, itself
narrower than float64, and neither half format holds the other (float16 has the precision,
bfloat16 the range). A policy needs ``param_dtype <= reduce_dtype <= master_dtype``: reducing
below the compute dtype would round gradients the backward already has, and a master copy
narrower than its gradients would round them again in the update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale.precision.report import collective_dtypes

__all__ = [
    "MASTER_DTYPES",
    "PARAM_DTYPES",
    "REDUCE_DTYPES",
    "Policy",
    "dtype_name",
    "make_policy",
    "narrower_or_equal",
]

PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MASTER_DTYPES = (torch.float32, torch.float64)
CAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Every dtype each one can hold without loss (the partial order of the module docstring).
_HOLDS = {
    torch.bfloat16: {torch.bfloat16},
    torch.float16: {torch.float16},
    torch.float32: {torch.bfloat16, torch.float16, torch.float32},
    torch.float64: {torch.bfloat16, torch.float16, torch.float32, torch.float64},
}


def narrower_or_equal(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether every value of dtype `a` is a value of dtype `b`."""
    return a in _HOLDS.get(b, {b})


def dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A checked mixed-precision policy (build it with `make_policy`); see the module docstring."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    @property
    def casts_params(self) -> bool:
        """Whether the forward sees other values than the master weights."""
        return self.param_dtype != self.master_dtype

    @property
    def reduces_below_master(self) -> bool:
        """Whether gradients are rounded to a narrower dtype than the master weights' to reduce."""
        return self.reduce_dtype != self.master_dtype

    def describe(self) -> str:
        """The policy's dtypes, e.g. ``param_dtype=bfloat16, reduce_dtype=float32, ...``."""
        parts = [
            f"param_dtype={dtype_name(self.param_dtype)}",
            f"reduce_dtype={dtype_name(self.reduce_dtype)}",
            f"master_dtype={dtype_name(self.master_dtype)}",
        ]
        if self.buffer_dtype is not None:
            parts.append(f"buffer_dtype={dtype_name(self.buffer_dtype)}")
        if self.output_dtype is not None:
            parts.append(f"output_dtype={dtype_name(self.output_dtype)}")
        return ", ".join(parts)

    def describe_collectives(self, plan: Any) -> str:
        """The dtype each gradient and parameter collective of `plan`'s layers runs in."""
        return "collectives: " + ("; ".join(collective_dtypes(plan, self)) or "none (one process)")


def _dtype(caller: str, argument: str, value: Any, allowed: tuple[torch.dtype, ...]) -> Any:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{caller}: `{argument}` must be a torch.dtype (e.g. torch.bfloat16), got "
            f"{type(value).__name__}"
        )
    if value not in allowed:
        raise ValueError(
            f"{caller}: `{argument}`={value} is not supported; it must be one of "
            f"{', '.join(dtype_name(d) for d in allowed)}"
        )
    return value


def make_policy(
    param_dtype: Any,
    reduce_dtype: Any = torch.float32,
    master_dtype: Any = torch.float32,
    buffer_dtype: Any = None,
    output_dtype: Any = None,
    *,
    caller: str = "mixed_precision",
) -> Policy:
    """A `Policy` of these dtypes, or a clear error naming the argument that cannot be honoured.

    Raises:
        TypeError: an argument is not a torch.dtype (None where allowed).
        ValueError: a dtype outside the supported ones (integer types, float64 as
            `param_dtype`, a master copy below float32), or an order the policy cannot keep:
            `reduce_dtype` narrower than `param_dtype` or wider than `master_dtype`.
    """
    param = _dtype(caller, "param_dtype", param_dtype, PARAM_DTYPES)
    reduce = _dtype(caller, "reduce_dtype", reduce_dtype, REDUCE_DTYPES)
    master = _dtype(caller, "master_dtype", master_dtype, MASTER_DTYPES)
    buffer = output = None
    if buffer_dtype is not None:
        buffer = _dtype(caller, "buffer_dtype", buffer_dtype, CAST_DTYPES)
    if output_dtype is not None:
        output = _dtype(caller, "output_dtype", output_dtype, CAST_DTYPES)
    if not narrower_or_equal(param, reduce):
        raise ValueError(
            f"{caller}: `reduce_dtype`={dtype_name(reduce)} cannot hold the gradients the backward "
            f"computes in `param_dtype`={dtype_name(param)}; reducing them would round them again. "
            f"Use reduce_dtype={dtype_name(param)} or torch.float32"
        )
    if not narrower_or_equal(reduce, master):
        raise ValueError(
            f"{caller}: `reduce_dtype`={dtype_name(reduce)} is wider than `master_dtype`="
            f"{dtype_name(master)}; the reduced gradients would be rounded to the master weights' "
            f"dtype anyway. Use reduce_dtype={dtype_name(master)}"
        )
    return Policy(param, reduce, master, buffer, output)
