"""OffloadModel: the params of a sequence of stages live in host memory, each copied up to run.

`offload_params(stages, device)` (FairScale's OffloadModel, after L2L) keeps the parameters of
a sequence of stages on the host and copies each stage's parameters to the device just before
it runs, freeing them right after. Every stage is rematerialised: backward copies the stage's
parameters up again, recomputes its forward from the saved input (replaying the forward's RNG
state, `fscale.random.RngState`) and sends the parameter gradients down to the host.

The copies go through `fscale.offload.transfer`: on CUDA they run on side streams from pinned
memory, ordered against the compute stream by events, so an upload overlaps the computation
before it. Elsewhere, including a host that is its own device ("cpu" -> "cpu"), the same
schedule runs with synchronous copies, so results are identical and it is testable on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fscale import tree
from fscale.offload.schedule import PrefetchSchedule, ResidencyEvent
from fscale.offload.transfer import HOST, Transfer, checked_device, pinned_packed_copy
from fscale.random import RngState

__all__ = ["OffloadedStages", "offload_params"]

PyTree = Any


class _Pass:
    """One forward pass over the stages and the backward passes through it.

    Residency (which stages' params are on the device, fetched how far ahead) is a
    `PrefetchSchedule` whose copies are uploads of the stages' host leaves.
    """

    def __init__(self, stages: OffloadedStages, host_leaves: list[list[torch.Tensor]]) -> None:
        self.stages = stages
        copies = stages.transfer
        self.residency = PrefetchSchedule(
            len(host_leaves),
            stages.prefetch,
            start=lambda stage: copies.start_upload(host_leaves[stage]),
            finish=lambda started: copies.finish_upload(*started),
        )
        self.in_graph: set[int] = set()  # stages whose backward autograd will run
        # Dropout and other random ops must draw the same numbers when a stage is recomputed.
        self.rng_states: dict[int, RngState] = {}

    # -- the two halves of one stage

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        residency = self.residency
        on_device = residency.acquire(stage, "forward")
        residency.prefetch_after(stage)  # issued before this stage's kernels, so it overlaps them
        self.rng_states[stage] = RngState.capture([self.stages.device])
        residency.record("forward", "compute", stage)
        y = self._run(stage, on_device, x)
        del on_device
        residency.release(stage, "forward")
        return y

    def backward(
        self,
        stage: int,
        x: torch.Tensor,
        host_leaves: Sequence[torch.Tensor],
        grad_y: torch.Tensor,
        needs: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        if torch.is_grad_enabled():
            return self._backward_differentiable(stage, x, host_leaves, grad_y, needs)
        residency = self.residency
        on_device = residency.acquire(stage, "backward")
        # A stage outside the graph gets no backward call, so its copy would never be freed.
        residency.prefetch_before(stage, among=self.in_graph)
        residency.record("backward", "compute", stage)
        with torch.enable_grad(), self.rng_states[stage].restored():
            live_x = x.detach().requires_grad_(needs[0])
            live = [t.detach().requires_grad_(need) for t, need in zip(on_device, needs[1:])]
            y = self._run(stage, live, live_x)
            wanted = [t for t in [live_x, *live] if t.requires_grad]
            grads = (
                torch.autograd.grad(y, wanted, grad_y, allow_unused=True)
                if y.requires_grad and wanted
                else [None] * len(wanted)
            )
        del y, live, on_device
        residency.release(stage, "backward")
        found = iter(grads)
        grad_x = next(found) if needs[0] else None
        param_grads = [next(found) if need else None for need in needs[1:]]
        return grad_x, self._grads_to_host(param_grads, host_leaves)

    def _backward_differentiable(
        self,
        stage: int,
        x: torch.Tensor,
        host_leaves: Sequence[torch.Tensor],
        grad_y: torch.Tensor,
        needs: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Backward under a higher-order or torch.func transform: stay differentiable.

        The params come up through differentiable copies, so the gradient reaching the host
        leaves is itself differentiable; no prefetch (the copies must be made inside the graph).
        """
        residency = self.residency
        residency.adopt(stage, "backward")  # the copy is made inside `objective` below
        residency.record("backward", "compute", stage)
        device = self.stages.device
        treedef = self.stages.treedefs[stage]
        fn = self.stages.fns[stage]

        def objective(x_in: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
            params = tree.unflatten(treedef, [leaf.to(device) for leaf in leaves])
            y = _checked_output(stage, fn(params, x_in))
            return (y * grad_y).sum()

        with self.rng_states[stage].restored():
            grad_x, grad_leaves = torch.func.grad(objective, argnums=(0, 1))(x, list(host_leaves))
        residency.release(stage, "backward")
        return (
            grad_x if needs[0] else None,
            [g if need else None for g, need in zip(grad_leaves, needs[1:])],
        )

    def _run(self, stage: int, leaves: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        params = tree.unflatten(self.stages.treedefs[stage], leaves)
        return _checked_output(stage, self.stages.fns[stage](params, x))

    def _grads_to_host(
        self, grads: list[torch.Tensor | None], host_leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        moved = self.stages.transfer.download([g for _, g in present]) if present else []
        out: list[torch.Tensor | None] = [None] * len(grads)
        for (i, _), g in zip(present, moved):
            out[i] = g.to(host_leaves[i].device)
        return out


def _checked_output(stage: int, y: Any) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(
            f"offload_params: stage {stage} returned a {type(y).__name__}; a stage function "
            "must return one tensor (the activation passed to the next stage)"
        )
    return y


class _OffloadedStage(torch.autograd.Function):
    """One stage as a rematerialised autograd node: saves its input, recomputes in backward."""

    @staticmethod
    def forward(x: torch.Tensor, schedule: _Pass, stage: int, *host_leaves: torch.Tensor):
        y = schedule.forward(stage, x)
        # An output that *is* an input would make autograd treat the node as a view; a stage
        # that passes its input through gets a fresh tensor instead.
        return y.clone() if y is x else y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, schedule, stage, *host_leaves = inputs
        ctx.schedule = schedule
        ctx.stage = stage
        # Only the input and the (host) params: the stage's activations are recomputed.
        ctx.save_for_backward(x, *host_leaves)
        if any(ctx.needs_input_grad):
            schedule.in_graph.add(stage)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor):
        x, *host_leaves = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[3:])
        grad_x, grad_leaves = ctx.schedule.backward(ctx.stage, x, host_leaves, grad_y, needs)
        return (grad_x, None, None, *grad_leaves)


class OffloadedStages:
    """A sequence of stages whose params live in host memory; call it like the composed stages.

    Built by `offload_params`. ``run(x)`` runs the stages on `run.params`; ``run(x, params)`` on
    params of the same structure (e.g. the live leaves a train step differentiates).

    Attributes:
        params: one params pytree per stage, in host memory (pinned when `device` is CUDA).
        device: where stages compute.
        prefetch: how many stages ahead (behind, in backward) are copied to the device early.
        residency_log: the `ResidencyEvent`s of the latest call and the backward through it.
    """

    def __init__(
        self,
        fns: list[Callable[[PyTree, torch.Tensor], torch.Tensor]],
        params: tuple[PyTree, ...],
        device: torch.device,
        prefetch: int,
    ) -> None:
        self.fns = fns
        self.params = params
        self.treedefs = [tree.structure(p) for p in params]
        self.device = device
        self.prefetch = prefetch
        # Pinned staging for gradient downloads only pays off (and only exists) with CUDA.
        self.transfer = Transfer(device, pin_memory=device.type == "cuda")
        self._last: _Pass | None = None

    @property
    def residency_log(self) -> list[ResidencyEvent]:
        return list(self._last.residency.log) if self._last is not None else []

    def __len__(self) -> int:
        return len(self.fns)

    def __call__(self, x: torch.Tensor, params: Sequence[PyTree] | None = None) -> torch.Tensor:
        """The composition of the stages applied to `x` (moved to `device` if elsewhere).

        Args:
            x: the first stage's input.
            params: one params pytree per stage with the structure of `self.params`, in host
                memory; default `self.params`. Gradients w.r.t. these leaves land on the host.

        Returns:
            The last stage's output, on `device`.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"offload_params: the input must be a tensor, got {type(x).__name__}")
        host_leaves = self._host_leaves(self.params if params is None else params)
        schedule = _Pass(self, host_leaves)
        self._last = schedule
        x = x.to(self.device)
        for stage, leaves in enumerate(host_leaves):
            x = _OffloadedStage.apply(x, schedule, stage, *leaves)
        return x

    def _host_leaves(self, params: Sequence[PyTree]) -> list[list[torch.Tensor]]:
        if not isinstance(params, Sequence) or len(params) != len(self.fns):
            raise ValueError(
                f"offload_params: `params` must be a sequence of {len(self.fns)} params "
                f"pytrees, one per stage, got {type(params).__name__}"
            )
        out = []
        for stage, (stage_params, treedef) in enumerate(zip(params, self.treedefs)):
            leaves, found = tree.flatten(stage_params)
            if found != treedef:
                raise ValueError(
                    f"offload_params: params of stage {stage} have structure {found}, expected "
                    f"{treedef} (the structure given to offload_params)"
                )
            _check_host_leaves(stage, stage_params)
            out.append(leaves)
        return out

    def __repr__(self) -> str:
        return (
            f"OffloadedStages({len(self.fns)} stages, device={str(self.device)!r}, "
            f"prefetch={self.prefetch})"
        )


def _check_host_leaves(stage: int, stage_params: PyTree) -> None:
    paths, leaves, _ = tree.flatten_with_paths(stage_params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"offload_params: stage {stage} params leaf {path!r} is a "
                f"{type(leaf).__name__}, not a tensor"
            )
        if leaf.device != HOST:
            raise ValueError(
                f"offload_params: stage {stage} params leaf {path!r} is on {leaf.device}; the "
                "params of offloaded stages live in host memory ('cpu'): move them there first"
            )


def offload_params(
    stages: Sequence[tuple[Callable[[PyTree, torch.Tensor], torch.Tensor], PyTree]],
    device: str | torch.device,
    *,
    prefetch: int = 1,
) -> OffloadedStages:
    """Keep the params of a sequence of stages in host memory; copy each up only while it runs.

    FairScale's OffloadModel as a function transform. Each stage is ``(stage_fn, stage_params)``
    with ``stage_fn(params, x) -> x`` pure in its params pytree and activation. The returned
    ``run(x)`` equals ``stage_fn_n(params_n, ... stage_fn_1(params_1, x))`` (bit for bit), and:

    - forward: before stage i runs, its params are copied to `device` (unless a prefetch already
      did) and the copies of stages i+1 .. i+`prefetch` are issued, so they overlap stage i;
      stage i's device params are released as soon as it returns. Only its input is kept.
    - backward: stages are visited in reverse; stage i's params come up again (stages
      i-1 .. i-`prefetch` are prefetched), its forward is recomputed from the saved input with
      the forward's RNG state (so dropout matches), the gradients are taken, the parameter
      gradients go down to the host and the device params are released.

    What lives where: host memory holds every stage's params and receives their gradients;
    the device holds at most ``prefetch + 1`` stages' params at any moment, plus one input
    activation per stage and one stage's recomputed activations during its backward.

    Traffic per training step (Ψ parameters in all): 2Ψ up (forward and backward) and Ψ down
    (gradients). Every stage is computed twice (the price of keeping no activations), and on
    CUDA the copies overlap compute only as far as one stage's compute hides the next stage's
    upload; the gain is a device memory bound independent of the model's depth. Pair it with
    an optimizer on the host params: the gradients already live there.

    Gradients flow to the host params: run ``run(x, params)`` under ``torch.autograd.grad`` with
    host leaves that require grad (or ``torch.func.grad``, which takes a slower differentiable
    path with no prefetch). On CUDA the host params are copied once into pinned memory: use
    `run.params`, not the originals, as the trained params.

    Args:
        stages: a sequence of ``(stage_fn, stage_params)`` pairs; the params' leaves must be
            host ("cpu") tensors.
        device: where the stages compute ("cuda", "cuda:1", or "cpu" to run the same schedule
            with the host as its own device).
        prefetch: how many stages ahead of the running one are copied early (0 disables
            prefetching; more hides more latency and holds more device memory).

    Returns:
        An `OffloadedStages` ``run``: ``run(x, params=None)``, with `run.params` (the host
        params) and `run.residency_log` (what was resident on the device at each event).

    Raises:
        TypeError: if `stages` is not a sequence of (callable, params) pairs, a params leaf is
            not a tensor, or `prefetch` is not an int.
        ValueError: if `stages` is empty, a leaf is not in host memory, `device` is unknown or
            unavailable, or `prefetch` < 0.

    Example:
        >>> import torch, fscale as fs
        >>> double = lambda p, x: x * p["w"]
        >>> run = fs.offload_params([(double, {"w": torch.tensor(2.0)})] * 3, "cpu")
        >>> run(torch.ones(2))
        tensor([8., 8.])
    """
    name = "offload_params"
    target = checked_device(name, "device", device)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"{name}: `prefetch` must be an int, got {type(prefetch).__name__}")
    if prefetch < 0:
        raise ValueError(
            f"{name}: `prefetch` must be >= 0 (stages copied ahead of the running one), "
            f"got prefetch={prefetch}"
        )
    if not isinstance(stages, Sequence) or isinstance(stages, (str, bytes)):
        raise TypeError(
            f"{name}: `stages` must be a sequence of (stage_fn, stage_params) pairs, "
            f"got {type(stages).__name__}"
        )
    if not stages:
        raise ValueError(f"{name}: `stages` is empty; give at least one (stage_fn, params) pair")
    fns, params = [], []
    for i, pair in enumerate(stages):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not callable(pair[0]):
            raise TypeError(
                f"{name}: `stages[{i}]` must be a pair (stage_fn, stage_params) with "
                f"stage_fn(params, x) -> x, got {pair!r:.80}"
            )
        _check_host_leaves(i, pair[1])
        fns.append(pair[0])
        params.append(pair[1])
    if target.type == "cuda":
        params = [_pinned_params(p) for p in params]
    return OffloadedStages(fns, tuple(params), target, prefetch)


def _pinned_params(params: PyTree) -> PyTree:
    """`params` copied into page-locked memory (asynchronous uploads need it), grad flags kept."""
    leaves, treedef = tree.flatten(params)
    pinned = pinned_packed_copy([t.detach() for t in leaves])
    return tree.unflatten(
        treedef, [p.detach().requires_grad_(t.requires_grad) for p, t in zip(pinned, leaves)]
    )
