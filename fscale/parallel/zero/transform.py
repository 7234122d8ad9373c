"""`shard_optimizer(step, mesh)`: ZeRO-1/2 (FairScale's OSS and ShardedDDP) as a transformation.

Algorithm (Rajbhandari et al., 2020, stages 1 and 2), per step on each of the N ranks of `axis`:

1. Forward and backward on the local batch with the full, replicated parameters.
2. Gradients are reduce-scattered (mean over the axis) bucket by bucket, so rank r receives only
   slice r of every bucket: the gradient of the global mean loss for the elements it owns.
3. The optimizer updates only those slices, with optimizer state for those slices only.
4. The new slices are all-gathered into full parameter buckets, replicated again: in place,
   into the donated buckets, with ``donate=True``; into fresh ones otherwise.

Layout. Trainable leaves are grouped into buckets of about `bucket_mb` (`assign_buckets`, in
reverse order of use so buckets complete early in backward). Each bucket is one flat buffer in
which every leaf starts on a 64-byte boundary and whose length is N equal shards of a multiple
of 64 bytes; rank r owns shard r. The alignment is what makes sharding exact: torch's fused CPU
optimizer kernels (SGD, Adam, Adagrad) run a vectorised body and a scalar tail over each tensor
and the two round differently, so a slice cut at an arbitrary element would be updated
differently from the same elements of the whole tensor. Cut on vector boundaries, every element
takes the same path as in the unsharded update. At rest, ``state.params`` is the usual pytree,
whose leaves are views into the full bucket buffers (the all-gather writes straight into them).

The optimizer sees a pytree with the params' structure whose leaves are the 1-D fragments this
rank owns (empty for leaves it owns none of), plus a `fscale.optim.Sharding` naming each
fragment's place in its full tensor and an all-reduce over the axis. Pointwise optimizers ignore
the layout; LAMB, Adafactor and `clip_by_global_norm` complete their per-tensor and global
statistics with it, so they stay exact under sharding (FairScale's OSS cannot do this: its
per-rank optimizers see only their own parameters). The optimizer state is a `ShardedOptState`:
the wrapped optimizer's state for the owned fragments and the number of shards, so a state
made for another world size is refused on every rank at once.

Communication per rank per step, with Ψ the padded size of all buckets (the sum of
``bucket.numel``: parameters plus alignment and shard padding, at most 64 bytes per leaf and per
shard): a reduce-scatter and an all-gather of Ψ elements, 2·Ψ·(N−1)/N elements under the ring
model, the same as data parallelism's one all-reduce; plus the mean of the scalar metrics and,
if the loss returns floating-point buffers (BatchNorm statistics), of those, averaged as under
`data_parallel` (on gloo, over ZeRO's axis alone, inside the last bucket's collective, float32
buffers included, see `fscale.step_means`; else an all-reduce each). Never an all-reduce
followed by a broadcast.

Gradients:

- ``shard_grads=True`` (ZeRO-2, ShardedDDP): each gradient is copied into its bucket as autograd
  produces it; the moment a bucket is complete its reduce-scatter starts and the bucket is
  released, so the reduction of bucket k runs while backward computes bucket k+1. At most two
  reductions are in flight; the step waits for the older one before starting a third, which
  frees its full bucket. The peak of gradient memory is about Ψ/N (the reduced shards) plus
  three buckets, instead of Ψ. On gloo the reduce-scatter is an exchange between every pair
  of ranks that sums in gloo's ring order (`fscale.distributed.exchange`): each rank receives the
  N - 1 other ranks' parts of its shard, (N - 1)/N of a bucket per reduction in flight, one of
  which becomes the shard (gloo's own reduce-scatter keeps 1.5 more buckets and takes twice the
  time).
- ``shard_grads=False`` (ZeRO-1, OSS on top of DDP): the full gradient buckets are kept until
  backward ends, then reduce-scattered. Gradient memory peaks at Ψ + Ψ/N.
- ``grad_mode="func"`` (`torch.func` gradients, no autograd hooks): backward returns the full
  gradients; they are packed into the buckets and reduce-scattered afterwards, as in ZeRO-1.

The metrics report ``grad_bytes`` (the reduced shards the update used) and ``grad_peak_bytes``
(the most gradient storage alive at once during the step, measured through weak references to
the buffers' storage, so a buffer counts until the last tensor viewing it, collectives in flight
included, is gone).

Numerics. The reduce-scatter sums the ranks' gradients and divides by N afterwards; data
parallelism divides first and all-reduces. Division by a power of two is exact, and at N = 2
both add the same two numbers, so `shard_optimizer` equals `data_parallel` bit for bit. At N = 4
gloo's reduce-scatter and all-reduce associate the four terms differently for some elements, so
results agree to rounding. Non-pointwise statistics are sums over fragments completed by an
all-reduce, which also differ from the unsharded sums by rounding.

Composition. `shard_optimizer` wraps any plan: the layer makes the step's gradient reducer
scatter over its axis and runs the optimizer on the owned fragments (its `ZeroOptimizer` role),
so a plan of your own inside it (local SGD, DiLoCo) has its optimizer state sharded without
knowing it. Around `data_parallel` over the same axis it *replaces* the data-parallel all-reduce
(the reduce-scatter already averages the gradients); with data parallelism over another axis,
each bucket's shard is then all-reduced over that axis (ZeRO within a replica, replicas
averaged). Sharding twice, or with `fully_shard`, is refused. `fscale.checkpoint` inside the
loss, `fs.accumulate` (one reduce-scatter per step) and `fscale.offload_optimizer` around the
optimizer compose unchanged (each rank offloads its own shard).

State in and out: `consolidate(step, state)` returns the full, unsharded TrainState on every
rank (what a single-process step takes); `shard_state(step, full_state)` builds the sharded
state for this step from a full one, at any world size. The mapping is generic over optimizers
and shared with `fully_shard` (`fscale.parallel.opt_state`): a state leaf whose shape differs
from the full one on some rank is a per-element leaf whose ranks' pieces tile its flattening in
rank order, any other leaf is replicated.

Code: this module holds the transformation; the plan that runs a step is
`fscale.parallel.zero.plan`, the bucket layout `fscale.parallel.bucket_layout`.
"""

