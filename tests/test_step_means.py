"""Means begun after the forward: the same bits as at the step's end, travelling during backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale import grad, spmd, step_means
from fscale.distributed import collectives
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

BATCH = 8


def _batch(case, index, rank, world):
    return fs.data.split_batch(case.batch(BATCH, seed=index), rank, world)


def _cnn_steps(strategy, early, micro_batches=1):
    """Two steps of a CNN with BatchNorm; the ledger of the second; with the means begun after
    the forward (`early`) or all at the step's end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("cnn", width=4, depth=1)
    apply, params, buffers = fs.functionalize(case.module())

    def loss_fn(params, buffers, batch, key):
        loss, new_buffers = case.loss_fn(apply)(params, buffers, batch, key)
        return loss, new_buffers, {"half": loss.detach() / 2}

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2), donate=True)
    mesh = fs.Mesh(dp=world)
    step = {"ddp": fs.data_parallel, "zero": fs.shard_optimizer, "fsdp": fs.fully_shard}[strategy](
        step, mesh
    )
    if micro_batches > 1:
        step = fs.accumulate(step, micro_batches)
    state = step.init(params, buffers)
    original = grad._step_means
    if not early:  # as under torch.compile: every mean at the step's end
        grad._step_means = lambda ctx, grad_mode, session: None
    try:
        state, _ = step(state, _batch(case, 0, rank, world))
        with fs.distributed.comm_ledger() as ledger:
            state, metrics = step(state, _batch(case, 1, rank, world))
    finally:
        grad._step_means = original
    floating = sum(b.numel() for b in fs.tree.leaves(buffers) if b.is_floating_point())
    records = [(r.op, r.numel) for r in ledger.records]
    return fs.consolidate(step, state), metrics, records, floating


def _reductions(ledger):
    """The ledger without fully_shard's parameter gathers (in forward and backward alike)."""
    return [record for record in ledger if record[0] != "all_gather"]


def _both(strategy, micro_batches=1):
    return _cnn_steps(strategy, True, micro_batches), _cnn_steps(strategy, False, micro_batches)


@pytest.mark.parametrize(
    ("strategy", "world"),
    [("ddp", 2), ("zero", 2), ("fsdp", 2), ("ddp", 4), ("zero", 4), ("fsdp", 4)],
)
def test_means_begun_after_the_forward_equal_the_end_of_step_means(strategy, world):
    results = run_spmd(_both, world, strategy)
    folded = strategy != "fsdp"  # data_parallel and shard_optimizer take them into a bucket
    for (state, metrics, ledger, floating), (late_state, late_metrics, late_ledger, _) in results:
        # grad_bytes counts the scalars riding in the last bucket; grad_peak_bytes samples what
        # is alive, which depends on when gloo ends each collective.
        for name in ("grad_bytes", "grad_peak_bytes"):
            metrics.pop(name, None), late_metrics.pop(name, None)
        if world == 2 or not folded:
            assert_trees_equal(state, late_state)  # buffers, params, optimizer state: every bit
            assert_trees_equal(metrics, late_metrics)
        else:
            # Over four ranks the riding means are summed in the order of their place in the
            # last bucket, and the bucket, longer by them, adds some gradients in another order
            # (gloo's ring cuts it by length): last bits only.
            assert_trees_close(state, late_state, rtol=1e-5, atol=1e-8)
            assert_trees_close(metrics, late_metrics, rtol=1e-6, atol=0.0)
        # The same collectives, but the means move from after the update to before the
        # backward's gradient collectives. data_parallel's and shard_optimizer's metrics and
        # buffer means ride in their last gradient bucket instead, in one collective (the ledger
        # records them after it).
        buffer_mean = ("all_reduce", floating)  # the BatchNorms' running means and variances
        metric_mean = ("all_reduce", 2)  # the loss and "half"
        means = [] if folded else [metric_mean, buffer_mean]
        ledger, late_ledger = _reductions(ledger), _reductions(late_ledger)
        assert ledger[: len(means)] == means
        assert late_ledger[-2:] == [buffer_mean, metric_mean]
        gradients, late_gradients = ledger[len(means) :], late_ledger[:-2]
        riding = [("all_reduce", 2 + floating)] if folded else []
        assert gradients == late_gradients + riding
    # Every rank ends with the same bits: the state and every mean (a riding mean included).
    for state, metrics, *_ in results[1:]:
        assert_trees_equal(state, results[0][0])
        assert_trees_equal(metrics, results[0][1])


