"""Differentiable collectives on real gloo ranks: forwards, dual backwards, async, checks.

Every rank can build every rank's inputs (they are deterministic functions of the rank), so
each test computes the expected value with plain torch on the rank itself and returns the
comparison; gradients are checked under torch.autograd.grad, torch.func.grad and
torch.func.vjp, and the ledger counts the collectives each backward issues.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.distributed import collectives, debug
from fscale.testing.pool import run_spmd

F64 = torch.float64
WORLD_SIZES = [2, 4]


# ---- helpers that run on the ranks -----------------------------------------------------------


def _value(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A rank-dependent input with distinct entries."""
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=F64) + 10.0 * rank).reshape(shape) / 7.0


def _weight(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A rank-dependent cotangent, so per-rank losses <y, w_rank> differ."""
    numel = torch.Size(shape).numel()
    return torch.cos(torch.arange(numel, dtype=F64) * 0.7 + rank).reshape(shape)


def _three_grads(fn, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of scalar fn at x by autograd.grad, func.grad and func.vjp (in that order)."""
    leaf = x.clone().requires_grad_()
    by_autograd = torch.autograd.grad(fn(leaf), leaf)[0]
    by_func_grad = torch.func.grad(fn)(x)
    out, vjp_fn = torch.func.vjp(fn, x)
    (by_vjp,) = vjp_fn(torch.ones_like(out))
    return {"autograd": by_autograd, "func.grad": by_func_grad, "func.vjp": by_vjp}


def _backward_ops(fn, x: torch.Tensor) -> list[str]:
    """The collectives issued by the backward of scalar fn at x (forward run outside)."""
    leaf = x.clone().requires_grad_()
    loss = fn(leaf)
    with fd.comm_ledger() as ledger:
        torch.autograd.grad(loss, leaf)
    return [record.op for record in ledger.records]


def _check_grads(fn, x, expected) -> None:
    for path, grad in _three_grads(fn, x).items():
        torch.testing.assert_close(grad, expected, msg=lambda m, p=path: f"{p}: {m}")


# ---- forward values, gradients, dual collectives ---------------------------------------------


def _replicate_case(op: str) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    x = _value(0, (2, 3))  # replicated: the same on every rank
    torch.testing.assert_close(fd.replicate(x, "dp", op, mesh=mesh), x)

    def loss(v):
        return (fd.replicate(v, "dp", op, mesh=mesh) * _weight(rank, (2, 3))).sum()

    total = sum(_weight(r, (2, 3)) for r in range(n))
    _check_grads(loss, x, total / n if op == "mean" else total)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_replicate_backward_is_all_reduce(world, op):
    for ops in run_spmd(_replicate_case, world, op):
        assert ops == ["all_reduce"]


def _all_reduce_case(op: str) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    x = _value(rank, (3, 2))
    total = sum(_value(r, (3, 2)) for r in range(n))
    expected = total / n if op == "mean" else total
    torch.testing.assert_close(fd.all_reduce(x, "dp", op, mesh=mesh), expected)
    assert torch.equal(x, _value(rank, (3, 2))), "all_reduce must not modify its input"

    weight = _weight(0, (3, 2))  # the reduced value is consumed the same way on every rank

    def loss(v):
        return (fd.all_reduce(v, "dp", op, mesh=mesh) * weight).sum()

    _check_grads(loss, x, weight / n if op == "mean" else weight)

    # Consumed differently per rank, the result goes through replicate: gradients add up.
    def varying_loss(v):
        reduced = fd.replicate(fd.all_reduce(v, "dp", op, mesh=mesh), "dp", mesh=mesh)
        return (reduced * _weight(rank, (3, 2))).sum()

    total_weight = sum(_weight(r, (3, 2)) for r in range(n))
    _check_grads(varying_loss, x, total_weight / n if op == "mean" else total_weight)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_forward_and_identity_backward(world, op):
    for ops in run_spmd(_all_reduce_case, world, op):
        assert ops == []  # Megatron "g": no communication in backward


def _all_gather_case(dim: int, op: str) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    shape = (2, 3)
    x = _value(rank, shape)
    full = torch.cat([_value(r, shape) for r in range(n)], dim=dim)
    torch.testing.assert_close(fd.all_gather(x, "dp", dim, op, mesh=mesh), full)

    def loss(v):
        return (fd.all_gather(v, "dp", dim, op, mesh=mesh) * _weight(rank, full.shape)).sum()

    # d/dx_rank of the sum (or mean) over ranks r of <gathered, w_r>: rank's slice of sum_r w_r.
    total = sum(_weight(r, full.shape) for r in range(n))
    expected = total.chunk(n, dim=dim)[rank] / (n if op == "mean" else 1)
    _check_grads(loss, x, expected)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize(("dim", "op"), [(0, "sum"), (1, "mean"), (-1, "sum")])
def test_all_gather_backward_is_reduce_scatter(world, dim, op):
    for ops in run_spmd(_all_gather_case, world, dim, op):
        assert ops == ["reduce_scatter"]


def _reduce_scatter_case(dim: int, op: str) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    shape = (2 * n, 3) if dim == 0 else (3, 2 * n)
    x = _value(rank, shape)
    total = sum(_value(r, shape) for r in range(n))
    reduced = total / n if op == "mean" else total
    expected_shard = reduced.chunk(n, dim=dim)[rank]
    torch.testing.assert_close(fd.reduce_scatter(x, "dp", dim, op, mesh=mesh), expected_shard)

    shard_shape = expected_shard.shape

    def loss(v):
        return (fd.reduce_scatter(v, "dp", dim, op, mesh=mesh) * _weight(rank, shard_shape)).sum()

    # Every rank's x reaches rank r's shard r with factor 1 (or 1/N): gradient = gathered w.
    gathered = torch.cat([_weight(r, shard_shape) for r in range(n)], dim=dim)
    _check_grads(loss, x, gathered / n if op == "mean" else gathered)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize(("dim", "op"), [(0, "sum"), (1, "mean")])
def test_reduce_scatter_backward_is_all_gather(world, dim, op):
    for ops in run_spmd(_reduce_scatter_case, world, dim, op):
        assert ops == ["all_gather"]


def _all_to_all_case(split_dim: int, concat_dim: int) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(ep=n)
    shape = (2 * n, 3)
    chunks = [_value(r, shape).chunk(n, dim=split_dim) for r in range(n)]
    expected = torch.cat([chunks[r][rank] for r in range(n)], dim=concat_dim)
    x = _value(rank, shape)
    y = fd.all_to_all(x, "ep", split_dim, concat_dim, mesh=mesh)
    torch.testing.assert_close(y, expected)
    # The inverse exchange (dims swapped) restores the input.
    back = fd.all_to_all(y, "ep", concat_dim, split_dim, mesh=mesh)
    torch.testing.assert_close(back, x)

    def loss(v):
        exchanged = fd.all_to_all(v, "ep", split_dim, concat_dim, mesh=mesh)
        return (exchanged * _weight(rank, y.shape)).sum()

    # Chunk j of this rank's x lands on rank j at position `rank` of its concat_dim.
    expected_grad = torch.cat(
        [_weight(j, y.shape).chunk(n, dim=concat_dim)[rank] for j in range(n)], dim=split_dim
    )
    _check_grads(loss, x, expected_grad)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize(("split_dim", "concat_dim"), [(0, 0), (0, 1)])
def test_all_to_all_round_trip_and_self_dual_backward(world, split_dim, concat_dim):
    for ops in run_spmd(_all_to_all_case, world, split_dim, concat_dim):
        assert ops == ["all_to_all"]


def _ppermute_case(perm: list[tuple[int, int]]) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(pp=n)
    x = _value(rank, (4,))
    source = next((s for s, d in perm if d == rank), None)
    expected = _value(source, (4,)) if source is not None else torch.zeros(4, dtype=F64)
    y = fd.ppermute(x, "pp", perm, mesh=mesh)
    torch.testing.assert_close(y, expected)
    inverse = [(d, s) for s, d in perm]
    sent = next((d for s, d in perm if s == rank), None)
    restored = fd.ppermute(y, "pp", inverse, mesh=mesh)
    torch.testing.assert_close(restored, x if sent is not None else torch.zeros_like(x))

    def loss(v):
        return (fd.ppermute(v, "pp", perm, mesh=mesh) * _weight(rank, (4,))).sum()

    # The gradient comes back from the rank this one sent to (zero if it sent nothing).
    expected_grad = _weight(sent, (4,)) if sent is not None else torch.zeros(4, dtype=F64)
    _check_grads(loss, x, expected_grad)
    return _backward_ops(loss, x)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("shift", ["ring", "pipeline"])
def test_ppermute_shift_inverse_and_backward(world, shift):
    if shift == "ring":
        perm = [(i, (i + 1) % world) for i in range(world)]
    else:  # open chain: rank 0 receives nothing, the last rank sends nothing
        perm = [(i, i + 1) for i in range(world - 1)]
    for ops in run_spmd(_ppermute_case, world, perm):
        assert ops == ["ppermute"]


# ---- send / recv ----------------------------------------------------------------------------


def _pipeline_chain(use_func: bool) -> torch.Tensor:
    """Stages 0..n-1; stage s multiplies by (s + 2) and sends on; the last stage's loss is
    <z, w>. Every stage returns the gradient of its own input."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(pp=n)
    shape = (3,)

    def stage(inp):
        z = fd.recv(inp, "pp", from_=rank - 1, mesh=mesh) if rank > 0 else inp
        y = z * (rank + 2)
        if rank == n - 1:
            return (y * _weight(0, shape)).sum()
        return fd.send(y, "pp", to=rank + 1, mesh=mesh)

    # Rank 0's input is real data; later stages pass a template that only tracks the graph.
    inp = _value(0, shape) if rank == 0 else torch.zeros(shape, dtype=F64)
    if use_func:
        return torch.func.grad(stage)(inp)
    leaf = inp.clone().requires_grad_()
    return torch.autograd.grad(stage(leaf), leaf)[0]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("use_func", [False, True])
def test_send_recv_pipeline_gradients(world, use_func):
    results = run_spmd(_pipeline_chain, world, use_func)
    factor = 1.0
    for s in range(world):
        factor *= s + 2
    torch.testing.assert_close(results[0], factor * _weight(0, (3,)))
    for template_grad in results[1:]:  # the recv template's values never matter
        torch.testing.assert_close(template_grad, torch.zeros(3, dtype=F64))


def _send_recv_ledger() -> list[tuple[str, float]]:
    rank = dist.get_rank()
    mesh = fd.Mesh(pp=2)
    with fd.comm_ledger() as ledger:
        if rank == 0:
            x = torch.ones(5, requires_grad=True)
            torch.autograd.grad(fd.send(x, "pp", to=1, mesh=mesh), x)
        else:
            like = torch.zeros(5, requires_grad=True)
            torch.autograd.grad(fd.recv(like, "pp", from_=0, mesh=mesh).sum(), like)
    return [(r.op, r.bytes) for r in ledger.records]


def test_send_recv_backward_reverses_direction():
    sender, receiver = run_spmd(_send_recv_ledger, 2)
    assert sender == [("send", 20.0), ("recv", 0.0)]
    assert receiver == [("recv", 0.0), ("send", 20.0)]


# ---- a composed program against central differences -------------------------------------------


def _composed_loss(w_shard, x, v, mesh, op):
    """all_gather -> matmul -> reduce_scatter -> replicate, this rank's loss."""
    weight = fd.all_gather(w_shard, "dp", 0, op, mesh=mesh)  # (n*2, 3)
    hidden = torch.tanh(weight @ x)  # (n*2, 2)
    shard = fd.reduce_scatter(hidden, "dp", 0, op, mesh=mesh)  # (2, 2)
    scale = fd.replicate(v, "dp", op, mesh=mesh)  # (2, 2), replicated
    return (torch.sin(shard * scale) + shard**2).sum()


def _finite_difference_case(op: str) -> float:
    """Max |analytic - central difference| of the global objective, on this rank.

    For op="sum" the objective is the replicated all_reduce(sum) of the per-rank losses and
    every input is checked. For op="mean" the objective is the mean of the per-rank losses; the
    parameters (w_shard through all_gather, v through replicate) get its gradient, and x, which
    reaches the losses through reduce_scatter only, gets the gradient of their sum (N times).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    inputs = [_value(rank, (2, 3)) / 5, torch.cos(_value(rank, (3, 2))), _weight(0, (2, 2))]

    def objective(w_shard, x, v):
        loss = _composed_loss(w_shard, x, v, mesh, op)
        return fd.all_reduce(loss, "dp", "sum", mesh=mesh) if op == "sum" else loss

    leaves = [t.clone().requires_grad_() for t in inputs]
    analytic = torch.autograd.grad(objective(*leaves), leaves)
    by_func = torch.func.grad(objective, argnums=(0, 1, 2))(*inputs)
    for a, b in zip(analytic, by_func):
        torch.testing.assert_close(a, b)

    def global_value(values):
        with torch.no_grad():
            loss = _composed_loss(*values, mesh, op)
            return fd.all_reduce(loss, "dp", op, mesh=mesh).item()

    eps = 1e-6
    worst = 0.0
    for index, tensor in enumerate(inputs):
        replicated = index == 2
        # Every rank runs every evaluation so their collectives stay in step.
        for owner in [None] if replicated else range(n):
            for element in range(tensor.numel()):
                diffs = []
                for sign in (1, -1):
                    values = [t.clone() for t in inputs]
                    if replicated or owner == rank:
                        values[index].view(-1)[element] += sign * eps
                    diffs.append(global_value(values))
                numeric = (diffs[0] - diffs[1]) / (2 * eps)
                if replicated or owner == rank:
                    scale = n if (op == "mean" and index == 1) else 1
                    got = analytic[index].view(-1)[element].item()
                    worst = max(worst, abs(got - scale * numeric))
    return worst


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_composed_program_matches_finite_differences(world, op):
    for error in run_spmd(_finite_difference_case, world, op):
        assert error < 1e-6


def _second_order_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Hessian-vector product through all_gather/reduce_scatter/replicate: func.grad twice
    against autograd double backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    inputs = (_value(rank, (2, 3)) / 5, torch.cos(_value(rank, (3, 2))), _weight(0, (2, 2)))

    def loss(w_shard):
        return _composed_loss(w_shard, inputs[1], inputs[2], mesh, "mean")

    direction = _weight(rank, (2, 3))
    by_func = torch.func.grad(lambda w: (torch.func.grad(loss)(w) * direction).sum())(inputs[0])
    leaf = inputs[0].clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    (by_autograd,) = torch.autograd.grad((grad * direction).sum(), leaf)
    return by_func, by_autograd


def test_second_order_gradients_agree():
    for by_func, by_autograd in run_spmd(_second_order_case, 2):
        torch.testing.assert_close(by_func, by_autograd)


# ---- asynchronous forms ---------------------------------------------------------------------


def _async_case() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    x = _value(rank, (2, 4))
    with mesh:  # the current mesh
        pending = fd.all_gather_start(x, "dp", dim=1)
        assert "in flight" in repr(pending)
        busy = (x @ x.T).sum()  # compute placed between start and wait
        gathered = pending.wait()
        assert pending.wait() is gathered and "done" in repr(pending)
        torch.testing.assert_close(gathered, fd.all_gather(x, "dp", dim=1))
        torch.testing.assert_close(
            fd.reduce_scatter_start(x, "dp", dim=1, op="mean").wait(),
            fd.reduce_scatter(x, "dp", dim=1, op="mean"),
        )
        torch.testing.assert_close(
            fd.all_reduce_start(x, "dp", op="mean").wait(), fd.all_reduce(x, "dp", op="mean")
        )
        # Several in flight at once, waited on in another order than started.
        first, second = fd.all_reduce_start(x, "dp"), fd.all_gather_start(x, "dp")
        torch.testing.assert_close(second.wait(), fd.all_gather(x, "dp"))
        torch.testing.assert_close(first.wait(), fd.all_reduce(x, "dp"))

        # Differentiable: start/wait has the same gradient as the synchronous form.
        def prefetched(v):
            pending = fd.all_gather_start(v, "dp", dim=0, op="mean")
            return (pending.wait() * _weight(rank, (2 * n, 4))).sum() + busy.detach()

        def synchronous(v):
            return (fd.all_gather(v, "dp", dim=0, op="mean") * _weight(rank, (2 * n, 4))).sum()

        expected = _three_grads(synchronous, x)["autograd"]
        _check_grads(prefetched, x, expected)
        assert _backward_ops(prefetched, x) == ["reduce_scatter"]


def test_async_start_wait_matches_sync():
    run_spmd(_async_case, 2)
    run_spmd(_async_case, 4)


class _ReduceGradInBackward(torch.autograd.Function):
    """Identity whose backward starts an all-reduce of its gradient and leaves it in flight."""

    @staticmethod
    def forward(x, pendings, mesh):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.pendings, ctx.mesh = inputs

    @staticmethod
    def backward(ctx, grad):
        ctx.pendings.append(fd.all_reduce_start(grad, "dp", "mean", mesh=ctx.mesh))
        ctx.pendings.append(fd.reduce_scatter_start(grad, "dp", 0, "sum", mesh=ctx.mesh))
        return grad, None, None


def _bucket_hook_case() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    param = torch.ones(2 * n, dtype=F64, requires_grad=True)
    pendings: list = []
    loss = (_ReduceGradInBackward.apply(param, pendings, mesh) * _weight(rank, (2 * n,))).sum()
    torch.autograd.grad(loss, param)
    mean_grad, grad_shard = (pending.wait() for pending in pendings)  # e.g. before the step
    total = sum(_weight(r, (2 * n,)) for r in range(n))
    torch.testing.assert_close(mean_grad, total / n)
    mean_grad.mul_(2.0)  # results are plain tensors an optimizer may update in place
    torch.testing.assert_close(mean_grad, 2 * total / n)
    torch.testing.assert_close(grad_shard, total.chunk(n)[rank])


def test_start_inside_a_backward_is_waited_later():
    run_spmd(_bucket_hook_case, 2)


# ---- meshes with several axes ---------------------------------------------------------------


def _multi_axis_case() -> None:
    rank = dist.get_rank()
    mesh = fd.Mesh(dp=2, tp=2)
    x = _value(rank, (2,))
    everyone = [_value(r, (2,)) for r in range(4)]
    # Per axis: dp groups {0,2},{1,3}; tp groups {0,1},{2,3}.
    dp_peers = [r for r in range(4) if r % 2 == rank % 2]
    tp_peers = [r for r in range(4) if r // 2 == rank // 2]
    dp_sum, tp_sum = (sum(everyone[r] for r in peers) for peers in (dp_peers, tp_peers))
    torch.testing.assert_close(fd.all_reduce(x, "dp", mesh=mesh), dp_sum)
    torch.testing.assert_close(fd.all_reduce(x, "tp", mesh=mesh), tp_sum)
    torch.testing.assert_close(
        fd.all_gather(x, "tp", mesh=mesh), torch.cat([everyone[r] for r in tp_peers])
    )
    # Tuples of axes act as one flattened axis, row-major (first outermost): global rank order.
    assert mesh.rank(("dp", "tp")) == rank and mesh.size(("dp", "tp")) == 4
    mean = fd.all_reduce(x, ("dp", "tp"), "mean", mesh=mesh)
    torch.testing.assert_close(mean, sum(everyone) / 4)
    gathered = fd.all_gather(x, ("dp", "tp"), mesh=mesh)
    torch.testing.assert_close(gathered, torch.cat(everyone))
    full = _value(rank, (8,))
    torch.testing.assert_close(
        fd.reduce_scatter(full, ("dp", "tp"), mesh=mesh),
        sum(_value(r, (8,)) for r in range(4)).chunk(4)[rank],
    )

    def loss(v):
        return (fd.all_gather(v, ("dp", "tp"), op="mean", mesh=mesh) * _weight(rank, (8,))).sum()

    expected = (sum(_weight(r, (8,)) for r in range(4)) / 4).chunk(4)[rank]
    _check_grads(loss, x, expected)

    def replicated_loss(v):
        return (fd.replicate(v, ("dp", "tp"), "mean", mesh=mesh) * _weight(rank, (2,))).sum()

    _check_grads(replicated_loss, x, sum(_weight(r, (2,)) for r in range(4)) / 4)


def test_collectives_per_axis_and_over_axis_tuples():
    run_spmd(_multi_axis_case, 4)


def _size_one_axis_case() -> None:
    n = dist.get_world_size()
    mesh = fd.Mesh(dp=n, tp=1)
    x = _value(dist.get_rank(), (2, 2))
    with fd.comm_ledger() as ledger:
        for y in (
            fd.replicate(x, "tp", "mean", mesh=mesh),
            fd.all_reduce(x, "tp", "mean", mesh=mesh),
            fd.all_gather(x, "tp", 1, mesh=mesh),
            fd.reduce_scatter(x, "tp", 1, mesh=mesh),
            fd.all_to_all(x, "tp", 0, 1, mesh=mesh),
            fd.ppermute(x, "tp", [(0, 0)], mesh=mesh),
            fd.all_gather_start(x, "tp", mesh=mesh).wait(),
        ):
            torch.testing.assert_close(y, x)
        torch.testing.assert_close(fd.ppermute(x, "tp", [], mesh=mesh), torch.zeros_like(x))

        def gathered_sum(v):
            return fd.all_gather(v, "tp", op="mean", mesh=mesh).sum()

        _check_grads(gathered_sum, x, torch.ones_like(x))
    assert ledger.records == []


def test_size_one_axis_is_identity_and_silent():
    run_spmd(_size_one_axis_case, 2)


def test_one_process_mesh_without_torch_distributed():
    assert not dist.is_initialized()
    mesh = fd.Mesh(dp=1)
    x = torch.arange(4.0).reshape(2, 2)
    with mesh, fd.comm_ledger() as ledger:
        assert torch.equal(fd.all_reduce(x, "dp", "mean"), x)
        assert torch.equal(fd.all_gather(x, "dp", dim=1), x)
        assert torch.equal(fd.reduce_scatter(x, "dp"), x)
        assert torch.equal(fd.all_to_all(x, "dp", 0, 1), x)
        assert torch.equal(fd.all_reduce_start(x, "dp").wait(), x)
        assert torch.equal(fd.reduce_scatter_start(x, "dp").wait(), x)
        grad = torch.func.grad(lambda v: (fd.replicate(v, "dp", "mean") * 3).sum())(x)
        assert torch.equal(grad, torch.full_like(x, 3.0))
    assert ledger.records == []


# ---- argument errors (checked before anything is sent) -----------------------------------------


def test_argument_errors_name_the_argument():
    mesh = fd.Mesh(dp=1)
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"`op` must be 'sum' or 'mean', got 'max'"):
        fd.all_reduce(x, "dp", "max", mesh=mesh)
    with pytest.raises(TypeError, match=r"op='mean' needs a floating-point"):
        fd.all_reduce(torch.ones(4, dtype=torch.int64), "dp", "mean", mesh=mesh)
    with pytest.raises(TypeError, match=r"`x` must be a torch.Tensor, got list"):
        fd.replicate([1.0], "dp", mesh=mesh)
    with pytest.raises(ValueError, match=r"`dim`=2 is out of range for a tensor of shape \(4,\)"):
        fd.all_gather(x, "dp", dim=2, mesh=mesh)
    with pytest.raises(ValueError, match=r"at least 1 dimension"):
        fd.all_gather(torch.tensor(1.0), "dp", mesh=mesh)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tp': Mesh\(dp=1\) has axes 'dp'"):
        fd.all_gather(x, "tp", mesh=mesh)
    with pytest.raises(ValueError, match=r"names an axis twice"):
        fd.all_reduce(x, ("dp", "dp"), mesh=mesh)
    with pytest.raises(TypeError, match=r"`axis` must be an axis name"):
        fd.all_to_all(x, ("dp",), mesh=mesh)
    with pytest.raises(ValueError, match=r"no mesh given and none is active; pass `mesh=`"):
        fd.all_reduce(x, "dp")
    with pytest.raises(TypeError, match=r"`mesh` must be a fscale.distributed.Mesh"):
        fd.all_reduce(x, "dp", mesh="dp")
    with pytest.raises(ValueError, match=r"pair \(0, 1\) in `perm` is outside the axis of size 1"):
        fd.ppermute(x, "dp", [(0, 1)], mesh=mesh)
    with pytest.raises(TypeError, match=r"sequence of \(source, destination\) int pairs"):
        fd.ppermute(x, "dp", [0], mesh=mesh)
    with pytest.raises(ValueError, match=r"`to`=0 must be another rank's index"):
        fd.send(x, "dp", to=0, mesh=mesh)
    with pytest.raises(ValueError, match=r"`from_`=3 must be another rank's index"):
        fd.recv(x, "dp", from_=3, mesh=mesh)


def _indivisible_case() -> str:
    mesh = fd.Mesh(dp=dist.get_world_size())
    try:
        fd.reduce_scatter(torch.ones(3, 2), "dp", mesh=mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_perm_case() -> str:
    mesh = fd.Mesh(pp=dist.get_world_size())
    try:
        fd.ppermute(torch.ones(2), "pp", [(0, 1), (1, 1)], mesh=mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def test_multi_rank_argument_errors_on_every_rank():
    for message in run_spmd(_indivisible_case, 2):
        assert "has size 3, not divisible by the 2 ranks of axis 'dp'" in message
    for message in run_spmd(_bad_perm_case, 2):
        assert "must be a permutation" in message


# ---- debug metadata check ---------------------------------------------------------------------


def _mismatch_case(kind: str) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    before = fd.debug_enabled()
    fd.set_debug(True)
    try:
        if kind == "shape":
            fd.all_gather(torch.ones(2 + rank), "dp", mesh=mesh)
        elif kind == "dtype":
            dtype = torch.float64 if rank == n - 1 else torch.float32
            fd.all_reduce(torch.ones(3, dtype=dtype), "dp", mesh=mesh)
        elif kind == "op":
            if rank == 0:
                fd.all_reduce(torch.ones(4), "dp", mesh=mesh)
            else:
                fd.all_gather(torch.ones(4), "dp", mesh=mesh)
        elif kind == "reduction":
            fd.all_reduce(torch.ones(4), "dp", "sum" if rank else "mean", mesh=mesh)
        elif kind == "transposed":  # same numel and ndim, different shape
            fd.all_gather(torch.ones(2, 3) if rank else torch.ones(3, 2), "dp", mesh=mesh)
        elif kind == "send_recv":
            if rank == 0:
                fd.send(torch.ones(2, 3), "dp", to=1, mesh=mesh)
            elif rank == 1:
                fd.recv(torch.ones(3, 2), "dp", from_=0, mesh=mesh)
            else:
                raise fd.CollectiveMismatchError("not involved")
        elif kind == "none":  # consistent calls pass the check
            fd.all_gather(torch.ones(2), "dp", mesh=mesh)
            fd.ppermute(torch.ones(2), "dp", [(i, (i + 1) % n) for i in range(n)], mesh=mesh)
            return "ok"
    except fd.CollectiveMismatchError as error:
        return str(error)
    finally:
        fd.set_debug(before)
    return "no error"


def test_debug_check_raises_on_every_rank_naming_shapes():
    messages = run_spmd(_mismatch_case, 2, "shape")
    for message in messages:
        assert "all_gather over axis 'dp': the 2 ranks disagree" in message
        assert "rank 0 (dp=0): all_gather of shape (2,) float32" in message
        assert "rank 1 (dp=1): all_gather of shape (3,) float32" in message
    assert messages[0] == messages[1]


@pytest.mark.parametrize(
    ("kind", "fragments"),
    [
        (
            "dtype",
            [
                "rank 3 (dp=3): all_reduce of shape (3,) float64",
                "rank 0 (dp=0): all_reduce of shape (3,) float32",
            ],
        ),
        (
            "op",
            [
                "rank 0 (dp=0): all_reduce of shape (4,) float32",
                "rank 1 (dp=1): all_gather of shape (4,) float32",
            ],
        ),
        ("reduction", ["(dp=1): all_reduce of shape (4,) float32 [different op/perm argument]"]),
        ("transposed", ["(dp=0): all_gather of shape (3, 2) float32\n", "(2, 3) float32\n"]),
    ],
)
def test_debug_check_names_dtype_op_and_argument_mismatches(kind, fragments):
    for message in run_spmd(_mismatch_case, 4, kind):
        for fragment in fragments:
            assert fragment in message


def test_debug_check_on_send_recv_and_consistent_calls():
    messages = run_spmd(_mismatch_case, 4, "send_recv")
    for message in messages[:2]:
        assert "do not match" in message
        assert "send of shape (2, 3) float32" in message
        assert "recv of shape (3, 2) float32" in message
    assert run_spmd(_mismatch_case, 4, "none") == ["ok"] * 4


def test_debug_flag_from_environment():
    assert debug.debug_from_env({"FSCALE_DEBUG": "1"})
    assert not debug.debug_from_env({"FSCALE_DEBUG": "0"})
    assert not debug.debug_from_env({})
    before = fd.debug_enabled()
    try:
        fd.set_debug(True)
        assert fd.debug_enabled()
        fd.set_debug(False)
        assert not fd.debug_enabled()
    finally:
        fd.set_debug(before)


def test_collectives_module_reexports_the_package_collectives():
    for name in collectives.__all__:
        assert getattr(collectives, name) is getattr(fd, name), name
