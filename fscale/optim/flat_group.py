"""A group's leaves as one flat tensor each: the opt-in, not bit-exact, one-call update path.

torch's fused CPU kernels run a vectorised body and a scalar tail over every tensor they are
given, and the two round differently (the body uses FMA). The exact path therefore gives them
the list of per-leaf views, which costs one tail per leaf. Given one flat span per buffer
instead, the kernel runs one body over the whole group: fewer tails and one call, at the price
of last-bit differences from torch.optim on the elements that torch would have sent through a
leaf's tail (and so also between a sharded and an unsharded run, whose leaves are cut
differently).

A group is flattened when its gradients lie in few *runs* (consecutive views of one storage
each, `fscale.optim.packing.gradient_runs`) and its params and every state buffer are one span
per run, leaf for leaf: the kernel then gets one span per run. The gradients are the caller's:

- a flat gradient buffer in the params' order is one run;
- `fscale.data_parallel` hands over views of its reduced buckets, filled in reverse order of
  use: one run per bucket; `fscale.shard_optimizer` the fragments of this rank's shard of each
  bucket, which its parameter fragments mirror: again one run per bucket (fragments that other
  ranks hold are empty and join any run);
- gradients in separate tensors (what autograd returns to `fscale.train_step` on one process)
  keep the per-leaf call, since packing them costs a copy every step, and on CPU that copy
  costs more than the one call saves (measured on torch 2.13, one thread, AVX2: a
  `torch._foreach_copy_` of 200 gradients of 25,000 elements into one buffer takes 3.3 ms,
  while the one call saves 0.7 ms of the 6.2 ms per-leaf call; on 2,000 of 1,000 elements
  4.2 ms against 3.3 ms).

Params and state are made to follow the runs by `fscale.optim.core` (``packed=True``): copies
are packed in the runs' order, and donated leaves that are not one span per run (the caller's
own tensors, or state packed in leaf order by ``init``) are copied once into one buffer in
that order, which later steps update in place. Runs are ordered by their lowest leaf index,
not by address, so buckets allocated anew each step keep matching the packed state.

The decision costs no per-leaf work once made: `fscale.optim.packing` records the layout of
the buffers it builds and of each list it finds to be one span or a few runs, so a step whose
params, state and gradients are the tensors of an earlier step (a donated step, a flat
gradient buffer that is refilled) reads no leaf's address; gradients that are new tensors
every step (a reducer's bucket views) have their addresses read once per step, in C loops.
"""

from __future__ import annotations

import torch

from fscale.optim.core import Group
from fscale.optim.packing import gradient_runs, run_spans

__all__ = ["flattened"]


def flattened(group: Group) -> Group | None:
    """`group` with its params, grads and buffers as one 1-D span per gradient run, or None.

    None when the gradients do not lie in few runs (`fscale.optim.packing.gradient_runs`), or
    the params or a state buffer are not one span per run in the gradients' order; the caller
    then runs the per-leaf update.
    """
    runs = gradient_runs(group.grads)
    if runs is None:
        return None
    params = run_spans(group.params, runs)
    if params is None:
        return None
    buffers: dict[str, list[torch.Tensor]] = {}
    for field, leaves in group.buffers.items():
        pieces = run_spans(leaves, runs)
        if pieces is None:
            return None
        buffers[field] = pieces
    return Group(params, runs.spans, buffers, group.step, group.lr)
