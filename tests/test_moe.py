"""moe_dispatch: the dense layer against a token-by-token reference, expert parallelism on 2 and
4 ranks against the dense layer (outputs and every gradient), the uneven all-to-all, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import fscale as fs
import fscale.distributed as fd
from fscale.parallel.moe import gating
from fscale.testing import run_spmd

F64 = torch.float64
D_MODEL = 6


def expert_fn(p, tokens):
    return torch.tanh(tokens @ p["w_in"] + p["b_in"]) @ p["w_out"]


def make_params(num_experts: int, seed: int, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    hidden = 5
    return {
        "gate": {"weight": torch.randn(D_MODEL, num_experts, generator=g, dtype=dtype)},
        "experts": {
            "w_in": torch.randn(num_experts, D_MODEL, hidden, generator=g, dtype=dtype),
            "b_in": torch.randn(num_experts, hidden, generator=g, dtype=dtype),
            "w_out": torch.randn(num_experts, hidden, D_MODEL, generator=g, dtype=dtype) / 3,
        },
    }


def make_tokens(count: int, seed: int, skew: bool) -> torch.Tensor:
    x = torch.randn(count, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=F64)
    if skew:  # a shared direction sends most tokens to few experts: drops and idle experts
        x = x + 3.0 * torch.ones(D_MODEL, dtype=F64)
    return x


def output_weight(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=F64)


def token_by_token(params, x, num_experts, k, factor, dropless):
    """The layer computed one token at a time, with the priority rule written as a loop."""
    logits = x.float() @ params["gate"]["weight"].float()
    routing = gating.route(logits, k)
    slots = [0] * num_experts
    cap = math.ceil(round(factor * k * x.shape[0] / num_experts, 9))
    kept = torch.zeros(x.shape[0], k, dtype=torch.bool)
    for choice in range(k):
        for s in range(x.shape[0]):
            e = int(routing.experts[s, choice])
            if dropless or slots[e] < cap:
                kept[s, choice] = True
            slots[e] += 1
    y = torch.zeros_like(x)
    for s in range(x.shape[0]):
        gates = routing.gates[s] * kept[s]
        if k == 2:
            gates = gates / gates.sum().clamp_min(torch.finfo(torch.float32).eps)
        for choice in range(k):
            if kept[s, choice]:
                e = int(routing.experts[s, choice])
                one = {name: leaf[e] for name, leaf in params["experts"].items()}
                y[s] += gates[choice].to(F64) * expert_fn(one, x[s : s + 1])[0]
    return y, kept


@pytest.mark.parametrize("capacity", ["fixed", "dropless"])
@pytest.mark.parametrize("k", [1, 2])
def test_dense_layer_equals_token_by_token_reference(capacity, k):
    params = make_params(4, seed=1)
    x = make_tokens(24, seed=2, skew=True)
    moe = fs.moe_dispatch(expert_fn, num_experts=4, k=k, capacity_factor=1.0, capacity=capacity)
    y, aux = moe(params, x)
    expected, kept = token_by_token(params, x, 4, k, 1.0, capacity == "dropless")
    torch.testing.assert_close(y, expected)
    assert int(aux["dropped_assignments"]) == int((~kept).sum())
    assert int(aux["dropped_tokens"]) == int((~kept.any(1)).sum())
    assert int(aux["tokens_per_expert"].sum()) == int(kept.sum())
    if capacity == "fixed":
        assert int(aux["dropped_assignments"]) > 0  # the skew makes the test exercise drops


def test_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 0.0  # uniform probabilities, choices spread
    uniform = gating.route(logits, 1)
    # argmax of equal logits is expert 0 for every token: f = (1, 0, 0, 0), P = 1/4 each.
    assert float(gating.balance_loss(uniform)) == pytest.approx(1.0)
    collapsed = torch.full((8, 4), -30.0)
    collapsed[:, 2] = 30.0
    assert float(gating.balance_loss(gating.route(collapsed, 1))) == pytest.approx(4.0)
    assert float(gating.z_loss(gating.route(collapsed, 1))) == pytest.approx(900.0, rel=1e-4)


def test_eval_mode_uses_eval_capacity_and_no_noise():
    params = make_params(4, seed=3)
    x = make_tokens(32, seed=4, skew=True)
    moe = fs.moe_dispatch(
        expert_fn, num_experts=4, k=2, capacity_factor=0.5, eval_capacity_factor=4.0, noisy=True
    )
    _, train_aux = moe(params, x, fs.random.key(0))
    _, eval_aux = moe(params, x, training=False)
    assert int(train_aux["dropped_assignments"]) > 0
    assert int(eval_aux["dropped_assignments"]) == 0  # factor 4 = E / k: nothing can drop
    # The noise changes second choices, and is a function of the key alone.
    y1, aux1 = moe(params, x, fs.random.key(1))
    y1_again, _ = moe(params, x, fs.random.key(1))
    torch.testing.assert_close(y1, y1_again, rtol=0, atol=0)
    quiet = fs.moe_dispatch(expert_fn, num_experts=4, k=2, capacity_factor=0.5)
    _, quiet_aux = quiet(params, x)
    assert not torch.equal(aux1["tokens_per_expert"], quiet_aux["tokens_per_expert"])


def test_aux_loss_gradient_reaches_the_gate_and_z_loss_is_weighted():
    params = make_params(4, seed=5)
    gate = params["gate"]["weight"].requires_grad_()
    moe = fs.moe_dispatch(expert_fn, num_experts=4, aux_loss_weight=0.5, z_loss_weight=0.25)
    _, aux = moe(params, make_tokens(16, seed=6, skew=False))
    expected = 0.5 * aux["balance_loss"] + 0.25 * aux["z_loss"]
    torch.testing.assert_close(aux["aux_loss"].detach(), expected)
    (grad,) = torch.autograd.grad(aux["aux_loss"], gate)
    assert grad.abs().sum() > 0


# ---- expert parallel against the dense layer ----------------------------------------------


def _local_experts(params, rank, world):
    local = params["gate"]["weight"].shape[1] // world
    return {
        "gate": params["gate"],
        "experts": {
            n: leaf[rank * local : (rank + 1) * local] for n, leaf in params["experts"].items()
        },
    }


def _loss(moe, params, x, weight, key=None):
    y, aux = moe(params, x, key)
    return (y * weight).sum() + aux["aux_loss"], y, aux


def _ep_case(num_experts, k, capacity, factor, counts, skew, seed, noisy=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(ep=world)
    full = make_params(num_experts, seed)
    params = _local_experts(full, rank, world)
    leaves = [params["gate"]["weight"], *params["experts"].values()]
    params = {
        "gate": {"weight": leaves[0].clone().requires_grad_()},
        "experts": {n: leaf.clone().requires_grad_() for n, leaf in params["experts"].items()},
    }
    moe = fs.moe_dispatch(
        expert_fn,
        mesh,
        num_experts=num_experts,
        k=k,
        capacity=capacity,
        capacity_factor=factor,
        noisy=noisy,
    )
    x = make_tokens(counts[rank], seed + 100 + rank, skew).requires_grad_()
    with fd.comm_ledger() as ledger:
        weight = output_weight(counts[rank], seed + 200 + rank)
        loss, y, aux = _loss(moe, params, x, weight, fs.random.key(seed + rank))
        x_grad, *grads = torch.autograd.grad(
            loss, [x, params["gate"]["weight"], *params["experts"].values()]
        )
    gate_grad = fd.all_reduce(
        grads[0], "ep", mesh=mesh
    )  # the gate is replicated: sum the ranks' parts
    expert_grads = [fd.all_gather(g, "ep", dim=0, mesh=mesh) for g in grads[1:]]
    a2a = (ledger.count("all_to_all"), ledger.total_bytes("all_to_all"))
    return y, x_grad, aux["tokens_per_expert"], gate_grad, expert_grads, a2a


def _dense_reference(num_experts, k, capacity, factor, counts, skew, seed, noisy=False):
    params = make_params(num_experts, seed)
    leaves = [params["gate"]["weight"], *params["experts"].values()]
    for leaf in leaves:
        leaf.requires_grad_()
    moe = fs.moe_dispatch(
        expert_fn,
        num_experts=num_experts,
        k=k,
        capacity=capacity,
        capacity_factor=factor,
        noisy=noisy,
    )
    outputs, inputs, tokens_per_expert, total = [], [], [], 0.0
    for rank, count in enumerate(counts):
        x = make_tokens(count, seed + 100 + rank, skew).requires_grad_()
        weight = output_weight(count, seed + 200 + rank)
        loss, y, aux = _loss(moe, params, x, weight, fs.random.key(seed + rank))
        total = total + loss
        outputs.append(y.detach())
        inputs.append(x)
        tokens_per_expert.append(aux["tokens_per_expert"])
    all_grads = torch.autograd.grad(total, [*inputs, *leaves])
    return outputs, all_grads[: len(inputs)], tokens_per_expert, all_grads[len(inputs) :]


@st.composite
def ep_cases(draw, world):
    per_rank = draw(st.sampled_from([1, 2]))
    num_experts = world * per_rank
    k = draw(st.sampled_from([1, 2] if num_experts >= 2 else [1]))
    capacity = draw(st.sampled_from(["fixed", "dropless"]))
    factor = draw(st.sampled_from([0.5, 1.0, 1.25]))
    equal = draw(st.booleans())
    first = draw(st.integers(1, 12))
    counts = [first] * world if equal else [draw(st.integers(0, 12)) for _ in range(world)]
    if sum(counts) == 0:
        counts[0] = 3
    skew = draw(st.booleans())
    seed = draw(st.integers(0, 999))
    return num_experts, k, capacity, factor, tuple(counts), skew, seed, draw(st.booleans())


def _check_against_dense(case, world):
    results = run_spmd(_ep_case, world, *case)
    outputs, x_grads, tokens_per_expert, grads = _dense_reference(*case)
    for rank, (y, x_grad, tpe, gate_grad, expert_grads, a2a) in enumerate(results):
        torch.testing.assert_close(y, outputs[rank], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(x_grad, x_grads[rank], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(tpe, tokens_per_expert[rank], rtol=0, atol=0)
        torch.testing.assert_close(gate_grad, grads[0], rtol=1e-9, atol=1e-11)
        for got, want in zip(expert_grads, grads[1:]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        assert a2a[0] == 4  # two exchanges forward, their two duals backward
        num_experts, k, capacity, factor, counts = case[:5]
        if capacity == "fixed":  # (E, C, d) float64 slots, C the largest capacity of the ranks
            slots = max(math.ceil(round(factor * k * n / num_experts, 9)) for n in counts)
            assert a2a[1] == 4 * num_experts * slots * D_MODEL * 8 * (world - 1) / world


@given(ep_cases(world=2))
def test_expert_parallel_equals_dense_on_2_ranks(case):
    _check_against_dense(case, 2)


@given(ep_cases(world=4))
def test_expert_parallel_equals_dense_on_4_ranks(case):
    _check_against_dense(case, 4)


def test_expert_with_no_token_and_rank_with_no_token():
    # Rank 1 has no token; the skew leaves some experts idle; both modes, top-2.
    for capacity in ("fixed", "dropless"):
        case = (4, 2, capacity, 1.0, (9, 0), True, 7, False)
        _, _, tokens_per_expert, _ = _dense_reference(*case)
        assert (tokens_per_expert[0] == 0).any()
        _check_against_dense(case, 2)


# ---- the uneven all-to-all ------------------------------------------------------------------


def _sizes_between(source: int, dest: int) -> int:
    return (3 * source + 2 * dest + 1) % 4  # zeros included


def _uneven_case():
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(ep=n)
    send = [_sizes_between(rank, j) for j in range(n)]
    recv = [_sizes_between(i, rank) for i in range(n)]
    x = (torch.arange(sum(send) * 2, dtype=F64).view(-1, 2) + 100 * rank).requires_grad_()
    with fd.comm_ledger() as ledger:
        y = fd.all_to_all_uneven(x, "ep", send, recv, mesh=mesh)
        weight = torch.arange(y.numel(), dtype=F64).view_as(y) + 1000 * rank
        (grad,) = torch.autograd.grad((y * weight).sum(), x)
    return x.detach(), y.detach(), grad, send, recv, [r.bytes for r in ledger.records]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_uneven_moves_rows_and_backward_is_the_reverse_exchange(world):
    results = run_spmd(_uneven_case, world)
    inputs = [r[0] for r in results]
    chunks = [torch.split(x, r[3]) for x, r in zip(inputs, results)]
    for rank, (_, y, grad, send, recv, record_bytes) in enumerate(results):
        torch.testing.assert_close(y, torch.cat([chunks[i][rank] for i in range(world)]))
        # The gradient of row block j is rank j's weight for the rows it received from us.
        weights = [
            (torch.arange(r[1].numel(), dtype=F64).view_as(r[1]) + 1000 * j).split(r[4])[rank]
            for j, r in enumerate(results)
        ]
        torch.testing.assert_close(grad, torch.cat(weights))
        # Forward sends our rows to the others; backward sends back the rows we received.
        sent_forward = (sum(send) - send[rank]) * 2 * 8
        sent_backward = (sum(recv) - recv[rank]) * 2 * 8
        assert record_bytes == [sent_forward, sent_backward]


def _uneven_bad_sizes_case():
    mesh = fd.Mesh(ep=dist.get_world_size())
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"`send_sizes`.*sum to 2"):
        fd.all_to_all_uneven(x, "ep", [1, 1], [1, 1], mesh=mesh)
    with pytest.raises(ValueError, match="`recv_sizes` must hold 2"):
        fd.all_to_all_uneven(x, "ep", [1, 2], [1], mesh=mesh)
    with pytest.raises(ValueError, match="non-negative"):
        fd.all_to_all_uneven(x, "ep", [4, -1], [1, 1], mesh=mesh)


def test_all_to_all_uneven_bad_sizes():
    run_spmd(_uneven_bad_sizes_case, 2)


def test_all_to_all_uneven_on_one_process_is_identity():
    x = torch.randn(3, 2)
    assert fd.all_to_all_uneven(x, "ep", [3], [3], mesh=fd.Mesh(ep=1)) is x


# ---- bad input ----------------------------------------------------------------------------


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match="`k`=2 experts per token is more than `num_experts`=1"):
        fs.moe_dispatch(expert_fn, num_experts=1, k=2)
    with pytest.raises(ValueError, match="`k` must be 1"):
        fs.moe_dispatch(expert_fn, num_experts=4, k=3)
    with pytest.raises(ValueError, match="`capacity_factor` must be > 0"):
        fs.moe_dispatch(expert_fn, num_experts=4, capacity_factor=0)
    with pytest.raises(ValueError, match="`eval_capacity_factor` must be > 0"):
        fs.moe_dispatch(expert_fn, num_experts=4, eval_capacity_factor=0.0)
    with pytest.raises(ValueError, match="`capacity` must be one of"):
        fs.moe_dispatch(expert_fn, num_experts=4, capacity="unbounded")
    with pytest.raises(ValueError, match="`num_experts` must be a positive int"):
        fs.moe_dispatch(expert_fn, num_experts=0)
    with pytest.raises(ValueError, match="`axis`='tp' is not an axis"):
        fs.moe_dispatch(expert_fn, fd.Mesh(ep=1), "tp", num_experts=4)


def _indivisible_case():
    with pytest.raises(ValueError, match="`num_experts`=3 is not divisible by the 2 ranks"):
        fs.moe_dispatch(expert_fn, fd.Mesh(ep=2), num_experts=3)


def test_num_experts_not_divisible_by_the_axis():
    run_spmd(_indivisible_case, 2)


def test_bad_call_arguments():
    moe = fs.moe_dispatch(expert_fn, num_experts=4)
    params = make_params(4, seed=0)
    with pytest.raises(ValueError, match=r"`x` must be a floating-point tensor of shape \(tokens"):
        moe(params, torch.zeros(2, 3, D_MODEL))
    with pytest.raises(ValueError, match=r"`params\['gate'\]\['weight'\]` must be .* \(6, 4\)"):
        moe(
            {"gate": {"weight": torch.zeros(D_MODEL, 3)}, "experts": params["experts"]},
            torch.zeros(2, D_MODEL),
        )
    with pytest.raises(ValueError, match="leaf `w_in` has shape"):
        moe(
            {"gate": params["gate"], "experts": {"w_in": torch.zeros(3, 2)}},
            torch.zeros(2, D_MODEL, dtype=F64),
        )
    with pytest.raises(ValueError, match="`params` must be"):
        moe({"experts": params["experts"]}, torch.zeros(2, D_MODEL))


def _nan_gate_case():
    rank = dist.get_rank()
    mesh = fd.Mesh(ep=2)
    moe = fs.moe_dispatch(expert_fn, mesh, num_experts=2)
    params = _local_experts(make_params(2, seed=0), rank, 2)
    x = make_tokens(4, seed=rank, skew=False)
    if rank == 1:
        x[2, 0] = float("nan")
    # Every rank raises (the flag travels with the sizes), so none is left waiting.
    with pytest.raises(ValueError, match=r"not finite \(NaN or inf\) on rank\(s\) \[1\]"):
        moe(params, x)
    return True


def test_nan_gate_fails_on_every_rank():
    assert run_spmd(_nan_gate_case, 2) == [True, True]
    moe = fs.moe_dispatch(expert_fn, num_experts=2)
    with pytest.raises(ValueError, match="not finite"):
        moe(make_params(2, seed=0), torch.full((2, D_MODEL), float("inf"), dtype=F64))


@pytest.mark.parametrize("capacity", ["fixed", "dropless"])
def test_dense_layer_under_torch_func_grad_equals_autograd(capacity):
    params = make_params(4, seed=8)
    x = make_tokens(12, seed=9, skew=True)
    moe = fs.moe_dispatch(expert_fn, num_experts=4, k=2, capacity=capacity)

    def loss(p):
        y, aux = moe(p, x)
        return (y**2).sum() + aux["aux_loss"]

    by_func = fs.tree.leaves(torch.func.grad(loss)(params))
    live = fs.tree.map(lambda leaf: leaf.clone().requires_grad_(), params)
    by_autograd = torch.autograd.grad(loss(live), fs.tree.leaves(live))
    for a, b in zip(by_func, by_autograd):
        torch.testing.assert_close(a, b)