@pytest.mark.parametrize("world", [2, 4])
def test_accumulated_metrics_are_averaged_at_the_end(world):
    # The loss of an accumulated step is the mean over its micro-batches, known only at the end;
    # the last micro-batch's buffers are the step's, and their mean is begun early (in the last
    # gradient bucket, alone).
    for (state, metrics, ledger, floating), (late_state, late_metrics, *_) in run_spmd(
        _both, world, "ddp", 2
    ):
        for name in ("grad_bytes", "grad_peak_bytes"):  # as above: the riding buffers count
            metrics.pop(name, None), late_metrics.pop(name, None)
        if world == 2:
            assert_trees_equal(state, late_state)
            assert_trees_equal(metrics, late_metrics)  # the loss: averaged at the end in both
        else:
            # The riding buffers lengthen the last bucket (see the test above): the first
            # step's update differs in the last bits, and so may the second step's loss.
            assert_trees_close(state, late_state, rtol=1e-5, atol=1e-8)
            assert_trees_close(metrics, late_metrics, rtol=1e-6, atol=0.0)
        assert ledger[-1] == ("all_reduce", 2)
        assert ledger.count(("all_reduce", floating)) == 1


def _started_means():
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.Mesh(a=2, b=world // 2)
    flat = torch.arange(6, dtype=torch.float32) * (rank + 1) / 3
    started = spmd.StartedMean(flat.clone(), ("a", "b"), mesh)
    by_collective = collectives.all_reduce(flat.clone(), ("a", "b"), "mean", mesh=mesh)
    first, second = started.wait(), started.wait()
    tree = {"x": flat.clone(), "n": torch.tensor([rank]), "h": flat[:2].clone().half()}
    given = {k: v.clone() for k, v in tree.items()}
    leaf_means = spmd.StartedLeafMeans(tree, mesh, ("a", "b")).wait()
    # The means are computed in a buffer of their own, also for a dtype with one leaf ("h").
    untouched = all(torch.equal(tree[k], given[k]) for k in tree)
    old = {"kept": torch.ones(2), "new": torch.zeros(2)}
    new = {"kept": old["kept"], "new": torch.full((2,), float(rank))}
    buffers = spmd.StartedBufferMeans(old, new, mesh, "a")
    holds = buffers.holds(new), buffers.holds({**new, "new": new["new"].clone()})
    return first, second is first, by_collective, leaf_means, buffers.wait(), holds, rank, untouched


def test_started_means_equal_the_collectives():
    results = run_spmd(_started_means, 4)
    for first, again, expected, leaf_means, buffers, holds, rank, untouched in results:
        assert untouched
        assert again  # a second wait returns the same means
        assert torch.equal(first, expected)
        assert torch.equal(leaf_means["x"], expected)
        assert leaf_means["h"].dtype == torch.float16
        assert torch.equal(leaf_means["n"], torch.tensor([rank]))  # an integer leaf: kept
        # Along axis "a" of the 2 x 2 mesh, rank r pairs with r + 2: the mean of r % 2 and
        # r % 2 + 2. The buffer returned as the very tensor it was given is not sent.
        assert torch.equal(buffers["new"], torch.full((2,), rank % 2 + 1.0))
        assert torch.equal(buffers["kept"], torch.ones(2))
        assert holds == (True, False)


def test_step_means_use_only_the_values_they_began_on():
    # One process: a mesh of size 1, so every mean is the value itself, with no collective.
    mesh = fs.Mesh(dp=1)
    means = step_means.StepMeans(mesh, ("dp",))  # no reducer session: nothing to fold into
    loss, other = torch.tensor(2.0), torch.tensor(3.0)
    old, new = {"b": torch.zeros(2)}, {"b": torch.ones(2)}
    means.after_forward(loss, {"m": other, "n": 4}, old, new)
    detached = loss.detach()
    means.returned_loss(detached)
    metrics = {"loss": detached, "m": torch.tensor(3.0), "n": 4}  # "m" replaced after
    averaged = step_means.mean_metrics(metrics, means)
    assert averaged["loss"] is not detached and torch.equal(averaged["loss"], detached)
    assert averaged["m"] is metrics["m"] and averaged["n"] == 4  # not the value begun on
    assert torch.equal(step_means.mean_buffers(old, new, means)["b"], new["b"])
    names = {"a": torch.tensor(1.0), "i": torch.tensor(1), "v": torch.ones(2), "f": 1.0}
    assert spmd.scalar_metric_names(names) == ["a"]
    means.finish()


def test_stacked_scalars_are_a_detached_float32_copy():
    loss = torch.tensor(2.0, dtype=torch.float64, requires_grad=True) * 1
    stacked = spmd.stack_scalars([loss, torch.tensor([3.0], dtype=torch.bfloat16)])
    assert stacked.dtype == torch.float32 and not stacked.requires_grad
    assert stacked.tolist() == [2.0, 3.0]
    # The buffer means give one tree, however often they are waited for.
    buffers = spmd.StartedBufferMeans({}, {"b": torch.ones(2)}, fs.Mesh(dp=1), "dp")
    assert buffers.wait() is buffers.wait()
