"""data_parallel: equal to torch DDP bit for bit, to one process within tolerance, exact traffic."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.distributed import hosts
from fscale.parallel import bucket_collectives
from fscale.parallel.buckets import GradBuckets, assign_buckets, forward_order
from fscale.testing import RankError, assert_trees_close, assert_trees_equal, run_spmd
from fscale.testing import strategies as fst
from fscale.testing.probes import on_gradient

STEPS = 3
BATCH = 8  # global batch; divisible by every world size tested


def _local(case, step_index, rank, world):
    return fs.data.split_batch(case.batch(BATCH, seed=step_index), rank, world)


def _train_fscale_and_ddp(case, opt, steps, bucket_mb=25.0, overlap=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.Mesh(dp=world)
    module = case.module()
    reference = copy.deepcopy(module)
    apply, params, buffers = fs.functionalize(module)
    step = fs.train_step(case.loss_fn(apply), opt.fscale())
    step = fs.data_parallel(step, mesh, bucket_mb=bucket_mb, overlap=overlap)
    state = step.init(params, buffers)
    with warnings.catch_warnings():  # the flag is deprecated in favour of one without this meaning
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(reference, broadcast_buffers=False)
    torch_opt = opt.torch([p for p in ddp.parameters() if p.requires_grad])
    losses = []
    for i in range(steps):
        batch = _local(case, i, rank, world)
        state, metrics = step(state, batch)
        torch_opt.zero_grad()
        case.loss(ddp(case.inputs(batch)), batch).backward()
        torch_opt.step()
        losses.append(metrics["loss"])
    ddp_params = {n: p.detach() for n, p in reference.named_parameters() if n in state.params}
    return state.params, ddp_params, torch.stack(losses)


def _train_data_parallel_and_one_process(case, opt, steps):
    # The one-process reference runs here too, so it uses the same intra-op thread count as
    # the ranks (a GEMM's summation order depends on it).
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.data_parallel(fs.train_step(case.loss_fn(apply), opt.fscale()), fs.Mesh(dp=world))
    state = step.init(params, buffers)
    for i in range(steps):
        state, _ = step(state, _local(case, i, rank, world))
    return state.params, _train_one_process(case, opt, steps)


def _train_one_process(case, opt, steps):
    module = case.module()
    apply, params, buffers = fs.functionalize(module)
    step = fs.train_step(case.loss_fn(apply), opt.fscale())
    state = step.init(params, buffers)
    for i in range(steps):
        state, _ = step(state, case.batch(BATCH, seed=i))
    return state.params


@settings(max_examples=examples(10))
@given(
    case=fst.model_cases(),
    opt=fst.optimizer_cases(),
    world=st.sampled_from([1, 2, 4]),
)
def test_data_parallel_equals_torch_ddp(case, opt, world):
    if world > 2:  # over 4 ranks in float64: see below
        case = dataclasses.replace(case, dtype=torch.float64)
    results = run_spmd(_train_fscale_and_ddp, world, case, opt, STEPS)
    ours, theirs, _ = results[0]
    for other in results[1:]:  # replicas stay identical
        assert_trees_equal(other[0], ours)
    if world <= 2:
        # Both pre-divide by N (a power of two: exact) and sum the same per-rank gradients.
        assert_trees_equal(ours, theirs)
    else:
        # gloo's 4-rank ring adds the four gradients in an association order that depends on
        # an element's offset in its bucket, and torch DDP lays out (and, after the first
        # step, re-lays out) its buckets differently: one rounding per element and step.
        # Optimizers that divide by the gradient's magnitude (rmsprop, adagrad, adam) enlarge
        # that for elements whose gradient cancels to nearly zero: in float32 a GPT under
        # RMSprop (lr 0.05) ended 2.8e-4 apart. So these ranks train in float64.
        assert_trees_close(ours, theirs, rtol=1e-9, atol=1e-9)


@settings(max_examples=examples(6))
@given(
    case=fst.model_cases(kinds=("mlp", "gpt")),
    opt=fst.optimizer_cases(names=("sgd",)),
    world=st.sampled_from([1, 2, 4]),
)
def test_data_parallel_equals_one_process_on_the_whole_batch(case, opt, world):
    """Equal to training on the concatenated batch up to summation order.

    Tolerance: rtol 1e-5, atol 1e-6 after three SGD steps. One GEMM over the whole batch adds
    the per-example terms in another order than per-rank GEMMs followed by the all-reduce, so
    each gradient element differs by a few ulps. The comparison uses SGD: adaptive optimizers
    divide by the running gradient magnitude, and leaves whose exact gradient is zero (the
    attention key bias is one: softmax ignores a constant shift) turn that rounding noise into
    full-size updates. CNNs are left out because BatchNorm normalises each rank's batch with
    its own statistics, so data parallelism computes another function (as with torch DDP).
    """
    for ours, single in run_spmd(_train_data_parallel_and_one_process, world, case, opt, STEPS):
        assert_trees_close(ours, single, rtol=1e-5, atol=1e-6)


def _ledger_one_step(bucket_mb):
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("mlp", width=16, depth=3)
    apply, params, buffers = fs.functionalize(case.module())
    mesh = fs.Mesh(dp=world)
    step = fs.data_parallel(
        fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1)), mesh, bucket_mb=bucket_mb
    )
    state = step.init(params, buffers)
    with fs.distributed.comm_ledger() as ledger:
        step(state, _local(case, 0, rank, world))
    psi = sum(p.numel() for p in params.values())
    return psi, [(r.op, r.numel, r.elements) for r in ledger.records]


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_is_one_all_reduce_of_the_gradients(world):
    psi, records = run_spmd(_ledger_one_step, world, 1e-3)[0]
    grad_records = [r for r in records if r[1] > 1]
    metric_records = [r for r in records if r[1] == 1]
    assert all(op == "all_reduce" for op, _, _ in records)
    assert len(grad_records) > 1  # small buckets: several collectives
    assert sum(n for _, n, _ in grad_records) == psi
    assert sum(e for _, _, e in grad_records) == 2 * psi * (world - 1) / world
    assert len(metric_records) == 1  # the loss


def _loss_with_a_metric(params, buffers, batch, key):
    loss = (params["w"] * batch).sum() ** 2
    return loss, buffers, {"scale": loss.detach() * 3.0, "count": torch.tensor(2)}


def _folded_metrics(strategy, fold):
    rank = dist.get_rank()
    mesh = fs.Mesh(dp=2)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randn(5, generator=g) * torch.exp(torch.randn(5, generator=g) * 4)
    step = fs.train_step(_loss_with_a_metric, fs.optim.sgd(0.1))
    step = {"ddp": fs.data_parallel, "zero": fs.shard_optimizer}[strategy](step, mesh)
    state = step.init({"w": torch.linspace(-1.0, 2.0, 5)}, {})
    if fold:
        # Every call that puts a sum on the wire: gloo's, or shared memory's on one host.
        calls = []
        patched = [
            (dist, "all_reduce"),
            (bucket_collectives, "shared_all_reduce"),
            (bucket_collectives, "shared_reduce_scatter"),
        ]
        saved = [getattr(module, name) for module, name in patched]

        def counting(original):
            def counted(*args, **kwargs):
                calls.append(args[0].numel())
                return original(*args, **kwargs)

            return counted

        for (module, name), original in zip(patched, saved):
            setattr(module, name, counting(original))
        try:
            with fs.distributed.comm_ledger() as ledger:
                _, metrics = step(state, batch)
        finally:
            for (module, name), original in zip(patched, saved):
                setattr(module, name, original)
        return metrics, (calls, [(r.op, r.numel) for r in ledger.records])
    _, aux = step.gradients(state, batch)  # this rank's loss and metric, then their mean
    mine = torch.stack([aux.loss, aux.metrics["scale"]])
    expected = fs.distributed.all_reduce(mine, "dp", "mean", mesh=mesh)
    return {"loss": expected[0], "scale": expected[1]}, None


@pytest.mark.parametrize("strategy", ["ddp", "zero"])
def test_the_loss_travels_with_the_gradients_and_is_exact(strategy):
    for (folded, (calls, records)), (separate, _) in zip(
        run_spmd(_folded_metrics, 2, strategy, True), run_spmd(_folded_metrics, 2, strategy, False)
    ):
        for name in ("loss", "scale"):
            assert folded[name].view(torch.int32) == separate[name].view(torch.int32), name
        assert folded["count"] == 2  # not a floating-point scalar: left as it is
        # One gradient bucket (5 elements; ZeRO aligns and pads them), the two scalars after
        # it: one collective on the wire, which the ledger records as the algorithm's two parts.
        assert len(calls) == 1 and calls[0] >= 7
        bucket_op = "all_reduce" if strategy == "ddp" else "reduce_scatter"
        assert sorted(r for r in records if r[0] != "all_gather") == sorted(
            [(bucket_op, calls[0] - 2), ("all_reduce", 2)]
        )


def _first_bucket_reduced_before_backward_ends(overlap):
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("mlp", width=64, depth=3)
    apply, params, buffers = fs.functionalize(case.module())
    seen_when_first_layer_grad_computed = []

    def loss_fn(p, b, batch, key):
        # The first layer's gradient is the last one backward computes.
        def record(grad):
            seen_when_first_layer_grad_computed.append(len(ledger.records))

        p = dict(p, **{"0.weight": on_gradient(p["0.weight"], record)})
        return case.loss_fn(apply)(p, b, batch, key)

    mesh = fs.Mesh(dp=world)
    step = fs.data_parallel(
        fs.train_step(loss_fn, fs.optim.sgd(0.1)), mesh, bucket_mb=0.01, overlap=overlap
    )
    state = step.init(params, buffers)
    with fs.distributed.comm_ledger() as ledger:
        step(state, _local(case, 0, rank, world))
    return seen_when_first_layer_grad_computed[0], len(ledger.records)


@pytest.mark.parametrize("overlap", [True, False, None])
def test_buckets_start_reducing_during_backward_unless_overlap_is_off(overlap):
    # None decides by device: these CPU parameters reduce after backward.
    seen = run_spmd(_first_bucket_reduced_before_backward_ends, 2, overlap)
    started_during_backward = [before_last_gradient for before_last_gradient, _ in seen]
    assert all(n >= 1 if overlap else n == 0 for n in started_during_backward)
    assert all(records > 1 for _, records in seen)  # several buckets either way


def _first_bucket_with_ranks_on_two_hosts():
    rank = dist.get_rank()
    original = hosts.host_id
    hosts._ONE_HOST.clear()
    hosts.host_id = lambda: f"host:{rank}"
    try:
        return _first_bucket_reduced_before_backward_ends(None)
    finally:
        hosts.host_id = original
        hosts._ONE_HOST.clear()


def test_by_default_an_axis_across_hosts_reduces_during_backward():
    # The CPU default waits for backward only where the axis's ranks share the host's cores.
    seen = run_spmd(_first_bucket_with_ranks_on_two_hosts, 2)
    assert all(before_last_gradient >= 1 for before_last_gradient, _ in seen)


def _overlap_on_and_off_train_alike():
    case = fst.ModelCase("gpt", width=16, depth=2)
    opt = fst.OptimizerCase("adam", (("lr", 1e-2),))
    return [
        _train_fscale_and_ddp(case, opt, STEPS, bucket_mb=1 / 1024, overlap=overlap)
        for overlap in (True, False)
    ]


def test_all_reduce_during_or_after_backward_equals_torch_ddp_bit_for_bit():
    for (on, ddp, _), (off, _, _) in run_spmd(_overlap_on_and_off_train_alike, 2):
        assert_trees_equal(on, ddp)
        assert_trees_equal(off, ddp)


def test_overlap_must_be_a_bool_or_none():
    step = fs.train_step(lambda p, b, batch, key: p["w"].sum(), fs.optim.sgd(0.1))
    with pytest.raises(TypeError, match="overlap"):
        fs.data_parallel(step, fs.Mesh(dp=1), overlap="auto")


def _small_buckets_against_torch_ddp(kind):
    """Several hooked buckets and a late one (written after backward) against torch DDP."""
    case = fst.ModelCase(kind, width=16, depth=2)
    opt = fst.OptimizerCase("adam", (("lr", 1e-2),))
    hooked = []
    deliver = GradBuckets._deliver

    def counted(self, *args):
        hooked.append(self.late_from)
        return deliver(self, *args)

    GradBuckets._deliver = counted  # type: ignore[method-assign]
    try:
        ours, theirs, _ = _train_fscale_and_ddp(case, opt, STEPS, bucket_mb=1 / 1024, overlap=True)
    finally:
        GradBuckets._deliver = deliver  # type: ignore[method-assign]
    _, params, _ = fs.functionalize(case.module())
    order, leaves = forward_order(params), fs.tree.leaves(params)
    buckets = assign_buckets(leaves, 1024, order=order, first_bucket_bytes=1 << 20)
    return ours, theirs, hooked, [len(b.leaf_indices) for b in buckets]


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_hooked_buckets_and_the_late_bucket_equal_torch_ddp(kind):
    for ours, theirs, hooked, sizes in run_spmd(_small_buckets_against_torch_ddp, 2, kind):
        assert_trees_equal(ours, theirs)
        assert len(sizes) > 2
        late = len(sizes) - 1
        # A hook ran for every leaf of every bucket but the last, which was written in one go.
        assert hooked == [late] * (sum(sizes) - sizes[-1]) * STEPS


def _buffers_are_averaged():
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("cnn", width=4, depth=1)
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.data_parallel(
        fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1)), fs.Mesh(dp=world)
    )
    state, _ = step(step.init(params, buffers), _local(case, 0, rank, world))
    # Each rank's own statistics, averaged by hand:
    _, own = apply(params, buffers, case.inputs(_local(case, 0, rank, world)))
    return state.buffers, own


def test_batchnorm_statistics_are_averaged_over_ranks():
    results = run_spmd(_buffers_are_averaged, 2)
    (buffers0, own0), (buffers1, own1) = results
    assert_trees_equal(buffers0, buffers1)
    for name, value in buffers0.items():
        if value.is_floating_point():
            expected = own0[name] / 2 + own1[name] / 2
            assert torch.allclose(value, expected, rtol=1e-6, atol=1e-7), name


def _func_mode_equals_autograd_mode():
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("mlp")
    apply, params, buffers = fs.functionalize(case.module())
    mesh = fs.Mesh(dp=world)
    a = fs.data_parallel(fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1)), mesh)
    b = fs.data_parallel(
        fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1), grad_mode="func"), mesh
    )
    sa, sb = a.init(params, buffers), b.init(params, buffers)
    for i in range(2):
        sa, _ = a(sa, _local(case, i, rank, world))
        sb, _ = b(sb, _local(case, i, rank, world))
    return sa.params, sb.params


def test_func_grad_mode_uses_replicate_and_agrees():
    for by_hooks, by_replicate in run_spmd(_func_mode_equals_autograd_mode, 2):
        assert_trees_equal(by_hooks, by_replicate)


def _disagreeing_ranks():
    rank = dist.get_rank()
    case = fst.ModelCase("mlp", width=4 + rank)
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.data_parallel(fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1)), fs.Mesh(dp=2))
    step.init(params, buffers)


def test_ranks_with_different_models_get_a_clear_error():
    with pytest.raises(RankError, match="disagree on the parameter and buffer trees"):
        run_spmd(_disagreeing_ranks, 2)


def test_bad_arguments():
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.sgd(0.1))
    with pytest.raises(ValueError, match="no axis 'dp'"):
        fs.data_parallel(step, fs.Mesh(tp=1))
    with pytest.raises(TypeError, match=r"fscale\.Mesh"):
        fs.data_parallel(step, "dp")
    with pytest.raises(ValueError, match=r"already splits its batch over axis 'dp'"):
        fs.data_parallel(fs.data_parallel(step, fs.Mesh(dp=1)), fs.Mesh(dp=1))
    with pytest.raises(ValueError, match="bucket_mb"):
        fs.data_parallel(step, fs.Mesh(dp=1), bucket_mb=0)
    with pytest.raises(TypeError, match="Step"):
        fs.data_parallel(lambda s, b: s, fs.Mesh(dp=1))
    assert "data_parallel(axis='dp'" in repr(fs.data_parallel(step, fs.Mesh(dp=1)))


def _rank_dependent_loss(params, buffers, batch, key):
    hidden = torch.tanh(params["a"] * batch)
    if dist.get_rank() == 1:
        return hidden.sum()  # "b" unused here: its bucket completes only at flush
    return (hidden * params["b"]).sum()


def _step_with_a_parameter_unused_on_one_rank():
    rank = dist.get_rank()
    params = {"a": torch.linspace(-1, 1, 4), "b": torch.linspace(0.5, 2, 4)}
    batch = torch.arange(4.0) + rank
    # One leaf per bucket; "b" is used last, so it is bucket 0 and completes first on rank 0.
    step = fs.data_parallel(
        fs.train_step(_rank_dependent_loss, fs.optim.sgd(1.0)), fs.Mesh(dp=2), bucket_mb=1e-6
    )
    state, _ = step(step.init(params, {}), batch)
    return state.params


def test_buckets_are_reduced_in_the_same_order_on_every_rank():
    # Rank 1 completes bucket 1 ("a") during backward and bucket 0 ("b") only at flush; the
    # all-reduces must still be issued in bucket order, or they would pair "a" with "b".
    params = {"a": torch.linspace(-1, 1, 4), "b": torch.linspace(0.5, 2, 4)}
    grads = []
    for rank in range(2):
        live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = _rank_dependent_loss_reference(live, torch.arange(4.0) + rank, rank)
        grads.append(
            torch.autograd.grad(
                loss, list(live.values()), materialize_grads=True, allow_unused=True
            )
        )
    expected = {
        name: params[name] - (grads[0][i] / 2 + grads[1][i] / 2) for i, name in enumerate(params)
    }
    for result in run_spmd(_step_with_a_parameter_unused_on_one_rank, 2):
        assert_trees_equal(result, expected)


def _rank_dependent_loss_reference(params, batch, rank):
    hidden = torch.tanh(params["a"] * batch)
    return hidden.sum() if rank == 1 else (hidden * params["b"]).sum()
