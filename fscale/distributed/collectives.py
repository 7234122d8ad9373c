"""The differentiable collectives over mesh axes, each beside its dual: the pairs, one import.

A parallelism is a collective placed in the computation; its gradient is the dual collective.
Every primitive below is a new-style `torch.autograd.Function` (``forward`` + ``setup_context``)
whose backward calls only its dual's ``.apply``, never a raw c10d call: under `torch.func`
transforms a backward receives wrapped tensors, and only a Function's forward sees plain ones
that c10d can work on. So the primitives are exact under `torch.autograd.grad`,
`torch.func.grad`, `torch.func.vjp` and higher-order differentiation alike.

Pairs (``N`` ranks on the axis, ``g`` the cotangent, ``c`` = 1 for op="sum" and 1/N for
op="mean")::

    primitive                              forward                      backward
    -------------------------------------  ---------------------------  --------------------------
    replicate(x, op)                       identity                     all_reduce(g, op)
    all_reduce(x, op)                      c * sum over ranks           c * g
    all_gather(x, dim, op)                 concatenate the shards       reduce_scatter(g, dim, op)
    reduce_scatter(x, dim, op)             c * sum, keep own slice      c * all_gather(g, dim)
    broadcast(x, src)                      src's value on every rank    sum of g onto src, zeros
                                                                        elsewhere (a reduce)
    all_to_all(x, split_dim, concat_dim)   chunk j to rank j            all_to_all(g, concat_dim,
                                                                                   split_dim)
    ppermute(x, perm)                      value of the source rank     ppermute(g, inverse perm)
    send(x, to)                            0-dim zero token             recv x's gradient from `to`
    recv(like, from_)                      value sent by `from_`        send g back to `from_`

Gradient convention
-------------------
Each rank seeds its own loss with 1 and differentiates with its own autograd. A value that
differs across the ranks of an axis ("varying": per-rank data, shards, per-rank losses) is one
variable per rank; a value that is the same on every rank ("replicated": parameters under data
parallelism, the output of an all-reduce) is ONE variable held N times. The global objective is
the sum of the per-rank losses when the loss varies along the axis, and the loss itself when it
is replicated (computed redundantly, counted once). Under this convention:

- ``all_reduce`` (varying -> replicated), ``reduce_scatter``, ``all_to_all``, ``ppermute``,
  ``send``/``recv`` backpropagate the exact adjoint of their forward; `op` is the forward
  reduction, and "mean" divides by N in both directions. Consume an all-reduced value
  replicatedly (the same way on every rank, Megatron's "g"); if the ranks go on to compute
  different losses from it, pass it through ``replicate`` so their gradients are summed.
- ``replicate`` (replicated -> varying: DDP, Megatron's "f"), ``broadcast`` (always "sum") and
  ``all_gather`` (shards ->
  a full value each rank uses with its own loss: ZeRO-3) sum the ranks' gradients for
  op="sum", the gradient of the SUM of the per-rank losses; op="mean" averages them instead,
  the gradient of the MEAN of the per-rank losses, which is fscale's data-parallel convention
  (each rank's loss is the mean over its local batch and the global loss is the mean over
  ranks, so N ranks equal one process on the concatenated batch). For these two, `op` is the
  reduction applied in the BACKWARD pass. It gives the gradient of the mean to the values that
  reach the losses only through this collective (the parameters); values that bypass it (a
  rank's own data) keep the gradient of the sum, which for data that feeds only its own rank's
  loss is the gradient of that loss.

Never differentiate a loss that has already been averaged with ``all_reduce(op="mean")``
through ``replicate(op="mean")``: that divides by N twice. Report global losses under
``torch.no_grad()``, or use ``replicate(op="sum")`` above a replicated loss.

Where each pair lives
---------------------
===================================  ==============================================================
module                               holds
===================================  ==============================================================
`fscale.distributed.replication`     ``replicate`` <-> ``all_reduce``, ``all_reduce_start``
`fscale.distributed.grouped`         ``replicate_many``: ``replicate`` of many tensors, one
                                     all-reduce of their gradients per dtype
`fscale.distributed.sharding`        ``all_gather`` <-> ``reduce_scatter``, their ``*_start``
`fscale.distributed.rooted`          ``broadcast`` <-> reduce onto the source
`fscale.distributed.dispatch`        ``all_to_all`` (self-dual)
`fscale.distributed.point_to_point`  ``ppermute``, ``send`` <-> ``recv``
`fscale.distributed.pending`         `Pending`: the asynchronous start / wait forms
`fscale.distributed.debug`           the cross-rank mismatch check (`set_debug`), the ledger record
`fscale.distributed.watchdog`        counts, one agreement per signature, bounded waits
`fscale.distributed.comm`            axis resolution and the argument checks
===================================  ==============================================================

Arguments are validated on every rank before anything is sent. Ranks that disagree on a
collective (another shape, dtype or operation, or one collective more) fail on every rank
within a bounded time, naming each rank's position (`fscale.distributed.watchdog`). Every
collective records a `fscale.distributed.ledger.CommRecord` where it is issued. Over an axis
of size 1 every collective is an identity (``ppermute`` without a self-pair gives zeros) and
nothing is sent or recorded.
"""

from fscale.distributed.debug import debug_enabled, set_debug
from fscale.distributed.dispatch import all_to_all
from fscale.distributed.grouped import replicate_many
from fscale.distributed.pending import Pending
from fscale.distributed.point_to_point import ppermute, recv, send
from fscale.distributed.replication import all_reduce, all_reduce_start, replicate
from fscale.distributed.rooted import broadcast
from fscale.distributed.sharding import (
    all_gather,
    all_gather_start,
    reduce_scatter,
    reduce_scatter_start,
)
from fscale.distributed.watchdog import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    collective_timeout,
    set_collective_timeout,
)

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Pending",
    "all_gather",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "broadcast",
    "collective_timeout",
    "debug_enabled",
    "ppermute",
    "recv",
    "reduce_scatter",
    "reduce_scatter_start",
    "replicate",
    "replicate_many",
    "send",
    "set_collective_timeout",
    "set_debug",
]
