"""`loss_scale(step)`: dynamic loss scaling, with one skip decision that every rank shares.

Algorithm (Micikevicius et al., 2018, "Mixed Precision Training"; the update rule of
``torch.amp.GradScaler``), per step, with S the current scale:

1. The loss is multiplied by S before differentiation: S joins the context's loss weight, so
   every layer inside differentiates ``S * loss`` (accumulation's micro-batch weights included)
   and gradients too small for float16 are lifted out of its underflow range.
2. Each rank checks the gradients it holds, in the plan's own layout (full reduced gradients,
   ZeRO's bucket shards, FSDP's unit shards, the sum over micro-batches), for NaN and infinity,
   and the ranks of every axis of the step's mesh exchange their findings in one all-reduce of
   world-size floats (`fscale.nonfinite.agree`): an overflow that lands in one rank's shard
   makes every rank skip.
3. Found: no rank updates, exactly as ``on_nonfinite="skip"`` (params and optimizer state
   unchanged, the optimizer's count not advanced, ``state.step`` advanced), and
   ``S <- S * backoff_factor``, the run of good steps reset. Not found: the gradients are
   multiplied by 1/S (the float64 reciprocal rounded to float32, as GradScaler's), the update
   runs, and after `growth_interval` good steps in a row ``S <- S * growth_factor`` (kept only
   if finite). The rule is torch's own kernel (``torch._amp_update_scale_``) on host scalars,
   so the scales equal GradScaler's bit for bit.

State: ``state.opt_state`` is a `LossScaleState` wrapping the inner plan's optimizer state
with S (float32) and the count of good steps (int32): they are saved, loaded, consolidated and
resharded with the rest of the state, replicated on every rank.

Numerics: multiplying by a power of two is exact in binary floating point, so with the default
factors a step that does not overflow updates exactly as the same step without loss scaling
(barring underflow of the unscaled values); with torch DDP + GradScaler on the same float32
model, the params agree bit for bit wherever the unscaled plan agrees with DDP.

Gradient clipping belongs to the optimizer (``chain(clip_by_global_norm(c), adamw(...))``), which
runs in the update phase after the gradients are unscaled: it clips the true gradients, as
torch's recipe ``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)`` does, and does
not run on a skipped step.

Composition: `loss_scale` wraps any plan and may sit inside or outside `data_parallel`,
`shard_optimizer`, `fully_shard` and `accumulate` (outside or inside it, the check covers the
sum over all micro-batches, since the update runs once per step). With a mixed-precision policy
put it outside the policy, so that the low-precision backward sees the scaled loss and the
check and unscaling run on the gradients the policy reduces. Around `fscale.pipeline`, the
schedule multiplies each micro-batch's loss by the scale before that micro-batch's backward
(`fscale.parallel.pipeline.precision`), and the check's all-reduce spans every axis of the
mesh, the pipeline axis included: an overflow in one stage's gradients makes every stage skip.

Metrics: ``loss`` stays the unscaled loss; ``loss_scale`` is the scale after this step's update
(the one the next step uses, as ``GradScaler.get_scale()`` after ``update()``), a Python float
equal on every rank; ``skipped`` is 1.0 when the ranks skipped the update, else 0.0.

Cost per step: one sum per contiguous run of gradient memory, one all-reduce of world-size
floats, and one multiply over the gradients (in place when the step donates its buffers, else
into new tensors: the gradients given to ``apply_gradients`` are then left as they were).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from fscale import nonfinite, tree
from fscale.parallel import layers
from fscale.plan import Plan
from fscale.train import Step

__all__ = ["LossScalePlan", "LossScaleState", "loss_scale", "unscale"]

PyTree = Any
# int32, as torch's kernel keeps the count of good steps.
_MAX_GROWTH_INTERVAL = 2**31 - 1


class LossScaleState(NamedTuple):
    """The optimizer state of a `loss_scale` step.

    Attributes:
        inner: the wrapped plan's optimizer state.
        scale: the loss scale the next step multiplies the loss by (a float32 host scalar).
        growth_tracker: the number of good steps in a row since the scale last changed (an
            int32 host scalar).
    """

    inner: PyTree
    scale: torch.Tensor
    growth_tracker: torch.Tensor


@dataclasses.dataclass(frozen=True, repr=False)
class LossScalePlan(Plan):
    """Scale the loss, skip the update on non-finite gradients everywhere, adapt the scale."""

    inner: Plan
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    @property
    def name(self) -> str:
        return "loss_scale"

    def describe(self) -> str:
        return (
            f"loss_scale(init={self.init_scale!r}, growth_factor={self.growth_factor!r}, "
            f"backoff_factor={self.backoff_factor!r}, growth_interval={self.growth_interval})"
        )

    def init(self, step, params, buffers, key, ctx):
        state = self.inner.init(step, params, buffers, key, ctx)
        scaler = LossScaleState(
            state.opt_state,
            torch.tensor(self.init_scale, dtype=torch.float32),
            torch.zeros((), dtype=torch.int32),
        )
        return tree.with_fields(state, opt_state=scaler)

    def gradients(self, step, state, batch, ctx):
        scaler = scaler_state(state.opt_state)
        grads, aux = self.inner.gradients(
            step,
            tree.with_fields(state, opt_state=scaler.inner),
            batch,
            ctx.replace(loss_weight=ctx.loss_weight * float(scaler.scale)),
        )
        if "loss_scale" in aux.metrics:
            raise ValueError(
                "loss_fn returned a metric named 'loss_scale', which loss_scale reports itself; "
                "rename it, e.g. 'my_loss_scale'"
            )
        return grads, aux

    def apply_gradients(self, step, state, grads, aux, ctx):
        scaler = scaler_state(state.opt_state)
        found = ctx.skip_update or self._nonfinite_anywhere(step, grads)
        if not found:
            grads = unscale(grads, scaler.scale, in_place=step.donate)
        new_state, metrics = self.inner.apply_gradients(
            step,
            tree.with_fields(state, opt_state=scaler.inner),
            grads,
            aux,
            ctx.replace(skip_update=found),
        )
        scale, tracker = self._updated(scaler, found)
        new_scaler = LossScaleState(new_state.opt_state, scale, tracker)
        metrics = {**metrics, "loss_scale": float(scale), "skipped": torch.tensor(float(found))}
        return tree.with_fields(new_state, opt_state=new_scaler), metrics

    def consolidate(self, step, state):
        scaler = scaler_state(state.opt_state)
        full = self.inner.consolidate(step, tree.with_fields(state, opt_state=scaler.inner))
        return tree.with_fields(full, opt_state=tree.with_fields(scaler, inner=full.opt_state))

    def shard_state(self, step, full_state):
        scaler = scaler_state(full_state.opt_state, "full_state.opt_state")
        sharded = self.inner.shard_state(step, tree.with_fields(full_state, opt_state=scaler.inner))
        return tree.with_fields(
            sharded, opt_state=tree.with_fields(scaler, inner=sharded.opt_state)
        )

    def _nonfinite_anywhere(self, step: Step, grads: PyTree) -> bool:
        """Whether some rank of the step's mesh holds a non-finite gradient (one all-reduce)."""
        mesh = step.plan.data_mesh()
        axes = () if mesh is None else tuple(mesh.axis_names)
        return nonfinite.agree(nonfinite.has_nonfinite(grads), None, mesh, axes).nonfinite

    def _updated(self, scaler: LossScaleState, found: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scale = scaler.scale.to(torch.float32, copy=True)
        tracker = scaler.growth_tracker.to(torch.int32, copy=True)
        torch._amp_update_scale_(
            scale,
            tracker,
            torch.tensor(float(found), device=scale.device),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        return scale, tracker


def scaler_state(opt_state: Any, what: str = "state.opt_state") -> LossScaleState:
    """`opt_state` checked to be a `LossScaleState` with scalar scale and count."""
    if not isinstance(opt_state, LossScaleState):
        raise ValueError(
            f"loss_scale: `{what}` is a {type(opt_state).__name__}, not the LossScaleState "
            "of a loss_scale step; build the state with this step's init, or load a "
            "checkpoint saved by a step with loss_scale"
        )
    scale, tracker = opt_state.scale, opt_state.growth_tracker
    if not (isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point()):
        raise ValueError(f"loss_scale: `{what}.scale` must be a float scalar tensor, got {scale!r}")
    if not (
        isinstance(tracker, torch.Tensor)
        and tracker.numel() == 1
        and not tracker.is_floating_point()
    ):
        raise ValueError(
            f"loss_scale: `{what}.growth_tracker` must be an integer scalar tensor, got {tracker!r}"
        )
    return opt_state


@torch.no_grad()
def unscale(grads: PyTree, scale: torch.Tensor | float, *, in_place: bool = False) -> PyTree:
    """`grads` multiplied by 1/`scale`, rounded as torch's GradScaler unscales.

    The reciprocal is taken in float64 and rounded to float32, and each gradient is multiplied
    by it in its own dtype's arithmetic (float32 for low-precision gradients), one rounding per
    element, as ``torch._amp_foreach_non_finite_check_and_unscale_``.

    Args:
        grads: a pytree of floating-point tensors.
        scale: the scale the loss was multiplied by (a positive, finite number).
        in_place: overwrite `grads`' tensors instead of returning new ones.
    """
    value = float(scale)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"unscale: `scale` must be a positive, finite number, got {value!r}")
    inverse = torch.tensor(1.0 / value, dtype=torch.float64).to(torch.float32)
    leaves, treedef = tree.flatten(grads)
    out: list[Any] = list(leaves)
    groups: dict[torch.device, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(leaf.device, []).append(i)
    for device, indices in groups.items():
        tensors = [leaves[i] for i in indices]
        factor = inverse.to(device)
        if in_place:
            torch._foreach_mul_(tensors, factor)
        else:
            for i, product in zip(indices, torch._foreach_mul(tensors, factor)):
                out[i] = product
    return tree.unflatten(treedef, out)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"loss_scale: `{name}` must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"loss_scale: `{name}` must be finite, got {name}={value!r}")
    return value


def loss_scale(
    step: Step,
    *,
    init: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> Step:
    """Dynamic loss scaling, as ``torch.amp.GradScaler``, decided alike on every rank.

    See the module docstring for the algorithm, the state, clipping and composition.

    Args:
        step: any Step whose ``on_nonfinite`` is ``"propagate"`` (the default): loss scaling
            decides itself which steps to skip.
        init: the first scale, > 0 (and finite in float32).
        growth_factor: the factor the scale grows by after `growth_interval` good steps, > 1.
        backoff_factor: the factor the scale shrinks by on a step with non-finite gradients,
            in (0, 1).
        growth_interval: the number of good steps in a row after which the scale grows, >= 1.

    Returns:
        A Step whose state's ``opt_state`` is a `LossScaleState` and whose metrics add
        ``loss_scale`` and ``skipped``.

    Raises:
        TypeError: `step` is not a Step, or an argument is not a number (an int for
            `growth_interval`).
        ValueError: an argument out of its range; the step already scales its loss, or was
            built with ``on_nonfinite`` other than ``"propagate"``.

    Example:
        >>> import torch, fscale as fs
        >>> def loss_fn(p, buffers, batch, key):
        ...     return ((p["w"] * batch).sum() - 1.0) ** 2
        >>> step = fs.loss_scale(fs.train_step(loss_fn, fs.optim.sgd(0.1)), growth_interval=1)
        >>> state = step.init({"w": torch.ones(3)})
        >>> state, metrics = step(state, torch.ones(3))
        >>> metrics["loss_scale"], float(metrics["skipped"]), state.params["w"]
        (131072.0, 0.0, tensor([0.6000, 0.6000, 0.6000]))
    """
    layers.check_step(step, "loss_scale")
    init = _number("init", init)
    if not init > 0 or not math.isfinite(float(torch.tensor(init, dtype=torch.float32))):
        raise ValueError(f"loss_scale: `init` must be > 0 and finite in float32, got init={init!r}")
    growth_factor = _number("growth_factor", growth_factor)
    if not growth_factor > 1:
        raise ValueError(
            f"loss_scale: `growth_factor` must be > 1, got growth_factor={growth_factor!r}"
        )
    backoff_factor = _number("backoff_factor", backoff_factor)
    if not 0 < backoff_factor < 1:
        raise ValueError(
            "loss_scale: `backoff_factor` must lie in (0, 1), got "
            f"backoff_factor={backoff_factor!r}"
        )
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise TypeError(
            f"loss_scale: `growth_interval` must be an int, got {type(growth_interval).__name__}"
        )
    if not 1 <= growth_interval <= _MAX_GROWTH_INTERVAL:
        raise ValueError(
            f"loss_scale: `growth_interval` must be in [1, {_MAX_GROWTH_INTERVAL}], got "
            f"growth_interval={growth_interval!r}"
        )
    _check_composition(step)
    plan = LossScalePlan(step.plan, init, growth_factor, backoff_factor, growth_interval)
    return step.replace(plan=plan)


def _check_composition(step: Step) -> None:
    if step.plan.find("loss_scale") is not None:
        raise ValueError("loss_scale: the step already scales its loss; apply loss_scale once")
    if step.on_nonfinite != "propagate":
        raise ValueError(
            f"loss_scale: the step was built with on_nonfinite={step.on_nonfinite!r}; loss "
            "scaling expects overflowing steps and skips them itself (metric 'skipped'), so "
            "build the step with the default on_nonfinite='propagate'"
        )
