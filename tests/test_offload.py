"""Host offload: offloaded optimizers equal plain ones; offloaded stages respect residency."""

from __future__ import annotations

import itertools
import os

# The session runs with deterministic algorithms; on CUDA, cuBLAS then needs a fixed workspace
# (read when its handle is created, i.e. at the first CUDA matmul, after this import).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

from fscale import flat, optim, tree
from fscale.offload import (
    OffloadState,
    PrefetchSchedule,
    ResidencyEvent,
    offload_optimizer,
    offload_params,
    transfer,
)
from fscale.train import train_step

_NO_CUDA = "needs a CUDA device: the asynchronous pinned-memory path only runs there"

OPTIMIZERS = {
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(1e-2),
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "adagrad": lambda: optim.adagrad(0.1),
}


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "layer": {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen)},
        "scale": torch.randn((), generator=gen),
    }
    return tree.map(lambda t: t.to(dtype), params)


def _grads(params: dict, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    return tree.map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)


def _assert_trees_equal(actual, expected) -> None:
    actual_leaves, actual_def = tree.flatten(actual)
    expected_leaves, expected_def = tree.flatten(expected)
    assert actual_def == expected_def
    for a, e in zip(actual_leaves, expected_leaves):
        assert a.dtype == e.dtype and torch.equal(a, e), (a, e)


def _inner_state_equal(offloaded_state, plain_state) -> None:
    _assert_trees_equal(offloaded_state.inner, plain_state)


