"""mixed_precision on one process: the policy's checks, casts, state bytes and description."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fscale as fs
from fscale.memory import tree_bytes
from fscale.precision import cast_floating, make_policy
from fscale.precision.policy import narrower_or_equal
from fscale.testing import assert_trees_equal
from fscale.testing import strategies as fst

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _case(kind: str = "gpt") -> fst.ModelCase:
    return fst.ModelCase(kind, width=8, depth=2, seed=3)


def _step(case: fst.ModelCase, opt: fs.optim.Optimizer | None = None):
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.train_step(case.loss_fn(apply), opt or fs.optim.adam(1e-2))
    return step, params, buffers, apply


# ---- the policy's checks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"param_dtype": torch.int8}, "param_dtype"),
        ({"param_dtype": FP64}, "param_dtype"),
        ({"param_dtype": "bfloat16"}, "param_dtype"),
        ({"param_dtype": BF16, "reduce_dtype": torch.int32}, "reduce_dtype"),
        ({"param_dtype": BF16, "master_dtype": BF16, "reduce_dtype": BF16}, "master_dtype"),
        ({"param_dtype": FP32, "reduce_dtype": BF16}, "reduce_dtype"),
        ({"param_dtype": BF16, "reduce_dtype": FP16}, "reduce_dtype"),
        ({"param_dtype": BF16, "reduce_dtype": FP64}, "reduce_dtype"),
        ({"param_dtype": BF16, "buffer_dtype": torch.int64}, "buffer_dtype"),
        ({"param_dtype": BF16, "output_dtype": 3}, "output_dtype"),
    ],
)
def test_a_policy_that_cannot_be_honoured_is_refused_naming_the_argument(kwargs, argument):
    step, *_ = _step(_case())
    with pytest.raises((TypeError, ValueError), match=f"`{argument}`"):
        fs.mixed_precision(step, **kwargs)


def test_casts_touch_floating_point_leaves_only():
    values = {"w": torch.ones(2), "ids": torch.arange(3), "half": torch.ones(1, dtype=FP16)}
    cast = cast_floating(values, BF16)
    assert {k: v.dtype for k, v in cast.items()} == {"w": BF16, "ids": torch.int64, "half": BF16}
    assert cast["ids"] is values["ids"]
    assert cast_floating(values, FP32)["w"] is values["w"]  # no copy when already in dtype


def test_the_policy_orders_dtypes_by_what_they_hold():
    assert narrower_or_equal(BF16, FP32) and narrower_or_equal(FP16, FP64)
    assert not narrower_or_equal(BF16, FP16) and not narrower_or_equal(FP16, BF16)
    assert not narrower_or_equal(FP32, BF16)
    assert make_policy(BF16).reduce_dtype == FP32
    assert make_policy(BF16, BF16).reduces_below_master
    assert make_policy(FP16, FP32, FP64).master_dtype == FP64
    assert not make_policy(FP32).casts_params


def test_float16_without_a_loss_scale_is_warned_about_and_bfloat16_is_not():
    step, *_ = _step(_case())
    with pytest.warns(UserWarning, match=r"fs\.loss_scale"):
        fs.mixed_precision(step, param_dtype=FP16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.mixed_precision(step, param_dtype=BF16)


class _LossScaleLayer(fs.Plan):
    """A pass-through layer with the name `fs.loss_scale`'s layer has."""

    def __init__(self, inner: fs.Plan) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return "loss_scale"