from __future__ import annotations

from fscale.distributed.mesh import Mesh
from fscale.parallel import layers
from fscale.parallel.zero.plan import ShardedOptimizerPlan
from fscale.train import Step

__all__ = ["shard_optimizer"]


def shard_optimizer(
    step: Step,
    mesh: Mesh,
    axis: str = "dp",
    *,
    shard_grads: bool = True,
    bucket_mb: float = 25.0,
) -> Step:
    """ZeRO: shard the optimizer state (and, by default, the gradients) over `axis`.

    ``shard_grads=True`` is ZeRO-2 (FairScale's ShardedDDP with OSS): each bucket of gradients
    is reduce-scattered as soon as backward completes it and then freed. ``shard_grads=False``
    is ZeRO-1 (OSS with DDP): full gradients until backward ends, then a reduce-scatter. Either
    way each rank updates only its slice of every bucket and the new slices are all-gathered.
    See the module docstring for layout, traffic, memory and numerics.

    Args:
        step: any Step: from `fscale.train_step`, `data_parallel` (over `axis`: replaced; over
            another axis: kept), `accumulate`, or a plan of your own.
        mesh: the mesh; `axis` must be one of its axes.
        axis: the data-parallel axis the state is sharded over; each rank reads its own slice
            of the global batch.
        shard_grads: reduce-scatter and free gradient buckets during backward (ZeRO-2).
        bucket_mb: bucket size in MiB.

    Returns:
        A Step whose state holds replicated parameters and a `ShardedOptState`; its metrics
        (the loss and scalar extras) are means over the data axes, plus ``grad_bytes`` and
        ``grad_peak_bytes``. Use `consolidate` / `shard_state` to convert states.

    Raises:
        TypeError: `step` is not a Step, `mesh` is not a Mesh, or `shard_grads` is not a bool.
        ValueError: `mesh` lacks `axis`; the step already shards its optimizer (here or with
            `fully_shard`), or another layer splits the batch over `axis`; `bucket_mb` is not
            positive; a data-parallel reduction hook is in the step. At init, ranks that
            disagree on the parameter tree get an error naming the first difference.

    Example::

        step = fs.shard_optimizer(fs.train_step(loss_fn, fs.optim.adamw(3e-4)), fs.Mesh(dp=4))
        state = step.init(params, buffers)
        state, metrics = step(state, local_batch)
    """
    layers.check_step(step, "shard_optimizer")
    layers.check_not_expert_parallel(step, "shard_optimizer")
    if not isinstance(shard_grads, bool):
        raise TypeError(
            f"shard_optimizer: `shard_grads` must be True or False, got {shard_grads!r}"
        )
    bucket_bytes = layers.bucket_bytes(bucket_mb, "shard_optimizer")
    sharding = layers.sharding_layer(step.plan)
    if sharding is not None:
        raise ValueError(
            "shard_optimizer: the step already shards its optimizer state "
            f"({sharding.describe()}); "
            "shard it once: shard_optimizer for ZeRO-1/2 or fully_shard for ZeRO-3"
        )
    dp = step.plan.find("data_parallel")
    if dp is not None and getattr(dp, "hook", None) is not None:
        raise ValueError(
            "shard_optimizer: the step's data_parallel layer has a reduction hook, which "
            "compresses full-gradient all-reduces; ZeRO reduce-scatters instead. Drop the hook "
            "or the sharding"
        )
    layers.check_axis_free(step, mesh, axis, "shard_optimizer", replaces=("data_parallel",))
    return step.replace(plan=ShardedOptimizerPlan(step.plan, mesh, axis, bucket_bytes, shard_grads))