# ----------------------------------------------------------------------------- offload_optimizer


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_step_equals_plain_step(name, donate):
    plain, offloaded = OPTIMIZERS[name](), offload_optimizer(OPTIMIZERS[name]())
    plain_params = _params()
    off_params = tree.map(torch.clone, plain_params)
    plain_state, off_state = plain.init(plain_params), offloaded.init(off_params)
    for i in range(4):
        grads = _grads(plain_params, i)
        plain_params, plain_state = optim.step(plain, grads, plain_state, plain_params)
        off_params, off_state = optim.step(
            offloaded, tree.map(torch.clone, grads), off_state, off_params, donate=donate
        )
        _assert_trees_equal(off_params, plain_params)
        _assert_trees_equal(off_state.master, plain_params)
        _inner_state_equal(off_state, plain_state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_path_equals_plain_update(name):
    plain, offloaded = OPTIMIZERS[name](), offload_optimizer(OPTIMIZERS[name]())
    plain_params = _params()
    off_params = tree.map(torch.clone, plain_params)
    plain_state, off_state = plain.init(plain_params), offloaded.init(off_params)
    for i in range(3):
        grads = _grads(plain_params, i)
        plain_updates, plain_state = plain.update(grads, plain_state, plain_params)
        off_updates, off_state = offloaded.update(grads, off_state, off_params)
        _assert_trees_equal(off_updates, plain_updates)
        plain_params = optim.apply_updates(plain_params, plain_updates)
        off_params = optim.apply_updates(off_params, off_updates)
        # The master took the same step the caller applied.
        _assert_trees_equal(off_state.master, plain_params)
        _inner_state_equal(off_state, plain_state)


def test_state_lives_on_device_and_inputs_are_not_mutated():
    offloaded = offload_optimizer(optim.adam(1e-2), device="cpu")
    params = _params()
    state = offloaded.init(params)
    assert isinstance(state, OffloadState)
    assert all(leaf.device == torch.device("cpu") for leaf in tree.leaves(state))
    # The master is a copy, never an alias of the caller's params.
    params_ptrs = {t.data_ptr() for t in tree.leaves(params)}
    assert not params_ptrs & {t.data_ptr() for t in tree.leaves(state.master)}

    grads = _grads(params, 0)
    before = tree.map(torch.clone, (params, state, grads))
    new_params, new_state = optim.step(offloaded, grads, state, params)
    _assert_trees_equal((params, state, grads), before)
    assert not params_ptrs & {t.data_ptr() for t in tree.leaves(new_params)}
    assert not {t.data_ptr() for t in tree.leaves(new_params)} & {
        t.data_ptr() for t in tree.leaves(new_state.master)
    }


def test_pointwise_flag_is_kept():
    assert offload_optimizer(optim.adam(1e-3)).pointwise is True
    assert offload_optimizer(optim.lamb(1e-3)).pointwise is optim.lamb(1e-3).pointwise


def test_layout_passes_through_unchanged():
    seen = []
    inner = optim.sgd(0.1, momentum=0.9)

    def init(params, *, sharding=None):
        seen.append(("init", sharding))
        return inner.init(params, sharding=sharding)

    def update(grads, state, params=None, *, sharding=None):
        seen.append(("update", sharding))
        return inner.update(grads, state, params, sharding=sharding)

    def apply(grads, state, params, *, sharding=None, donate=False):
        seen.append(("apply", sharding))
        return inner.apply(grads, state, params, sharding=sharding, donate=donate)

    recording = inner._replace(init=init, update=update, apply=apply)
    # Each rank's shard: a 1-D fragment of a larger tensor.
    shard = {"w": torch.arange(4.0)}
    sharding = optim.Sharding({"w": flat.Fragment(torch.Size([2, 4]), 2, 6)}, lambda t: t)
    offloaded = offload_optimizer(recording)
    state = offloaded.init(shard, sharding=sharding)
    offloaded.update({"w": torch.ones(4)}, state, shard, sharding=sharding)
    offloaded.apply({"w": torch.ones(4)}, state, shard, sharding=sharding)
    assert [kind for kind, _ in seen] == ["init", "update", "apply"]
    assert all(got is sharding for _, got in seen)


def test_sharded_non_pointwise_optimizer_equals_plain_with_same_sharding():
    shard = {"w": torch.linspace(-1.0, 1.0, 6)}
    sharding = optim.Sharding({"w": flat.Fragment(torch.Size([3, 4]), 3, 9)}, lambda t: t)
    plain, offloaded = optim.lamb(1e-2), offload_optimizer(optim.lamb(1e-2))
    plain_params, off_params = shard, tree.map(torch.clone, shard)
    plain_state = plain.init(plain_params, sharding=sharding)
    off_state = offloaded.init(off_params, sharding=sharding)
    for i in range(3):
        grads = _grads(shard, i)
        plain_params, plain_state = optim.step(
            plain, grads, plain_state, plain_params, sharding=sharding
        )
        off_params, off_state = optim.step(
            offloaded, grads, off_state, off_params, sharding=sharding
        )
        _assert_trees_equal(off_params, plain_params)


@pytest.mark.parametrize("offload_inside", [True, False])
def test_composes_with_chain_and_clip_by_global_norm(offload_inside):
    def make(offload):
        adam = optim.adam(1e-2)
        if offload and offload_inside:
            return offload_optimizer(optim.chain(optim.clip_by_global_norm(0.5), adam))
        if offload:
            return optim.chain(optim.clip_by_global_norm(0.5), offload_optimizer(adam))
        return optim.chain(optim.clip_by_global_norm(0.5), adam)

    plain, offloaded = make(False), make(True)
    plain_params = _params()["layer"]
    off_params = tree.map(torch.clone, plain_params)
    plain_state, off_state = plain.init(plain_params), offloaded.init(off_params)
    for i in range(3):
        grads = tree.map(lambda g: 3.0 * g, _grads(plain_params, i))  # large enough to clip
        plain_params, plain_state = optim.step(plain, grads, plain_state, plain_params)
        off_params, off_state = optim.step(offloaded, grads, off_state, off_params)
        _assert_trees_equal(off_params, plain_params)


@pytest.mark.parametrize("donate", [False, True])
def test_train_step_with_offloaded_optimizer_equals_plain(donate):
    def loss_fn(params, buffers, batch, key):
        hidden = torch.tanh(batch @ params["layer"]["w"] + params["layer"]["b"])
        return (hidden * params["scale"]).pow(2).mean()

    batches = [torch.randn(8, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = train_step(loss_fn, optim.adamw(1e-2, weight_decay=0.1))
    offloaded = train_step(
        loss_fn, offload_optimizer(optim.adamw(1e-2, weight_decay=0.1)), donate=donate
    )
    plain_state, off_state = plain.init(_params()), offloaded.init(_params())
    for batch in batches:
        plain_state, plain_metrics = plain(plain_state, batch)
        off_state, off_metrics = offloaded(off_state, batch)
        assert torch.equal(off_metrics["loss"], plain_metrics["loss"])
    _assert_trees_equal(off_state.params, plain_state.params)
    _inner_state_equal(off_state.opt_state, plain_state.opt_state)


def test_low_precision_params_get_a_float32_master():
    params = _params(dtype=torch.bfloat16)
    offloaded = offload_optimizer(optim.adam(1e-2))
    state = offloaded.init(params)
    assert all(t.dtype == torch.float32 for t in tree.leaves(state.master))
    reference_opt = optim.adam(1e-2)
    reference = tree.map(lambda t: t.float(), params)
    reference_state = reference_opt.init(reference)
    for i in range(3):
        grads = _grads(params, i)  # bf16, as the device computes them
        params, state = optim.step(offloaded, grads, state, params)
        reference, reference_state = optim.step(
            reference_opt, tree.map(lambda g: g.float(), grads), reference_state, reference
        )
        _assert_trees_equal(state.master, reference)
        _assert_trees_equal(params, tree.map(lambda t: t.to(torch.bfloat16), reference))


def test_offload_optimizer_errors():
    with pytest.raises(TypeError, match=r"`optimizer` must be an fscale\.optim\.Optimizer"):
        offload_optimizer(torch.optim.SGD)
    with pytest.raises(ValueError, match="`device`='gpu0' is not a device torch knows"):
        offload_optimizer(optim.sgd(0.1), device="gpu0")
    with pytest.raises(TypeError, match="`device` must be a device string"):
        offload_optimizer(optim.sgd(0.1), device=3.5)
    offloaded = offload_optimizer(optim.sgd(0.1))
    params = _params()
    state = offloaded.init(params)
    with pytest.raises(TypeError, match="`state` must be the OffloadState"):
        offloaded.update(_grads(params, 0), optim.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match="`grads` has structure"):
        optim.step(offloaded, {"w": torch.ones(2)}, state, params)
    with pytest.raises(ValueError, match="`params` has structure"):
        offloaded.apply(_grads(params, 0), state, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match="floating-point tensors only"):
        offloaded.init({"steps": torch.zeros(2, dtype=torch.int64)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_device_or_pinning_without_cuda_is_refused():
    with pytest.raises(ValueError, match="`device`='cuda' is not available on this machine"):
        offload_optimizer(optim.sgd(0.1), device="cuda")
    with pytest.raises(ValueError, match="`pin_memory`=True needs host memory"):
        offload_optimizer(optim.sgd(0.1), pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
@pytest.mark.parametrize("donate", [False, True])
def test_cuda_params_with_host_optimizer_equal_host_optimizer(donate):
    host_opt, offloaded = optim.adamw(1e-2), offload_optimizer(optim.adamw(1e-2))
    host_params = _params()
    cuda_params = tree.map(lambda t: t.cuda(), host_params)
    host_state, off_state = host_opt.init(host_params), offloaded.init(cuda_params)
    assert all(t.is_pinned() for t in tree.leaves(off_state.master))
    for i in range(4):
        grads = _grads(host_params, i)
        host_params, host_state = optim.step(host_opt, grads, host_state, host_params)
        cuda_grads = tree.map(lambda g: g.cuda(), grads)
        cuda_params, off_state = optim.step(
            offloaded, cuda_grads, off_state, cuda_params, donate=donate
        )
        assert all(t.is_cuda for t in tree.leaves(cuda_params))
        assert all(t.device.type == "cpu" for t in tree.leaves(off_state))
        _assert_trees_equal(tree.map(lambda t: t.cpu(), cuda_params), host_params)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- offload_params


def _stage_fn(params, x):
    return torch.tanh(x @ params["w"] + params["b"])


def _dropout_stage_fn(params, x):
    return torch.nn.functional.dropout(_stage_fn(params, x), p=0.3, training=True)


def _stages(count: int = 4, width: int = 6, fn=_stage_fn, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(7)
    return [
        (
            fn,
            {
                "w": (torch.randn(width, width, generator=gen) / width**0.5).requires_grad_(
                    requires_grad
                ),
                "b": torch.randn(width, generator=gen).requires_grad_(requires_grad),
            },
        )
        for _ in range(count)
    ]


def _plain(stages, x):
    for fn, params in stages:
        x = fn(params, x)
    return x


def _input(width: int = 6) -> torch.Tensor:
    return torch.randn(3, width, generator=torch.Generator().manual_seed(3)).requires_grad_(True)


def _grads_of(out, stages, x):
    leaves = [x] + [leaf for _, params in stages for leaf in tree.leaves(params)]
    return torch.autograd.grad(out.square().sum(), leaves)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_offloaded_stages_equal_plain_composition(prefetch):
    stages = _stages()
    run = offload_params(stages, "cpu", prefetch=prefetch)
    x = _input()
    out = run(x)
    expected = _plain(stages, x)
    assert torch.equal(out, expected)
    for got, want in zip(_grads_of(out, stages, x), _grads_of(expected, stages, x)):
        assert torch.equal(got, want)
    assert [fn for fn, _ in stages] == run.fns and len(run) == 4


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_at_most_prefetch_plus_one_stages_are_resident(prefetch):
    count = 5
    stages = _stages(count)
    run = offload_params(stages, "cpu", prefetch=prefetch)
    x = _input()
    out = run(x)
    forward_log = run.residency_log
    _grads_of(out, stages, x)
    log = run.residency_log
    assert log[: len(forward_log)] == forward_log
    bound = prefetch + 1
    for phase, order in (("forward", list(range(count))), ("backward", list(range(count))[::-1])):
        events = [e for e in log if e.phase == phase]
        assert max(len(e.resident) for e in events) == min(bound, count)
        assert [e.stage for e in events if e.action == "compute"] == order
        # A stage computes only on resident params, is fetched once and released once per phase.
        assert all(e.stage in e.resident for e in events if e.action == "compute")
        for stage in range(count):
            actions = [e.action for e in events if e.stage == stage]
            assert actions == ["fetch", "compute", "release"]
        assert events[-1].resident == ()
        if prefetch:
            # The next stage's copy is issued before the current stage computes.
            for current, following in itertools.pairwise(order):
                assert _position(events, following, "fetch") < _position(events, current, "compute")


def _position(events, stage, action):
    return next(i for i, e in enumerate(events) if e.stage == stage and e.action == action)


def test_stages_outside_the_graph_are_not_fetched_in_backward():
    stages = _stages(3)
    frozen = [(stages[0][0], tree.map(lambda t: t.detach(), stages[0][1])), *stages[1:]]
    run = offload_params(frozen, "cpu", prefetch=2)
    out = run(_input().detach())
    leaves = [leaf for _, params in frozen[1:] for leaf in tree.leaves(params)]
    torch.autograd.grad(out.sum(), leaves)
    backward = [e for e in run.residency_log if e.phase == "backward"]
    assert {e.stage for e in backward} == {1, 2}
    assert backward[-1].resident == ()


def test_dropout_is_replayed_in_the_recomputation():
    stages = _stages(3, fn=_dropout_stage_fn)
    x = _input()
    run = offload_params(stages, "cpu", prefetch=1)
    torch.manual_seed(11)
    out = run(x)
    got = _grads_of(out, stages, x)
    torch.manual_seed(11)
    expected = _plain(stages, x)
    want = _grads_of(expected, stages, x)
    assert torch.equal(out, expected)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_grads_under_torch_func_grad_equal_plain():
    stages = _stages(3, requires_grad=False)
    run = offload_params(stages, "cpu")
    x = _input().detach()

    def offloaded_loss(params):
        return run(x, params).square().sum()

    def plain_loss(params):
        return _plain([(fn, p) for (fn, _), p in zip(stages, params)], x).square().sum()

    params = [p for _, p in stages]
    got = torch.func.grad(offloaded_loss)(params)
    want = torch.func.grad(plain_loss)(params)
    _assert_trees_equal(got, want)


def test_second_order_grads_through_offloaded_stages_match_plain():
    stages = _stages(3)
    x = _input()
    run = offload_params(stages, "cpu", prefetch=1)
    leaves = [x] + [leaf for _, params in stages for leaf in tree.leaves(params)]

    def grad_norm_grads(out):
        first = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    # The differentiable backward contracts with the cotangent as a sum, so it may differ from
    # the plain graph in the last bits; first-order results above are bit-exact.
    for got, want in zip(grad_norm_grads(run(x)), grad_norm_grads(_plain(stages, x))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_train_step_over_offloaded_stages_equals_plain():
    stages = _stages(3, requires_grad=False)
    run = offload_params(stages, "cpu", prefetch=1)

    def offloaded_loss(params, buffers, batch, key):
        return run(batch, params).square().mean()

    def plain_loss(params, buffers, batch, key):
        return _plain([(fn, p) for (fn, _), p in zip(stages, params)], batch).square().mean()

    offloaded = train_step(offloaded_loss, optim.sgd(0.1, momentum=0.9))
    plain = train_step(plain_loss, optim.sgd(0.1, momentum=0.9))
    off_state, plain_state = offloaded.init(list(run.params)), plain.init(list(run.params))
    for i in range(3):
        batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        off_state, _ = offloaded(off_state, batch)
        plain_state, _ = plain(plain_state, batch)
    _assert_trees_equal(off_state.params, plain_state.params)


def test_offload_params_errors():
    stages = _stages(2)
    with pytest.raises(ValueError, match="`prefetch` must be >= 0"):
        offload_params(stages, "cpu", prefetch=-1)
    with pytest.raises(TypeError, match="`prefetch` must be an int"):
        offload_params(stages, "cpu", prefetch=1.0)
    with pytest.raises(ValueError, match="`device`='tpu9' is not a device torch knows"):
        offload_params(stages, "tpu9")
    with pytest.raises(TypeError, match="`stages` must be a sequence of"):
        offload_params(iter(stages), "cpu")
    with pytest.raises(ValueError, match="`stages` is empty"):
        offload_params([], "cpu")
    with pytest.raises(TypeError, match=r"`stages\[1\]` must be a pair \(stage_fn, stage_params"):
        offload_params([stages[0], stages[1][1]], "cpu")
    with pytest.raises(TypeError, match=r"stage 0 params leaf 'w' is a float"):
        offload_params([(_stage_fn, {"w": 1.0})], "cpu")
    with pytest.raises(ValueError, match="is on meta; the params of offloaded stages live"):
        offload_params([(_stage_fn, {"w": torch.empty(2, device="meta")})], "cpu")

    run = offload_params(stages, "cpu")
    with pytest.raises(ValueError, match="one per stage"):
        run(_input(), [stages[0][1]])
    with pytest.raises(ValueError, match="params of stage 1 have structure"):
        run(_input(), [stages[0][1], {"w": torch.ones(6, 6)}])
    with pytest.raises(TypeError, match="must return one tensor"):
        offload_params([(lambda p, x: (x, x), {})], "cpu")(_input())


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_cuda_offloaded_stages_equal_plain_and_grads_land_on_host(prefetch):
    stages = _stages(4, width=64)
    run = offload_params(stages, "cuda", prefetch=prefetch)
    assert all(t.is_pinned() for p in run.params for t in tree.leaves(p))
    x = torch.randn(8, 64, device="cuda")
    out = run(x)
    cuda_stages = [
        (fn, tree.map(lambda t: t.detach().cuda().requires_grad_(True), p))
        for fn, p in zip(run.fns, run.params)
    ]
    expected = _plain(cuda_stages, x)
    assert torch.equal(out, expected)
    host_leaves = [leaf for p in run.params for leaf in tree.leaves(p)]
    got = torch.autograd.grad(out.square().sum(), host_leaves)
    want = torch.autograd.grad(
        expected.square().sum(), [leaf for _, p in cuda_stages for leaf in tree.leaves(p)]
    )
    assert all(g.device.type == "cpu" for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g, w.cpu())
    log = run.residency_log
    assert max(len(e.resident) for e in log) <= prefetch + 1
    torch.cuda.synchronize()


def test_init_on_meta_params_gives_the_state_shapes_without_memory():
    # What fscale.consolidate / shard_state do to learn a state's structure and shapes.
    meta = {"w": torch.empty(2, 3, dtype=torch.bfloat16, device="meta")}
    state = offload_optimizer(optim.adam(1e-2)).init(meta)
    real = offload_optimizer(optim.adam(1e-2)).init({"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    assert tree.structure(state) == tree.structure(real)
    assert all(t.is_meta for t in tree.leaves(state) if t.numel() > 1)
    assert [(t.shape, t.dtype) for t in tree.leaves(state)] == [
        (t.shape, t.dtype) for t in tree.leaves(real)
    ]


# ----------------------------------------------------------------------------- host transfer


def test_checked_device_names_the_argument():
    assert transfer.checked_device("f", "where", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="f: `where`='gpu0' is not a device torch knows"):
        transfer.checked_device("f", "where", "gpu0")
    with pytest.raises(TypeError, match=r"f: `where` must be a device string or torch\.device"):
        transfer.checked_device("f", "where", 0)


def test_parking_on_the_host_copies_and_restores_exactly():
    t = torch.arange(6.0).reshape(2, 3)
    assert transfer.on_host(t) and not transfer.on_host(torch.empty(0, device="meta"))
    assert transfer.park_unless_on_host(t) is t  # nothing to move
    assert transfer.unpark(t) is t
    parked = transfer.park(t)
    assert isinstance(parked, transfer.Parked) and parked.ready is None
    t.add_(1)  # the parked value is a copy, not a view
    restored = transfer.unpark(parked)
    assert restored.device == t.device and torch.equal(restored, torch.arange(6.0).reshape(2, 3))


def test_synchronous_transfer_round_trips():
    copier = transfer.Transfer(torch.device("cpu"), pin_memory=False)
    assert not copier.is_async
    host = [torch.arange(3.0), torch.ones(2, 2, dtype=torch.float64)]
    on_device, event = copier.start_upload(host)
    assert event is None
    on_device = copier.finish_upload(on_device, event)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(on_device, host))
    targets = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.float64)]
    assert copier.upload_into(host, targets) == targets
    assert all(torch.equal(a, b) for a, b in zip(targets, host))
    copier.wait_for_sources()
    down = copier.download(on_device)
    assert all(torch.equal(a, b) for a, b in zip(down, host))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_cuda_pinned_packed_copy_packs_one_pinned_buffer_per_dtype():
    leaves = [torch.ones(3), torch.zeros(2, dtype=torch.float64), torch.arange(4.0).cuda()]
    packed = transfer.pinned_packed_copy(leaves)
    assert all(p.is_pinned() and p.device.type == "cpu" for p in packed)
    assert all(torch.equal(p, t.cpu()) for p, t in zip(packed, leaves))
    assert packed[0].untyped_storage().data_ptr() == packed[2].untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_cuda_transfer_round_trips_on_side_streams():
    device = torch.device("cuda", torch.cuda.current_device())
    copier = transfer.Transfer(device, pin_memory=True)
    assert copier.is_async
    host = transfer.pinned_packed_copy([torch.randn(1000), torch.randn(10, 10)])
    on_device = copier.finish_upload(*copier.start_upload(host))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_device, host))
    down = copier.download([t * 2 for t in on_device])
    assert all(d.is_pinned() and torch.equal(d, 2 * h) for d, h in zip(down, host))
    targets = [torch.zeros_like(t) for t in on_device]
    copier.upload_into(host, targets)
    copier.wait_for_sources()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(targets, host))
    value = torch.randn(256, device=device)
    parked = transfer.park(value)
    assert parked.ready is not None and parked.host.is_pinned()
    assert torch.equal(transfer.unpark(parked), value)


# ----------------------------------------------------------------------------- prefetch schedule


def _schedule(num_items: int, prefetch: int):
    started = []

    def start(item):
        started.append(item)
        return f"copy of {item}"

    return PrefetchSchedule(num_items, prefetch, start, lambda handle: handle.upper()), started


def _use_in_order(schedule, items, phase):
    for item in items:
        value = schedule.acquire(item, phase)
        assert value == f"COPY OF {item}"
        if phase == "forward":
            schedule.prefetch_after(item)
        else:
            schedule.prefetch_before(item, among={0, 2, 3})
        schedule.record(phase, "compute", item)
        schedule.release(item, phase)


def test_prefetch_schedule_fetches_ahead_and_bounds_residency():
    schedule, started = _schedule(4, prefetch=1)
    _use_in_order(schedule, range(4), "forward")
    assert started == [0, 1, 2, 3]  # each item copied once: prefetches are used, not repeated
    assert schedule.log[:4] == [
        ResidencyEvent("forward", "fetch", 0, (0,)),
        ResidencyEvent("forward", "fetch", 1, (0, 1)),  # issued before item 0 computes
        ResidencyEvent("forward", "compute", 0, (0, 1)),
        ResidencyEvent("forward", "release", 0, (1,)),
    ]
    assert max(len(event.resident) for event in schedule.log) == 2  # prefetch + 1
    assert schedule.resident == ()


def test_prefetch_schedule_backward_skips_items_outside_among_and_adopts_copies():
    schedule, started = _schedule(4, prefetch=2)
    _use_in_order(schedule, [3], "backward")
    # Item 1 is not among the items the backward will use: skipped, and item 0 fetched instead.
    assert started == [3, 2, 0]
    schedule.adopt(2, "backward")  # the caller makes item 2's copy itself: the prefetch is dropped
    assert schedule.resident == (0, 2)
    assert schedule.release(2, "backward") is None  # nothing of item 2's was in flight
    assert schedule.release(0, "backward") == "copy of 0"  # handed back, to be waited for
    assert schedule.resident == () and not schedule.holds(0) and started == [3, 2, 0]


def test_prefetch_schedule_copies_a_reused_item_again_and_drains_unused_prefetches():
    schedule, started = _schedule(3, prefetch=1)
    assert schedule.acquire(0, "forward") == "COPY OF 0"
    schedule.prefetch_after(0)  # item 1 is now in flight
    # Item 0 used again while still resident (a unit called twice): a second copy, no prefetch.
    assert schedule.acquire(0, "forward") == "COPY OF 0"
    assert started == [0, 1, 0]
    # Item 1 was prefetched but never used: drain hands its copy back, to be waited for.
    assert schedule.drain("forward") == ["copy of 1"]
    assert schedule.resident == (0,)
    assert schedule.drain("forward") == []


def test_prefetch_schedule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="`num_items` must be an int >= 0"):
        PrefetchSchedule(-1, 1, str, str)
    with pytest.raises(ValueError, match="`prefetch` must be an int >= 0"):
        PrefetchSchedule(2, True, str, str)
    with pytest.raises(TypeError, match="`finish` must be callable"):
        PrefetchSchedule(2, 1, str, None)