def test_float16_inside_a_loss_scale_layer_is_not_warned_about():
    step, *_ = _step(_case())
    scaled = step.replace(plan=_LossScaleLayer(step.plan))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.mixed_precision(scaled, param_dtype=FP16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.mixed_precision(fs.loss_scale(step), param_dtype=FP16)


def test_float16_with_a_loss_scale_equals_the_casts_written_by_hand():
    """fp16 policy around `fs.loss_scale`: the scaled fp16 backward, the skip and the backoff
    are those of the same casts written in the loss function, bit for bit."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    apply, params, buffers = fs.functionalize(model)

    def plain(p, b, batch, key):
        x, y = batch
        out, _ = apply(p, b, x)
        return ((out - y) ** 2).mean()

    def by_hand(p, b, batch, key):
        x, y = batch
        out, _ = apply({k: v.half() for k, v in p.items()}, b, x.half())
        return ((out - y.half()) ** 2).mean().float()

    opt = fs.optim.adamw(1e-2)
    scale = {"init": 2.0**17, "growth_interval": 2}  # the first steps overflow in fp16
    policy = fs.mixed_precision(
        fs.loss_scale(fs.train_step(plain, opt), **scale),
        param_dtype=FP16,
        output_dtype=FP32,
    )
    written = fs.loss_scale(fs.train_step(by_hand, opt), **scale)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(6)
    ]
    a, b = policy.init(params, buffers), written.init(params, buffers)
    skipped = []
    for batch in batches:
        a, ma = policy(a, batch)
        b, mb = written(b, batch)
        assert ma["loss_scale"] == mb["loss_scale"]
        skipped.append(float(ma["skipped"]))
    assert_trees_equal(a.params, b.params)
    assert skipped[0] == 1.0 and 0.0 in skipped  # overflowed, backed off, then trained


def test_plans_it_cannot_honour_are_refused():
    step, params, buffers, _ = _step(_case())
    mesh = fs.Mesh(dp=1)
    with pytest.raises(ValueError, match="`reduce_dtype`=bfloat16 cannot be honoured by data_par"):
        fs.mixed_precision(fs.data_parallel(step, mesh), reduce_dtype=BF16)
    later = fs.shard_optimizer(fs.mixed_precision(step, reduce_dtype=BF16), mesh)
    with pytest.raises(ValueError, match="`reduce_dtype`=bfloat16 cannot be honoured by shard_opt"):
        later.init(params, buffers)
    with pytest.raises(ValueError, match="already has a mixed-precision policy"):
        fs.mixed_precision(fs.mixed_precision(step))
    stages = fs.pipeline(
        [nn.Linear(3, 3)],
        lambda out, target: ((out - target) ** 2).mean(),
        fs.optim.sgd(0.1),
        fs.Mesh(pp=1),
        micro_batches=1,
        balance=[1],
        per_stage=fs.mixed_precision,
    )
    with pytest.raises(ValueError, match="applied inside the pipeline"):
        fs.mixed_precision(stages)
    with pytest.raises(TypeError, match="`step` must be a Step"):
        fs.mixed_precision(step.loss_fn)


def test_params_that_are_not_master_weights_are_refused_at_init():
    step, params, buffers, _ = _step(_case())
    low = {name: value.to(BF16) for name, value in params.items()}
    with pytest.raises(ValueError, match="`master_dtype`=float32"):
        fs.mixed_precision(step).init(low, buffers)


# ---- numerics ---------------------------------------------------------------------------------


def _reference(case, params, buffers, apply, steps, dtype, micro_batches=1):
    """fp32 master weights and torch.optim.Adam; the forward on `dtype` casts of the params."""
    master = {k: nn.Parameter(v.detach().clone()) for k, v in params.items()}
    optimizer = torch.optim.Adam(master.values(), lr=1e-2, fused=True)
    loss_fn = case.loss_fn(apply)
    losses = []
    for i in range(steps):
        batch = case.batch(8, seed=i)
        grads = None
        for m in range(micro_batches):
            micro = fs.data.split_batch(batch, m, micro_batches)
            low = {k: v.to(dtype) for k, v in master.items()}
            loss, _ = loss_fn(low, buffers, micro, fs.random.key(0))
            g = torch.autograd.grad(loss * (1.0 / micro_batches), list(master.values()))
            grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
            losses.append(loss.detach())
        for p, g in zip(master.values(), grads):
            p.grad = g
        optimizer.step()
    return {k: v.detach() for k, v in master.items()}, losses


@pytest.mark.parametrize(("dtype", "micro_batches"), [(BF16, 1), (BF16, 2), (FP16, 1)])
def test_low_precision_training_equals_the_reference_bit_for_bit(dtype, micro_batches):
    case = _case()
    step, params, buffers, apply = _step(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # float16 without a loss scale
        step = fs.mixed_precision(step, param_dtype=dtype)
    if micro_batches > 1:
        step = fs.accumulate(step, micro_batches)
    state = step.init(params, buffers)
    for i in range(3):
        state, metrics = step(state, case.batch(8, seed=i))
    expected, _ = _reference(case, params, buffers, apply, 3, dtype, micro_batches)
    assert_trees_equal(state.params, expected)
    assert metrics["loss"].dtype == dtype
    assert all(p.dtype == FP32 for p in state.params.values())


def test_a_float32_policy_changes_nothing():
    case = _case()
    step, params, buffers, _ = _step(case)
    fp32 = fs.mixed_precision(step, FP32)
    plain, policed = step.init(params, buffers), fp32.init(params, buffers)
    for i in range(2):
        plain, _ = step(plain, case.batch(8, seed=i))
        policed, _ = fp32(policed, case.batch(8, seed=i))
    assert_trees_equal(policed.params, plain.params)
    assert_trees_equal(policed.opt_state, plain.opt_state)


def test_the_torch_func_path_equals_the_autograd_path():
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    results = []
    for grad_mode in ("autograd", "func"):
        step = fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2), grad_mode=grad_mode)
        step = fs.mixed_precision(step)
        state = step.init(params, buffers)
        state, _ = step(state, case.batch(8, seed=0))
        results.append(state.params)
    assert_trees_equal(results[0], results[1])


def test_buffers_and_the_loss_are_cast_as_the_policy_says():
    seen = {}

    def loss_fn(params, buffers, batch, key):
        seen.update(param=params["w"].dtype, buffer=buffers["scale"].dtype, batch=batch.dtype)
        new_scale = buffers["scale"] * 2
        return (params["w"] * batch).sum() * buffers["scale"].sum(), {"scale": new_scale}

    step = fs.mixed_precision(
        fs.train_step(loss_fn, fs.optim.sgd(0.1)), buffer_dtype=BF16, output_dtype=FP64
    )
    state = step.init({"w": torch.ones(3)}, {"scale": torch.ones(2)})
    state, metrics = step(state, torch.ones(3))
    assert seen == {"param": BF16, "buffer": BF16, "batch": BF16}
    assert metrics["loss"].dtype == FP64
    assert state.buffers["scale"].dtype == FP32  # back in the state's dtype
    assert torch.equal(state.buffers["scale"], torch.full((2,), 2.0))


# ---- memory -----------------------------------------------------------------------------------


def test_state_and_working_copy_bytes_are_exactly_the_policys():
    """bf16 params + fp32 master + Adam: 4Ψ + 8Ψ bytes of state, and the 2Ψ-byte bf16 copy
    the forward sees is a working buffer (it is what the loss receives, not in the state)."""
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    psi = sum(p.numel() for p in params.values())
    model_loss = case.loss_fn(apply)
    working = []

    def loss_fn(p, b, batch, key):
        working.append(tree_bytes(p))
        return model_loss(p, b, batch, key)

    step = fs.mixed_precision(fs.train_step(loss_fn, fs.optim.adam(1e-2)))
    state = step.init(params, buffers)
    state, _ = step(state, case.batch(8, seed=0))
    assert working == [2 * psi]
    assert tree_bytes(state.params) == 4 * psi
    moments = tree_bytes((state.opt_state.exp_avg, state.opt_state.exp_avg_sq))
    assert moments == 8 * psi


def test_the_ledger_selects_records_by_dtype():
    ledger = fs.distributed.CommLedger()
    ledger.records.append(fs.distributed.CommRecord("all_gather", "dp", BF16, 8, 8.0, 2))
    ledger.records.append(fs.distributed.CommRecord("all_gather", "dp", FP32, 8, 16.0, 2))
    assert ledger.count(dtype=BF16) == 1
    assert ledger.total_bytes("all_gather", "dp", FP32) == 16.0
    assert ledger.total_elements(dtype=BF16) == 4.0
    with pytest.raises(TypeError, match="`dtype`"):
        ledger.count(dtype="bf16")


# ---- description ------------------------------------------------------------------------------


def test_print_step_shows_each_collectives_dtype():
    step, *_ = _step(_case())
    mesh = fs.Mesh(replica=1, dp=1)
    hsdp = fs.mixed_precision(fs.fully_shard(step, mesh, "dp", replicate_axis="replica"))
    text = repr(hsdp)
    policy = "param_dtype=bfloat16, reduce_dtype=float32, master_dtype=float32"
    assert f"mixed_precision({policy})" in text
    assert "data_parallel[replica]: all_reduce grads float32" in text
    assert "fully_shard[dp]: all_gather params bfloat16, reduce_scatter grads float32" in text
    zero = repr(fs.shard_optimizer(fs.mixed_precision(step), fs.Mesh(dp=1)))
    assert "shard_optimizer[dp]: reduce_scatter grads float32, all_gather params float32" in zero
    assert "collectives: none (one process)" in repr(fs.mixed_precision(step))
