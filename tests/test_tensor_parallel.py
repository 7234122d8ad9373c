"""Tensor-parallel layers, region boundaries, the vocab-parallel loss and dropout, on gloo ranks.

Each rank's result is compared with the dense computation done in the same process: outputs,
and gradients (this rank's slice of the dense gradient for a split tensor, the dense gradient
for a replicated one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fscale as fs
from fscale.parallel import tensor as tpl
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

F64 = dict(rtol=1e-12, atol=1e-12)


def _mesh():
    return fs.Mesh(tp=dist.get_world_size())


def _rank_slice(t, dim):
    n, r = dist.get_world_size(), dist.get_rank()
    return t.chunk(n, dim)[r]


# ------------------------------------------------------------------------- linear layers


def _mlp_parallel(seed, bias):
    mesh = _mesh()
    g = torch.Generator().manual_seed(seed)
    dense = nn.Sequential(nn.Linear(6, 8, bias=bias), nn.GELU(), nn.Linear(8, 5, bias=bias))
    dense = dense.double()
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    model = tpl.tensor_parallel(dense, mesh, "tp", {"0": "colwise", "2": "rowwise"})
    x = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    x_tp = x.detach().clone().requires_grad_()
    (dense(x) ** 2).sum().backward()
    out = model(x_tp)
    (out**2).sum().backward()
    expected = tpl.shard_like({n: p.grad for n, p in dense.named_parameters()}, model)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), dense(x).detach(), grads, expected, x_tp.grad, x.grad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_column_then_row_parallel_linear_equal_the_dense_layers(world, bias):
    for out, dense_out, grads, expected, x_grad, dense_x_grad in run_spmd(
        _mlp_parallel, world, 7, bias
    ):
        assert_trees_close(out, dense_out, **F64)
        assert_trees_close(grads, expected, **F64)
        assert_trees_close(x_grad, dense_x_grad, **F64)


def _gathered_colwise(parts):
    mesh = _mesh()
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(4, 8 * parts)).double()
    model = tpl.tensor_parallel(
        dense, mesh, "tp", {"0": tpl.Colwise(parts=parts, gather_output=True)}
    )
    x = torch.randn(5, 4, dtype=torch.float64)
    weights = torch.arange(8.0 * parts, dtype=torch.float64)
    (dense(x) * weights).sum().backward()
    out = model(x)
    (out * weights).sum().backward()
    expected = tpl.shard_like({n: p.grad for n, p in dense.named_parameters()}, model)
    return (
        out.detach(),
        dense(x).detach(),
        {n: p.grad for n, p in model.named_parameters()},
        expected,
    )


@pytest.mark.parametrize("parts", [1, 3])
def test_gathered_column_output_is_the_dense_output_in_dense_order(parts):
    for out, dense_out, grads, expected in run_spmd(_gathered_colwise, 2, parts):
        assert_trees_close(out, dense_out, **F64)
        assert_trees_close(grads, expected, **F64)


def test_shard_tensor_takes_each_blocks_chunk():
    dense = torch.arange(12).reshape(6, 2)
    assert_trees_equal(tpl.shard_tensor(dense, tpl.Split(0, 3), 2, 1), dense[[1, 3, 5]])
    assert_trees_equal(tpl.shard_tensor(dense, tpl.Split(1), 2, 0), dense[:, :1])


# ------------------------------------------------------------------------- embedding and loss


def _vocab_embedding(padding_idx):
    mesh = _mesh()
    dense = nn.Embedding(16, 3, padding_idx=padding_idx)
    model = tpl.tensor_parallel(nn.Sequential(dense), mesh, "tp", {"0": "vocab"})
    ids = torch.tensor([[0, 5, 15, 8], [3, 3, 12, 1]])
    weights = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))
    (dense(ids) * weights).sum().backward()
    out = model(ids)
    (out * weights).sum().backward()
    return (
        out.detach(),
        dense(ids).detach(),
        model[0].weight.grad,
        _rank_slice(dense.weight.grad, 0),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("padding_idx", [None, 5])
def test_vocab_parallel_embedding_is_bit_exact(world, padding_idx):
    for out, dense_out, grad, expected in run_spmd(_vocab_embedding, world, padding_idx):
        assert_trees_equal(out, dense_out)
        assert_trees_equal(grad, expected)


def _cross_entropy(rows, vocab, offset, seed):
    mesh = _mesh()
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, 2, vocab, generator=g, dtype=torch.float64) + offset) * 3
    targets = torch.randint(0, vocab, (rows, 2), generator=g)
    targets[0, 0] = -100
    logits.requires_grad_()
    dense = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    dense.backward()
    shard = _rank_slice(logits.detach(), -1).clone().requires_grad_()
    before = shard.detach().clone()
    loss = tpl.vocab_parallel_cross_entropy(shard, targets, "tp", mesh=mesh)
    loss.backward()
    return (
        loss.detach(),
        dense.detach(),
        shard.grad,
        _rank_slice(logits.grad, -1),
        shard.detach(),
        before,
    )


@given(
    rows=st.integers(1, 4),
    vocab_per_rank=st.integers(1, 5),
    offset=st.sampled_from([0.0, 1e4, -1e4]),
    world=st.sampled_from([2, 4]),
    seed=st.integers(0, 100),
)
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(
    rows, vocab_per_rank, offset, world, seed
):
    vocab = vocab_per_rank * world
    for loss, dense, grad, expected, after, before in run_spmd(
        _cross_entropy, world, rows, vocab, offset, seed
    ):
        assert_trees_close(loss, dense, rtol=1e-12, atol=1e-12)
        assert_trees_close(grad, expected, rtol=1e-10, atol=1e-14)
        assert_trees_equal(after, before)  # the logits are not modified in place


def test_vocab_parallel_cross_entropy_checks_its_input():
    mesh = fs.Mesh(tp=1)
    with pytest.raises(ValueError, match="`targets` must be in"):
        tpl.vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 3]), "tp", mesh=mesh)
    with pytest.raises(ValueError, match="expected `logits`"):
        tpl.vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.tensor([0]), "tp", mesh=mesh)
    with pytest.raises(TypeError, match="integer ids"):
        tpl.vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2), "tp", mesh=mesh)


# ------------------------------------------------------------------------- region boundaries


def _regions():
    mesh = _mesh()
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.arange(4.0 * n, dtype=torch.float64).reshape(2, 2 * n)
    weights = torch.linspace(-1, 1, 4 * n, dtype=torch.float64).reshape(2, 2 * n)
    shard = _rank_slice(full, 1).clone().requires_grad_()
    gathered = tpl.gather_replicated(shard, "tp", 1, mesh=mesh)
    (gathered * weights).sum().backward()
    replicated = full.clone().requires_grad_()
    split = tpl.split_replicated(replicated, "tp", 1, mesh=mesh)
    # Each rank's loss is its own slice's: the replicated value's gradient sums all of them.
    (split * _rank_slice(weights, 1)).sum().backward()
    maximum = tpl.all_reduce_max(torch.tensor([float(r), -float(r)]), "tp", mesh=mesh)
    return gathered.detach(), shard.grad, split.detach(), replicated.grad, maximum, full, weights


@pytest.mark.parametrize("world", [2, 4])
def test_region_boundaries_and_their_duals(world):
    for rank, (gathered, shard_grad, split, replicated_grad, maximum, full, weights) in enumerate(
        run_spmd(_regions, world)
    ):
        assert_trees_equal(gathered, full)
        assert_trees_equal(shard_grad, weights.chunk(world, 1)[rank])
        assert_trees_equal(split, full.chunk(world, 1)[rank])
        assert_trees_equal(replicated_grad, weights)
        assert_trees_equal(maximum, torch.tensor([world - 1.0, 0.0]))


# ------------------------------------------------------------------------- dropout


def _dropout_masks():
    mesh = _mesh()
    tp = tpl.TensorAxis(mesh, "tp")
    dropout = tpl.TensorParallelDropout(0.5, tp)
    outside = nn.Dropout(0.5)
    x = torch.ones(64)
    torch.manual_seed(11)
    first = dropout(x)
    after = outside(x)  # drawn after the per-rank mask: the same on every rank
    torch.manual_seed(11)
    replay = dropout(x)
    return first, replay, after


def test_dropout_inside_a_region_differs_per_rank_and_replays():
    (a, a_replay, a_after), (b, b_replay, b_after) = run_spmd(_dropout_masks, 2)
    assert_trees_equal(a, a_replay)
    assert_trees_equal(b, b_replay)
    assert not torch.equal(a, b)
    assert_trees_equal(a_after, b_after)
    assert set(a.unique().tolist()) <= {0.0, 2.0}


def test_dropout_checks_p_and_is_identity_in_eval():
    tp = tpl.TensorAxis(fs.Mesh(tp=1), "tp")
    with pytest.raises(ValueError, match="`p` must be in"):
        tpl.TensorParallelDropout(1.0, tp)
    x = torch.ones(4)
    assert tpl.TensorParallelDropout(0.5, tp).eval()(x) is x


# ------------------------------------------------------------------------- bad input


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def _bad_plans():
    mesh = _mesh()
    cfg = fs.models.GPTConfig(vocab_size=32, seq_len=8, d_model=12, n_heads=3, n_layers=1)
    gpt = fs.models.GPT(cfg)
    cases = {
        "indivisible": (nn.Sequential(nn.Linear(4, 5)), {"0": "colwise"}),
        "indivisible_rows": (nn.Sequential(nn.Linear(5, 4)), {"0": "rowwise"}),
        "heads": (gpt, tpl.gpt_plan()),
        "tied": (_Tied(), {"embed": "vocab", "head": "rowwise"}),
        "tied_whole": (_Tied(), {"embed": "vocab"}),
    }
    return {name: _refusal(module, mesh, plan) for name, (module, plan) in cases.items()}


def _refusal(module, mesh, plan):
    try:
        tpl.tensor_parallel(module, mesh, "tp", plan)
    except (ValueError, TypeError) as error:
        return str(error)
    return "accepted"


def test_bad_plans_are_refused_with_the_reason():
    messages = run_spmd(_bad_plans, 2)[0]
    assert "out_features=5 of module `0`" in messages["indivisible"]
    assert "in_features=5 of module `0` does not divide" in messages["indivisible_rows"]
    assert "3 attention heads" in messages["heads"]
    assert "tied weight is split in incompatible ways" in messages["tied"]
    assert "`head.weight` split along dim 1" in messages["tied"]
    assert "`head.weight` whole" in messages["tied_whole"]


def test_plan_errors_in_one_process():
    mesh = fs.Mesh(tp=1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\*' matches no module"):
        tpl.tensor_parallel(model, mesh, "tp", {"blocks.*": "colwise"})
    with pytest.raises(TypeError, match="style 'colwise' applies to an Linear, but module `1`"):
        tpl.tensor_parallel(model, mesh, "tp", {"1": "colwise"})
    with pytest.raises(ValueError, match="plan entry '0' must be one of"):
        tpl.tensor_parallel(model, mesh, "tp", {"0": "columnwise"})
    with pytest.raises(ValueError, match="matched by both"):
        tpl.tensor_parallel(model, mesh, "tp", {"0": "colwise", "*": "replicate"})
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        tpl.tensor_parallel(model, mesh, "mp", {"0": "colwise"})
    with pytest.raises(ValueError, match="non-empty mapping"):
        tpl.tensor_parallel(model, mesh, "tp", {})
    with pytest.raises(TypeError, match=r"`module` must be a torch\.nn\.Module"):
        tpl.tensor_parallel("model", mesh, "tp", {"0": "colwise"})
    with pytest.raises(ValueError, match="`input` must be one of"):
        tpl.Colwise(input="full")
    with pytest.raises(TypeError, match="returned by tensor_parallel"):
        tpl.shard_like({}, model)


def test_a_one_rank_axis_keeps_the_dense_model():
    cfg = fs.models.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1)
    dense = fs.models.GPT(cfg, seed=2)
    model = tpl.tensor_parallel(dense, fs.Mesh(tp=1), "tp", tpl.gpt_plan())
    tokens = torch.randint(0, 32, (2, 8))
    assert_trees_equal(dict(model.named_parameters()), dict(dense.named_parameters()))
    assert_trees_close(model(tokens), dense(tokens), rtol=1e-6, atol=1e-6)
    assert model.lm_head.weight is model.embed.token.weight
    assert dense.blocks[0].attn.n_heads == 4  # the dense model is left as it was


def _sequence_round_trip():
    mesh = _mesh()
    torch.manual_seed(5)
    dense = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2)).double()
    with torch.no_grad():
        dense[0].weight.uniform_(0.5, 1.5)
    plan = {"0": (tpl.Input("split"), "sequence", tpl.Output("gather"))}
    model = tpl.tensor_parallel(dense, mesh, "tp", plan)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    (dense(x) ** 2).sum().backward()
    out = model(x)
    (out**2).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), dense(x).detach(), grads, {n: p.grad for n, p in dense.named_parameters()}


def test_a_sequence_sharded_norm_between_split_and_gather_equals_the_dense_norm():
    for out, dense_out, grads, expected in run_spmd(_sequence_round_trip, 2):
        assert_trees_close(out, dense_out, **F64)
        assert_trees_close(grads, expected, **F64)
