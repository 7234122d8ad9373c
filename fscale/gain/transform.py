"""`adascale(step, mesh)`: AdaScale as a transformation of a data-parallel Step.

Batch S times larger than the base batch, learning rate multiplied by the gain ratio r ∈ [1, S]
(Johnson et al., "AdaScale SGD: A User-Friendly Algorithm for Distributed Training", ICML 2020),
estimated every step from the per-replica and averaged gradient norms (the algorithm is in
`fscale.gain.estimate`, where the norms come from in `fscale.gain.observe`, the layer in
`fscale.gain.plan`). The estimator, its smoothing and debiasing, the default scale
(replicas × micro-batches) and the scale change are FairScale 0.4.13's ``AdaScale``; the numbers
equal FairScale + torch DDP on the same model and data to float32 round-off (tested).

How the learning rate is scaled: by the factor on the optimizer's update (``p + r · (p' − p)``),
which for every fscale optimizer equals running it with ``lr · r``; the optimizer keeps its own
learning rate. A schedule over *scale-invariant progress* Σr (base-batch steps; AdaScale's
``step += optim.gain()``) is given as `schedule`: ``progress -> multiplier``.

Composition: adascale wraps the finished step, any of ``data_parallel``, ``shard_optimizer``,
``fully_shard`` (HSDP included) with or without ``accumulate``; the statistics are a few
scalars replicated on every rank, kept in ``state.opt_state`` (`AdaScaleState`). Cost per step:
one square-sum per parameter in backward, one over the reduced gradients, and one all-reduce of
at most two float64 scalars (two all-reduces under ZeRO or FSDP inside replicas).

Changing the scale mid-run (FairScale's ``set_scale``): build the new step (more ranks, more
micro-batches, or another ``scale=``) and give it the old state; the first step rescales the
noise estimate by S_old / S_new and carries every other statistic over.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fscale import spmd
from fscale.distributed.mesh import Mesh
from fscale.gain import estimate as est
from fscale.gain.observe import ObservedLoss
from fscale.gain.plan import AdamNoise, AdaScalePlan
from fscale.optim.hyper import check_non_negative, check_unit_interval
from fscale.parallel.layers import check_step, sharding_layer
from fscale.train import Step

__all__ = ["adascale"]

RULES = ("sgd", "adam")
# Layers adascale does not know the per-replica gradients of.
_UNSUPPORTED = ("pipeline", "expert_parallel")


def adascale(
    step: Step,
    mesh: Mesh,
    axis: str | tuple[str, ...] = "dp",
    smoothing: float | None = None,
    scale: float | None = None,
    *,
    schedule: Callable[[float], float] | None = None,
    rule: str = "sgd",
    beta2: float = 0.999,
    eps: float = 1e-8,
    warmup: int = 5,
) -> Step:
    """AdaScale: scale the learning rate by the gain ratio of the step's larger batch.

    Args:
        step: a data-parallel Step (``data_parallel``, ``shard_optimizer`` or ``fully_shard``,
            with or without ``accumulate``), or one process accumulating micro-batches.
            Apply adascale last. Its ``grad_mode`` must be ``"autograd"``.
        mesh: the step's mesh.
        axis: the data axis (or axes) whose replicas are the small-batch samples: every data
            axis the step averages gradients over (an axis of size 1 may be one it does not
            have, e.g. one process accumulating micro-batches on ``Mesh(dp=1)``).
        smoothing: the averages' factor θ in [0, 1); None: ``max(1 − n/1000, 0)`` with n =
            replicas × micro-batches (FairScale's default).
        scale: S, the batch relative to the base batch, >= 1; None: n.
        schedule: ``progress -> multiplier`` of the learning rate, driven by Σr (e.g.
            ``fscale.optim.schedules.cosine(1.0, total_steps=T)`` with T base-batch steps);
            None: 1.
        rule: ``"sgd"`` (AdaScale: the gain of the raw gradients, learning rate × r) or
            ``"adam"`` (AdaptDL / Pollux: the gain of the Adam-preconditioned gradients,
            learning rate × r^0.5; `fscale.gain.precondition`). ``"adam"`` reads the full
            second moment, so it runs under data parallelism (no optimizer sharding).
        beta2, eps: the Adam optimizer's (``rule="adam"`` only).
        warmup: updates before the Adam preconditioner is used (``rule="adam"`` only).

    Returns:
        A Step whose metrics add ``gain`` (r of this step) and ``progress`` (Σr so far); like
        every metric they are reduced across ranks in float32, the exact float64 values are
        ``state.opt_state.stats`` (r is ``fscale.gain.gain(stats)``, imported with ``from``).

    Raises:
        TypeError / ValueError: `step` is not a Step or already adascale; `axis` is not an axis
            the step reduces over, or leaves one out; one sample per step (one replica, no
            accumulation: the variance is unknown); `smoothing` outside [0, 1); `scale` < 1;
            an unknown `rule`; torch.func gradients; a pipelined or expert-parallel step.

    Example:
        >>> import torch, fscale as fs
        >>> params = {"w": torch.zeros(2)}
        >>> def loss_fn(p, buffers, batch, key):
        ...     return ((batch @ p["w"] - 1.0) ** 2).mean()
        >>> step = fs.accumulate(fs.train_step(loss_fn, fs.optim.sgd(0.1)), 2)
        >>> step = fs.adascale(step, fs.Mesh(dp=1))
        >>> state = step.init(params)
        >>> state, metrics = step(state, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        >>> round(float(metrics["gain"]), 4), round(float(metrics["progress"]), 4)
        (2.0, 2.0)
    """
    check_step(step, "adascale")
    axes = _check_axes(step, mesh, axis)
    if step.grad_mode != "autograd":
        raise ValueError(
            "adascale: the per-replica norms are read in backward, which torch.func gradients "
            "do not expose; use grad_mode='autograd'"
        )
    for layer in step.plan.layers():
        if layer.name == "adascale":
            raise ValueError(f"adascale: the step is already adascale ({layer.describe()})")
        if layer.name in _UNSUPPORTED:
            raise ValueError(
                f"adascale: the step is {layer.name} ({layer.describe()}), whose per-replica "
                "gradients adascale cannot observe; use data_parallel, shard_optimizer or "
                "fully_shard"
            )
    micro_batches = math.prod(
        int(getattr(layer, "micro_batches", 1))
        for layer in step.plan.layers()
        if layer.name == "accumulate"
    )
    samples = mesh.size(spmd.axis_arg(axes)) * micro_batches
    if samples < 2:
        raise ValueError(
            f"adascale: axis {spmd.axis_arg(axes)!r} has one replica and the step accumulates "
            "no micro-batches, so each step has one gradient sample and its variance is "
            "unknown; use at least 2 replicas or fscale.accumulate(step, k) with k >= 2"
        )
    if smoothing is None:
        smoothing = est.default_smoothing(samples)
    smoothing = check_unit_interval("adascale", "smoothing", smoothing)
    if scale is None:
        scale = float(samples)
    scale = check_non_negative("adascale", "scale", scale)
    if not scale >= 1.0:
        raise ValueError(
            f"adascale: `scale` must be >= 1 (the batch relative to the base batch), got "
            f"scale={scale!r}"
        )
    if schedule is not None and not callable(schedule):
        raise TypeError(
            f"adascale: `schedule` must be a function progress -> multiplier, got "
            f"{type(schedule).__name__}"
        )
    sharding = sharding_layer(step.plan)
    shard_axis = None if sharding is None else str(sharding.axis)  # type: ignore[attr-defined]
    adam = _adam_noise(rule, beta2, eps, warmup, sharding)
    plan = AdaScalePlan(
        step.plan,
        mesh,
        axes,
        micro_batches,
        scale,
        smoothing,
        shard_axis,
        power=0.5 if adam is not None else 1.0,
        schedule=schedule,
        adam=adam,
    )
    return step.replace(plan=plan, loss_fn=ObservedLoss(step.loss_fn))


def _check_axes(step: Step, mesh: Mesh, axis: str | tuple[str, ...]) -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else axis
    if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"adascale: `axis` must be a mesh axis name or a tuple of them, got {axis!r}"
        )
    for name in axes:
        spmd.check_axis(mesh, name, "adascale")
    reduced = step.plan.data_axes()
    for name in axes:
        # An axis of size 1 holds one replica whether or not the step reduces over it.
        if name not in reduced and mesh.size(name) > 1:
            raise ValueError(
                f"adascale: `axis` {name!r} is not an axis the step reduces its gradients over "
                f"(the step's data axes: {reduced or 'none'}); wrap the step in "
                f"fscale.data_parallel(step, mesh, {name!r}) (or shard it over {name!r}) first, "
                "or pass the axis it does reduce over"
            )
    missing = tuple(a for a in reduced if a not in axes and mesh.size(a) > 1)
    if missing:
        raise ValueError(
            f"adascale: the step also averages gradients over {missing}; its replicas there are "
            f"samples too, so pass axis={(*axes, *missing)!r}"
        )
    step_mesh = step.plan.data_mesh()
    if step_mesh is not None and any(step_mesh.size(a) != mesh.size(a) for a in axes):
        raise ValueError(
            "adascale: `mesh` is not the mesh the step runs on (its axis sizes differ); pass "
            "the same fscale.Mesh to every transformation"
        )
    return tuple(axes)


def _adam_noise(
    rule: str, beta2: float, eps: float, warmup: int, sharding: object
) -> AdamNoise | None:
    if rule not in RULES:
        raise ValueError(f"adascale: `rule` must be one of {RULES}, got {rule!r}")
    if rule == "sgd":
        return None
    if sharding is not None:
        raise ValueError(
            "adascale: rule='adam' weighs each rank's own gradient by the full second moment, "
            f"but the step shards its optimizer state ({sharding.describe()}); "  # type: ignore[attr-defined]
            "use data_parallel with rule='adam', or rule='sgd'"
        )
    beta2 = check_unit_interval("adascale", "beta2", beta2)
    eps = check_non_negative("adascale", "eps", eps)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"adascale: `warmup` must be an int >= 0, got warmup={warmup!r}")
    return AdamNoise(beta2, eps, warmup)
