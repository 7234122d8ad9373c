"""`broadcast` on real gloo ranks: forward, reduce-to-source backward, ledger, debug, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.distributed.ledger import ring_bytes
from fscale.testing.pool import run_spmd

F64 = torch.float64
WORLD_SIZES = [2, 4]
SHAPE = (2, 3)


def _value(rank: int) -> torch.Tensor:
    return (torch.arange(6, dtype=F64) + 10.0 * rank).reshape(SHAPE) / 7.0


def _weight(rank: int) -> torch.Tensor:
    return torch.cos(torch.arange(6, dtype=F64) * 0.7 + rank).reshape(SHAPE)


def _broadcast_case(src: int) -> dict[str, object]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    x = _value(rank)

    def loss(v):  # each rank its own loss of the broadcast value
        return (fd.broadcast(v, "dp", src, mesh=mesh) * _weight(rank)).sum()

    with fd.comm_ledger() as forward_ledger:
        y = fd.broadcast(x, "dp", src, mesh=mesh)
    leaf = x.clone().requires_grad_()
    out = loss(leaf)
    with fd.comm_ledger() as backward_ledger:
        (by_autograd,) = torch.autograd.grad(out, leaf)
    by_func_grad = torch.func.grad(loss)(x)
    value, vjp_fn = torch.func.vjp(loss, x)
    (by_vjp,) = vjp_fn(torch.ones_like(value))
    return {
        "y": y,
        "x_unchanged": torch.equal(x, _value(rank)),
        "grads": [by_autograd, by_func_grad, by_vjp],
        "forward": [(r.op, r.numel, r.bytes) for r in forward_ledger.records],
        "backward": [(r.op, r.numel, r.bytes) for r in backward_ledger.records],
    }


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("where", ["first", "last"])
def test_broadcast_forward_gradient_and_ledger(world, where):
    src = 0 if where == "first" else world - 1
    results = run_spmd(_broadcast_case, world, src)
    # Single-process reference: y_r = x_src for all r, loss = sum_r <y_r, w_r>.
    reference_x = _value(src).requires_grad_()
    total = sum((reference_x * _weight(r)).sum() for r in range(world))
    (reference_grad,) = torch.autograd.grad(total, reference_x)
    wire = ring_bytes("broadcast", 6, F64, world)
    assert wire == (world - 1) * 6 * 8 / world
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["y"], _value(src), rtol=0, atol=0)
        assert result["x_unchanged"]
        expected = reference_grad if rank == src else torch.zeros(SHAPE, dtype=F64)
        for path, grad in zip(["autograd", "func.grad", "func.vjp"], result["grads"]):
            torch.testing.assert_close(grad, expected, msg=lambda m, p=path: f"{p}: {m}")
        assert result["forward"] == [("broadcast", 6, wire)]
        assert result["backward"] == [("reduce", 6, ring_bytes("reduce", 6, F64, world))]


def _second_order_case() -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    x = _value(rank).requires_grad_()
    loss = (fd.broadcast(x, "dp", 1, mesh=mesh) ** 3 * _weight(rank)).sum()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (second,) = torch.autograd.grad((grad * _weight(0)).sum(), x)
    return second


def test_broadcast_second_order_gradient():
    n = 2
    results = run_spmd(_second_order_case, n)
    # g_1(x1) = 3 x1^2 * sum_r w_r on the source; d/dx1 <g_1, w_0> = 6 x1 * sum_r w_r * w_0.
    x1 = _value(1)
    expected = 6 * x1 * sum(_weight(r) for r in range(n)) * _weight(0)
    torch.testing.assert_close(results[1], expected)
    torch.testing.assert_close(results[0], torch.zeros(SHAPE, dtype=F64))


def _bad_src(src) -> str:
    mesh = fd.Mesh(dp=dist.get_world_size())
    try:
        fd.broadcast(torch.ones(2), "dp", src, mesh=mesh)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_bad_src_gets_a_clear_error_on_every_rank():
    for message in run_spmd(_bad_src, 2, 2):
        assert message.startswith("ValueError: broadcast: `src`=2 is out of range for axis 'dp'")
        assert "of size 2" in message
    for message in run_spmd(_bad_src, 2, -1):
        assert "`src`=-1 is out of range" in message
    for message in run_spmd(_bad_src, 2, 1.0):
        assert message == "TypeError: broadcast: `src` must be an int index along the axis, got 1.0"
    for message in run_spmd(_bad_src, 2, True):
        assert message.startswith("TypeError: broadcast: `src` must be an int")


def test_broadcast_argument_errors_and_size_one_axis():
    mesh = fd.Mesh(dp=1)
    x = torch.ones(3)
    with mesh, fd.comm_ledger() as ledger:
        assert fd.broadcast(x, "dp") is x
    assert ledger.records == []
    with pytest.raises(ValueError, match=r"`src`=1 is out of range for axis 'dp' of size 1"):
        fd.broadcast(x, "dp", 1, mesh=mesh)
    with pytest.raises(TypeError, match=r"broadcast: `src` must be an int index"):
        fd.broadcast(x, "dp", "0", mesh=mesh)
    with pytest.raises(TypeError, match=r"broadcast: `x` must be a torch.Tensor, got list"):
        fd.broadcast([1.0], "dp", mesh=mesh)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tp'"):
        fd.broadcast(x, "tp", mesh=mesh)


def _mismatch_case(kind: str) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    before = fd.debug_enabled()
    fd.set_debug(True)
    try:
        if kind == "src":
            fd.broadcast(torch.ones(4), "dp", rank % 2, mesh=mesh)
        elif kind == "shape":
            fd.broadcast(torch.ones(2 + rank), "dp", 0, mesh=mesh)
        else:
            fd.broadcast(torch.ones(4), "dp", 0, mesh=mesh)
            return "ok"
    except fd.CollectiveMismatchError as error:
        return str(error)
    finally:
        fd.set_debug(before)
    return "no error"


def test_debug_check_compares_src_and_shape():
    for message in run_spmd(_mismatch_case, 2, "src"):
        assert "broadcast over axis 'dp': the 2 ranks disagree" in message
        assert "broadcast of shape (4,) float32 [different op/perm argument]" in message
    for message in run_spmd(_mismatch_case, 2, "shape"):
        assert "rank 1 (dp=1): broadcast of shape (3,) float32" in message
    assert run_spmd(_mismatch_case, 2, "none") == ["ok", "ok"]


def test_ring_bytes_of_broadcast_and_reduce():
    assert ring_bytes("broadcast", 10, torch.float32, 4) == 3 * 40 / 4
    assert ring_bytes("reduce", 10, torch.float32, 4) == 3 * 40 / 4
    assert ring_bytes("broadcast", 1, torch.float64, 3) == pytest.approx(16 / 3)
