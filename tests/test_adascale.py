"""fs.adascale: the gain by hand, equal to FairScale's AdaScale + torch DDP, and under sharding."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.gain import estimate as est
from fscale.testing import assert_trees_close, run_spmd

STEPS = 4
LR = 0.1


# ---------------------------------------------------------------------------------------------
# The gain derived by hand on a tiny problem (always runs)


def _linear_loss(params, buffers, batch, key):
    inputs, targets = batch
    return ((inputs @ params["w"] - targets) ** 2).mean()


def _hand_reference(inputs, targets, steps, lr, smoothing):
    """One process, one sample per micro-batch, each g_i = 2 (x_i·w − y_i) x_i by hand."""
    w = torch.zeros(2, dtype=torch.float64)
    n = inputs.shape[0]
    biased_sqr = biased_var = unbias = progress = 0.0
    gains = []
    for _ in range(steps):
        per_sample = [2 * (x @ w - y) * x for x, y in zip(inputs, targets)]
        mean = sum(per_sample) / n
        local = sum(float(g @ g) for g in per_sample)
        total = float(mean @ mean)
        var = max(n / (n - 1) * (local / n - total), 1e-6)
        sqr = max(total - (n / (n - 1) * (local / n - total)) / n, 0.0)
        biased_sqr = smoothing * biased_sqr + (1 - smoothing) * sqr
        biased_var = smoothing * biased_var + (1 - smoothing) * var
        unbias = smoothing * unbias + (1 - smoothing)
        v, s = biased_var / unbias, biased_sqr / unbias
        gain = (v + s) / (v / n + s)
        gains.append(gain)
        progress += gain
        w = w - lr * gain * mean
    return w, gains, progress


@pytest.mark.parametrize("smoothing", [None, 0.5])
def test_gain_equals_the_formulas_by_hand(smoothing):
    inputs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]], dtype=torch.float64)
    targets = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    step = fs.accumulate(fs.train_step(_linear_loss, fs.optim.sgd(LR)), 4)
    step = fs.adascale(step, fs.Mesh(dp=1), smoothing=smoothing)
    state = step.init({"w": torch.zeros(2, dtype=torch.float64)})
    gains = []
    for _ in range(STEPS):
        state, metrics = step(state, (inputs, targets))
        gains.append(float(metrics["gain"]))
    expected_w, expected_gains, progress = _hand_reference(
        inputs, targets, STEPS, LR, 0.996 if smoothing is None else smoothing
    )
    assert gains == pytest.approx(expected_gains, rel=1e-12)
    assert 1.0 < expected_gains[0] < 4.0  # noise and signal both present: a gain strictly inside
    assert float(metrics["progress"]) == pytest.approx(progress, rel=1e-12)
    assert_trees_close(state.params["w"], expected_w, rtol=1e-12, atol=1e-12)


def test_pure_noise_gives_the_full_scale_and_the_state_records_it():
    # Two samples whose gradients cancel: T = 0, so mu^2 = 0 and r = S (the example of the docs).
    step = fs.adascale(
        fs.accumulate(fs.train_step(_linear_loss, fs.optim.sgd(LR)), 2), fs.Mesh(dp=1)
    )
    state = step.init({"w": torch.zeros(2)})
    batch = (torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([1.0, -1.0]))
    state, metrics = step(state, batch)
    assert float(metrics["gain"]) == 2.0
    assert isinstance(state.opt_state, fs.AdaScaleState)
    assert (
        float(state.opt_state.stats.scale) == 2.0 and float(state.opt_state.stats.progress) == 2.0
    )


def test_rescale_carries_the_noise_estimate_to_the_new_scale():
    stats = est.update(est.init_stats(4.0), 3.0, 8.0, 0.5)
    moved = est.rescale(stats, 8.0)
    assert float(moved.grad_var) == pytest.approx(float(stats.grad_var) / 2)
    assert float(moved.grad_sqr) == float(stats.grad_sqr) and float(moved.scale) == 8.0
    # r = (var + sqr) / (var / S + sqr) with the debiased averages 8 and 3 at S = 4, then 4 at 8.
    assert est.gain(stats) == pytest.approx(11 / 5)
    assert est.gain(moved) == pytest.approx(7 / 3.5)


# ---------------------------------------------------------------------------------------------
# Equal to FairScale 0.4.13's AdaScale + torch DDP on 2 ranks


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step_index, rank, rows):
    generator = torch.Generator().manual_seed(1000 * step_index + rank)
    inputs = torch.randn(rows, 4, generator=generator)
    targets = torch.randn(rows, 2, generator=generator) + inputs[:, :2]
    return inputs, targets


def _mse_loss(apply):
    def loss_fn(params, buffers, batch, key):
        out, _ = apply(params, buffers, batch[0])
        return ((out - batch[1]) ** 2).mean()

    return loss_fn


def _fscale_and_fairscale(micro_batches, steps):
    from fairscale.optim import AdaScale

    rank = dist.get_rank()
    mesh = fs.Mesh(dp=dist.get_world_size())
    module = _module()
    reference = copy.deepcopy(module)
    apply, params, buffers = fs.functionalize(module)
    inner = fs.accumulate(
        fs.train_step(_mse_loss(apply), fs.optim.sgd(LR, momentum=0.9)), micro_batches
    )
    step = fs.adascale(fs.data_parallel(inner, mesh), mesh)
    state = step.init(params, buffers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = torch.nn.parallel.DistributedDataParallel(reference)
        optimizer = AdaScale(
            torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9),
            num_gradients_to_accumulate=micro_batches,
        )
    ours, theirs = [], []
    for i in range(steps):
        inputs, targets = _batch(i, rank, 2 * micro_batches)
        state, metrics = step(state, (inputs, targets))
        ours.append(est.gain(state.opt_state.stats))
        for j in range(micro_batches):
            rows = slice(2 * j, 2 * j + 2)
            sync = ddp.no_sync() if j < micro_batches - 1 else contextlib.nullcontext()
            with sync:
                loss = ((ddp(inputs[rows]) - targets[rows]) ** 2).mean() / micro_batches
                loss.backward()
        theirs.append(optimizer.gain())
        optimizer.step()
        optimizer.zero_grad()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    return ours, theirs, state.params, expected, float(metrics["progress"])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_matches_fairscale_adascale_with_torch_ddp(micro_batches):
    pytest.importorskip("fairscale", reason="the reference is FairScale's AdaScale")
    for ours, theirs, params, expected, progress in run_spmd(
        _fscale_and_fairscale, 2, micro_batches, STEPS
    ):
        # FairScale sums the local squares in float32, fscale in float64: round-off apart.
        assert ours == pytest.approx(theirs, rel=1e-5)
        assert progress == pytest.approx(sum(theirs), rel=1e-5)
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert max(theirs) > 1.05  # the problem has noise: a gain that scaling must track


# ---------------------------------------------------------------------------------------------
# The same gain and parameters under every data plan


def _under_plans(micro_batches, steps):
    rank = dist.get_rank()
    mesh = fs.Mesh(dp=dist.get_world_size())
    results = {}
    for name in ("data_parallel", "shard_optimizer", "fully_shard", "hsdp"):
        apply, params, buffers = fs.functionalize(fs.models.mlp([4, 8, 2]))
        torch.manual_seed(0)
        params = {k: torch.randn_like(v) for k, v in params.items()}
        inner = fs.accumulate(
            fs.train_step(_mse_loss(apply), fs.optim.sgd(LR, momentum=0.9)), micro_batches
        )
        if name == "hsdp":
            plan, on = _hsdp_plan(inner, mesh)
            step = fs.adascale(plan, on, axis="replica")
        else:
            step = fs.adascale(getattr(fs, name)(inner, mesh), mesh)
        state = step.init(params, buffers)
        gains = []
        for i in range(steps):
            state, metrics = step(state, _batch(i, rank, 2 * micro_batches))
            gains.append(est.gain(state.opt_state.stats))
        results[name] = (gains, fs.consolidate(step, state).params, float(metrics["gain"]))
    return results


def _hsdp_plan(inner, mesh):
    # Replicas over "replica", shards over "dp" of size 1: the shard and replica reductions.
    hybrid = fs.Mesh(replica=mesh.size("dp"), dp=1)
    return fs.fully_shard(inner, hybrid, "dp", replicate_axis="replica"), hybrid


def test_shard_optimizer_and_fully_shard_equal_data_parallel():
    for results in run_spmd(_under_plans, 2, 2, 3):
        gains, params, metric = results["data_parallel"]
        assert metric == pytest.approx(gains[-1], rel=1e-6)  # reported as a metric too
        for name in ("shard_optimizer", "fully_shard", "hsdp"):
            other_gains, other_params, _ = results[name]
            assert other_gains == pytest.approx(gains, rel=1e-6), name
            assert_trees_close(other_params, params, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Changing the scale mid-run: FairScale's set_scale


def _one_process_step(apply, micro_batches, **kwargs):
    inner = fs.accumulate(
        fs.train_step(_mse_loss(apply), fs.optim.sgd(LR, momentum=0.9)), micro_batches
    )
    return fs.adascale(inner, fs.Mesh(dp=1), **kwargs)


def test_scale_change_mid_run_matches_fairscale_set_scale():
    fairscale_optim = pytest.importorskip("fairscale.optim", reason="the reference is FairScale")
    module = _module()
    reference = copy.deepcopy(module)
    apply, params, buffers = fs.functionalize(module)
    optimizer = fairscale_optim.AdaScale(
        torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9),
        world_size=1,
        num_gradients_to_accumulate=2,
    )
    state = _one_process_step(apply, 2).init(params, buffers)
    ours, theirs = [], []
    for phase, micro_batches in enumerate((2, 4)):
        step = _one_process_step(apply, micro_batches)  # the old state carries over
        if phase:
            optimizer.set_num_gradients_to_accumulate(micro_batches)
            optimizer.set_scale(micro_batches)
        for i in range(3):
            inputs, targets = _batch(10 * phase + i, 0, 2 * micro_batches)
            state, metrics = step(state, (inputs, targets))
            ours.append(float(metrics["gain"]))
            for j in range(micro_batches):
                rows = slice(2 * j, 2 * j + 2)
                loss = ((reference(inputs[rows]) - targets[rows]) ** 2).mean() / micro_batches
                loss.backward()
            theirs.append(optimizer.gain())
            optimizer.step()
            optimizer.zero_grad()
    assert float(state.opt_state.stats.scale) == 4.0
    assert ours == pytest.approx(theirs, rel=1e-5)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)


def test_an_explicit_scale_and_a_schedule_over_progress():
    apply, params, buffers = fs.functionalize(_module())
    seen = []

    def schedule(progress):
        seen.append(progress)
        return 0.5

    base = _one_process_step(apply, 2)
    step = _one_process_step(apply, 2, scale=3.0, schedule=schedule)
    plain_state = base.init(params, buffers)
    state = step.init(params, buffers)
    batch = _batch(0, 0, 4)
    new_plain, plain_metrics = base(plain_state, batch)
    new_state, metrics = step(state, batch)
    gain = float(metrics["gain"])
    assert seen == [0.0]  # the schedule reads the progress before this step
    assert 1.0 <= gain <= 3.0 and gain != float(plain_metrics["gain"])
    # The same gradients, so the update is the plain one rescaled by 0.5 * r / r_plain.
    ratio = 0.5 * gain / float(plain_metrics["gain"])
    for name, p in params.items():
        moved = new_state.params[name] - p
        assert_trees_close(moved, ratio * (new_plain.params[name] - p), rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The Adam variant (AdaptDL / Pollux), against a reference computed here


def test_adam_variant_preconditions_the_noise_and_scales_lr_by_the_root_of_the_gain():
    micro_batches, base_lr, beta2, eps = 2, 0.01, 0.99, 1e-8
    module = _module()
    reference = copy.deepcopy(module)
    apply, params, buffers = fs.functionalize(module)
    inner = fs.accumulate(
        fs.train_step(_mse_loss(apply), fs.optim.adam(base_lr, betas=(0.9, beta2), eps=eps)),
        micro_batches,
    )
    step = fs.adascale(inner, fs.Mesh(dp=1), rule="adam", beta2=beta2, eps=eps, warmup=2)
    state = step.init(params, buffers)
    torch_adam = torch.optim.Adam(
        reference.parameters(), lr=base_lr, betas=(0.9, beta2), eps=eps, fused=True
    )
    leaves = list(reference.parameters())
    biased_sqr = biased_var = unbias = 0.0
    smoothing, samples = 1 - micro_batches / 1000, micro_batches
    ours, expected_gains = [], []
    for i in range(5):
        inputs, targets = _batch(i, 0, 2 * micro_batches)
        state, metrics = step(state, (inputs, targets))
        ours.append(float(metrics["gain"]))
        count = int(torch_adam.state[leaves[0]]["step"]) if torch_adam.state else 0
        if count >= 2:
            weights = [
                1 / (torch_adam.state[p]["exp_avg_sq"].sqrt() / (1 - beta2**count) ** 0.5 + eps)
                for p in leaves
            ]
        else:
            weights = [torch.ones_like(p) for p in leaves]
        micro_grads = []
        for j in range(micro_batches):
            rows = slice(2 * j, 2 * j + 2)
            loss = ((reference(inputs[rows]) - targets[rows]) ** 2).mean()
            micro_grads.append(torch.autograd.grad(loss, leaves))
        mean = [sum(g[k] for g in micro_grads) / micro_batches for k in range(len(leaves))]
        local = sum(
            float(((g[k] * weights[k]).double() ** 2).sum())
            for g in micro_grads
            for k in range(len(leaves))
        )
        total = sum(float(((m * w).double() ** 2).sum()) for m, w in zip(mean, weights))
        var = samples / (samples - 1) * (local / samples - total)
        sqr, var = max(total - var / samples, 0.0), max(var, 1e-6)
        biased_sqr = smoothing * biased_sqr + (1 - smoothing) * sqr
        biased_var = smoothing * biased_var + (1 - smoothing) * var
        unbias = smoothing * unbias + (1 - smoothing)
        v, s = biased_var / unbias, biased_sqr / unbias
        gain = (v + s) / (v / samples + s)
        expected_gains.append(gain)
        for p, m in zip(leaves, mean):
            p.grad = m
        torch_adam.param_groups[0]["lr"] = base_lr * gain**0.5
        torch_adam.step()
    assert ours == pytest.approx(expected_gains, rel=1e-5)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)


def test_adam_variant_without_adam_state_or_with_sharded_state_is_refused():
    apply, params, buffers = fs.functionalize(_module())
    step = fs.adascale(
        fs.accumulate(fs.train_step(_mse_loss(apply), fs.optim.sgd(LR)), 2),
        fs.Mesh(dp=1),
        rule="adam",
    )
    state = step.init(params, buffers)
    with pytest.raises(ValueError, match="0 AdamState"):
        step(state, _batch(0, 0, 4))
    sharded = fs.shard_optimizer(
        fs.accumulate(fs.train_step(_mse_loss(apply), fs.optim.adam()), 2), fs.Mesh(dp=1)
    )
    with pytest.raises(ValueError, match=r"rule=.adam.*shards its optimizer state"):
        fs.adascale(sharded, fs.Mesh(dp=1), rule="adam")


# ---------------------------------------------------------------------------------------------
# Bad input


def _plain_step():
    apply, _, _ = fs.functionalize(_module())
    return fs.train_step(_mse_loss(apply), fs.optim.sgd(LR))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 1.0}, r"`smoothing` must lie in \[0, 1\), got smoothing=1.0"),
        ({"smoothing": -0.1}, "`smoothing` must be >= 0"),
        ({"scale": 0.5}, "`scale` must be >= 1"),
        ({"rule": "lars"}, "`rule` must be one of"),
        ({"axis": "tp"}, "the mesh has no axis 'tp'"),
        ({"axis": 3}, "`axis` must be a mesh axis name"),
        ({"schedule": 0.5}, "`schedule` must be a function"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    step = fs.accumulate(_plain_step(), 2)
    with pytest.raises((ValueError, TypeError), match=message):
        fs.adascale(step, fs.Mesh(dp=1), **kwargs)


def test_bad_steps_are_refused():
    with pytest.raises(ValueError, match="one gradient sample"):
        fs.adascale(_plain_step(), fs.Mesh(dp=1))
    with pytest.raises(ValueError, match="grad_mode='autograd'"):
        fs.adascale(fs.accumulate(_plain_step().replace(grad_mode="func"), 2), fs.Mesh(dp=1))
    once = fs.adascale(fs.accumulate(_plain_step(), 2), fs.Mesh(dp=1))
    with pytest.raises(ValueError, match="already adascale"):
        fs.adascale(once, fs.Mesh(dp=1))
    with pytest.raises(TypeError, match="`step` must be a Step"):
        fs.adascale(lambda state, batch: state, fs.Mesh(dp=1))


def test_a_layer_around_adascale_is_refused_at_the_first_step():
    _, params, buffers = fs.functionalize(_module())
    inner = fs.adascale(fs.accumulate(_plain_step(), 2), fs.Mesh(dp=1))
    wrapped = fs.accumulate(inner, 2)
    state = wrapped.init(params, buffers)
    with pytest.raises(ValueError, match="apply adascale last"):
        wrapped(state, _batch(0, 0, 8))


def _axis_the_step_does_not_reduce_over():
    mesh = fs.Mesh(dp=2)
    return [
        _error(fs.adascale, step, mesh, axis="dp")
        for step in (fs.accumulate(_plain_step(), 2), _plain_step())
    ]


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return None


def test_an_axis_the_step_does_not_reduce_over_is_named():
    for errors in run_spmd(_axis_the_step_does_not_reduce_over, 2):
        assert len(errors) == 2
        assert all(
            "`axis` 'dp' is not an axis the step reduces its gradients over" in e for e in errors
        )


# ---------------------------------------------------------------------------------------------
# State in and out, skipped steps


def test_consolidate_and_shard_state_keep_the_statistics():
    apply, params, buffers = fs.functionalize(_module())
    step = _one_process_step(apply, 2)
    state = step.init(params, buffers)
    for i in range(2):
        state, _ = step(state, _batch(i, 0, 4))
    full = fs.consolidate(step, state)
    assert isinstance(full.opt_state, fs.AdaScaleState)
    again = fs.shard_state(step, full)
    continued, metrics = step(state, _batch(2, 0, 4))
    resumed, resumed_metrics = step(again, _batch(2, 0, 4))
    assert float(resumed_metrics["gain"]) == float(metrics["gain"])
    assert_trees_close(resumed.params, continued.params, rtol=0, atol=0)
    assert float(resumed.opt_state.stats.progress) == float(continued.opt_state.stats.progress)


def test_a_skipped_step_leaves_the_statistics_as_they_were():
    apply, params, buffers = fs.functionalize(_module())
    inner = fs.accumulate(fs.train_step(_mse_loss(apply), fs.optim.sgd(LR), on_nonfinite="skip"), 2)
    step = fs.adascale(inner, fs.Mesh(dp=1))
    state, _ = step(step.init(params, buffers), _batch(0, 0, 4))
    inputs, targets = _batch(1, 0, 4)
    targets[0, 0] = float("inf")
    skipped, metrics = step(state, (inputs, targets))
    assert float(metrics["skipped"]) == 1.0
    assert skipped.opt_state.stats == state.opt_state.stats
    assert_trees_close(skipped.params, state.params, rtol=0, atol=0)


class _TwiceUsedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks[0](torch.tanh(self.blocks[0](x))))


def test_a_unit_called_twice_under_fully_shard_is_refused():
    apply, params, buffers = fs.functionalize(_TwiceUsedBlock())
    inner = fs.accumulate(fs.train_step(_mse_loss(apply), fs.optim.sgd(LR)), 2)
    step = fs.adascale(fs.fully_shard(inner, fs.Mesh(dp=1)), fs.Mesh(dp=1))
    state = step.init(params, buffers)
    with pytest.raises(ValueError, match=r"unit 'blocks\.0' was called more than once"):
        step(state, _batch(0, 0, 4))


def _loss_reporting_gain(params, buffers, batch, key):
    return _linear_loss(params, buffers, batch, key), buffers, {"gain": torch.tensor(1.0)}


def test_a_loss_metric_named_like_adascale_s_is_refused():
    step = fs.adascale(
        fs.accumulate(fs.train_step(_loss_reporting_gain, fs.optim.sgd(LR)), 2), fs.Mesh(dp=1)
    )
    state = step.init({"w": torch.zeros(2)})
    batch = (torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="metric named 'gain'"):
        step(state, batch)
