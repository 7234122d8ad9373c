"""fs.mixed_precision and fs.loss_scale around fs.pipeline: bf16 stages bit for bit against a
reference written here, activations on the wire in the policy's dtype, and one skip decision
(and one scale) on every stage when only one stage overflows.

What is exact and what is not: each micro-batch's bf16 backward gives the same bits pipelined
or not, and its fp32 weight gradient joins the sum in micro-batch order, so the pipeline equals
a reference that sums the per-micro-batch fp32 gradients in that order bit for bit (1 and 2
data-parallel ranks: two fp32 summands add the same either way round). Against the unsplit
batch the bf16 partial sums are rounded at other places, so that comparison (and a loss-scaled
fp32 pipeline against one process on the whole batch) is within round-off only.
"""

from __future__ import annotations

import math

import pytest
import torch

import fscale as fs
from fscale import tree
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

BF16 = torch.bfloat16
LR = 0.1
MICRO = 4
# Per-process injection factor for the last stage's weight gradient (inf: overflow), and the
# dtypes the stages saw; the pool's rank processes run one test function at a time.
_INJECT = [1.0]
_SEEN: list[tuple[torch.dtype, torch.dtype]] = []


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by a factor (an injected inf)."""

    @staticmethod
    def forward(w: torch.Tensor, factor: float) -> torch.Tensor:
        return w.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _first(p, b, x, key):
    return torch.tanh(x @ p["w"]), b


def _last(p, b, x, key):
    _SEEN.append((x.dtype, p["w"].dtype))
    return x @ _ScaleGrad.apply(p["w"], _INJECT[0])


def _mse(out, targets):
    return ((out - targets) ** 2).mean()


def _full_loss(p, b, data, key):
    hidden = torch.tanh(data[0] @ p[0]["w"])
    return _mse(hidden @ _ScaleGrad.apply(p[1]["w"], _INJECT[0]), data[1])


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(4, 6, generator=g) * 0.5}, {"w": torch.randn(6, 3, generator=g)}]


def _data(size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 4, generator=g), torch.randn(size, 3, generator=g)


def _reference_grads(params, inputs, targets):
    """fp32 gradients of the bf16 model: per micro-batch, bf16 casts of the fp32 masters and of
    the batch, the mean loss weighted by 1/M, the gradient cast back to fp32 at the master,
    summed over micro-batches in order."""
    total = None
    for x, t in zip(inputs.to(BF16).chunk(MICRO), targets.to(BF16).chunk(MICRO)):
        masters = [piece["w"].detach().requires_grad_(True) for piece in params]
        cast = [w.to(BF16) for w in masters]
        root = _mse(torch.tanh(x @ cast[0]) @ cast[1], t) * (1.0 / MICRO)
        grads = torch.autograd.grad(root, masters)
        total = list(grads) if total is None else [a + g for a, g in zip(total, grads)]
    assert total is not None
    return total


def _sgd(params, grads):
    tensors = [piece["w"].clone() for piece in params]
    optimizer = torch.optim.SGD(tensors, lr=LR)
    for w, g in zip(tensors, grads):
        w.grad = g
    optimizer.step()
    return [{"w": w} for w in tensors]


def _bf16_pipeline(schedule, dp, steps=2):
    mesh = fs.Mesh(dp=dp, pp=2) if dp > 1 else fs.Mesh(pp=2)
    per_stage = (lambda s: fs.data_parallel(s, mesh, "dp")) if dp > 1 else None
    step = fs.pipeline(
        [_first, _last],
        _mse,
        fs.optim.sgd(LR),
        mesh,
        micro_batches=MICRO,
        schedule=schedule,
        per_stage=per_stage,
    )
    step = fs.mixed_precision(step, param_dtype=BF16)
    inputs, targets = _data(8 * dp)
    rank = mesh.rank("dp") if dp > 1 else 0
    local = (inputs[rank * 8 : (rank + 1) * 8], targets[rank * 8 : (rank + 1) * 8])
    _SEEN.clear()
    state = step.init(_model(), None)
    for _ in range(steps):
        state, _ = step(state, local)
    full = fs.consolidate(step, state)
    seen = sorted(set(_SEEN), key=str)
    expected = _model()
    for _ in range(steps):
        per_rank = [
            _reference_grads(expected, inputs[r * 8 : (r + 1) * 8], targets[r * 8 : (r + 1) * 8])
            for r in range(dp)
        ]
        grads = per_rank[0] if dp == 1 else [(a + b) / 2 for a, b in zip(*per_rank)]
        expected = _sgd(expected, grads)
    unsplit = _model()
    for _ in range(steps):
        masters = [piece["w"].detach().requires_grad_(True) for piece in unsplit]
        x, t = inputs.to(BF16), targets.to(BF16)
        loss = _mse(torch.tanh(x @ masters[0].to(BF16)) @ masters[1].to(BF16), t)
        unsplit = _sgd(unsplit, torch.autograd.grad(loss, masters))
    return full.params, expected, unsplit, seen, full.params[0]["w"].dtype


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bf16_pipeline_equals_the_reference_bit_for_bit(schedule):
    results = run_spmd(_bf16_pipeline, 2, schedule, 1)
    for params, expected, unsplit, _, dtype in results:
        assert dtype == torch.float32  # the masters stay fp32
        assert_trees_equal(params, expected)
        assert_trees_close(params, unsplit, rtol=2e-2, atol=2e-2)
    # the last stage (rank 1) received bf16 activations and computed with bf16 weights
    assert results[1][3] == [(BF16, BF16)]


def test_bf16_pipeline_times_data_parallel_reduces_fp32_gradients_bit_for_bit():
    for params, expected, _, _, dtype in run_spmd(_bf16_pipeline, 4, "1f1b", 2):
        assert dtype == torch.float32
        assert_trees_equal(params, expected)


# ---- loss scaling ---------------------------------------------------------------------------


def _loss_scaled(injections, precision, steps=4):
    mesh = fs.Mesh(pp=2)
    step = fs.pipeline([_first, _last], _mse, fs.optim.sgd(LR), mesh, micro_batches=MICRO)
    step = fs.loss_scale(step, init=2.0**10, growth_interval=2)
    plain = fs.train_step(_full_loss, fs.optim.sgd(LR))
    plain = fs.loss_scale(plain, init=2.0**10, growth_interval=2)
    if precision is not None:
        step = fs.mixed_precision(step, param_dtype=precision, output_dtype=torch.float32)
        plain = fs.mixed_precision(plain, param_dtype=precision, output_dtype=torch.float32)
    batch = _data(8)
    _INJECT[0] = math.inf
    grads, _ = step.gradients(step.init(_model(), None), batch)
    _INJECT[0] = 1.0
    finite_here = all(bool(torch.isfinite(g).all()) for g in tree.leaves(grads))
    runs = []
    for which in (step, plain):
        state = which.init(_model(), None)
        history = []
        for i in range(steps):
            _INJECT[0] = math.inf if i in injections else 1.0
            state, metrics = which(state, batch)
            history.append((float(metrics["skipped"]), metrics["loss_scale"]))
        _INJECT[0] = 1.0
        full = fs.consolidate(which, state) if which is step else state
        runs.append((history, full.params))
    return runs, finite_here


@pytest.mark.parametrize(("injections", "precision"), [({1}, None), ({0, 2}, torch.float16)])
def test_an_overflow_on_one_stage_skips_every_stage(injections, precision):
    """The infinity reaches the last stage's weight gradient only (rank 1): rank 0's gradients
    are finite, yet it skips the same steps and backs off the scale alike."""
    results = run_spmd(_loss_scaled, 2, injections, precision)
    expected_skips = [float(i in injections) for i in range(4)]
    tolerance = 1e-6 if precision is None else 5e-3
    assert [finite for _, finite in results] == [True, False]
    for ((history, params), (plain_history, plain_params)), _ in results:
        assert [s for s, _ in history] == expected_skips
        assert history == plain_history
        assert params[0]["w"].dtype == torch.float32
        assert_trees_close(params, plain_params, rtol=tolerance, atol=tolerance)
    assert results[0][0][0][0] == results[1][0][0][0]


def _counting(p, b, x, key):
    _SEEN.append((b["n"].dtype, p["w"].dtype))
    return torch.tanh(x @ p["w"]), {"n": b["n"] + 1}


def test_buffers_are_seen_in_buffer_dtype_and_kept_in_their_own():
    step = fs.pipeline([_counting], _mse, fs.optim.sgd(LR), fs.Mesh(pp=1), micro_batches=2)
    step = fs.mixed_precision(step, param_dtype=BF16, buffer_dtype=torch.float16)
    _SEEN.clear()
    state = step.init([_model()[0]], [{"n": torch.zeros(())}])
    inputs, _ = _data(4)
    state, _ = step(state, (inputs, torch.zeros(4, 6)))
    assert set(_SEEN) == {(torch.float16, BF16)}
    (buffers,) = fs.consolidate(step, state).buffers
    assert buffers["n"].dtype == torch.float32  # one count per micro-batch
    assert float(buffers["n"].detach()) == 2.0
    assert state.params[0]["w"].dtype == torch.float32


def test_the_plan_shows_the_wire_dtype_of_the_pipeline():
    mesh = fs.Mesh(dp=1, pp=1)
    step = fs.pipeline(
        [_first],
        _mse,
        fs.optim.sgd(LR),
        mesh,
        micro_batches=1,
        per_stage=lambda s: fs.data_parallel(s, mesh, "dp"),
    )
    text = repr(fs.mixed_precision(step, param_dtype=BF16).plan)
    assert "pipeline[pp]: send activations and their gradients bfloat16" in text
    assert "data_parallel[dp]: all_reduce grads float32" in text


def _tiny_loss(out, targets):
    # fp32 before the factor: the scale, not the loss's dtype, must keep fp16's backward in range
    return _mse(out.float(), targets.float()) * 1e-9


def test_the_scale_reaches_each_micro_batchs_float16_backward():
    """Gradients of ~1e-9 flush to zero in float16 unless the scale is in the backward itself."""
    scale = 2.0**20

    def build(precision):
        step = fs.pipeline([_first], _tiny_loss, fs.optim.sgd(LR), fs.Mesh(pp=1), micro_batches=2)
        if precision is None:
            return step
        step = fs.loss_scale(step, init=scale)
        return fs.mixed_precision(step, param_dtype=precision, output_dtype=torch.float32)

    batch = (_data(4)[0], torch.zeros(4, 6))
    params = [_model()[0]]
    low = build(torch.float16)
    scaled, _ = low.gradients(low.init(params, None), batch)
    exact, _ = build(None).gradients(build(None).init(params, None), batch)
    scaled_w, exact_w = scaled[0]["w"], exact[0]["w"]
    assert scaled_w.dtype == torch.float32 and bool((scaled_w != 0).all())
    torch.testing.assert_close(scaled_w / scale, exact_w, rtol=1e-2, atol=1e-12)


# ---- refusals -------------------------------------------------------------------------------


def test_a_policy_inside_the_pipeline_or_over_fully_sharded_stages_is_refused():
    mesh = fs.Mesh(dp=1, pp=1)

    def build(per_stage):
        return fs.pipeline(
            [_first], _mse, fs.optim.sgd(LR), mesh, micro_batches=1, per_stage=per_stage
        )

    inside = build(lambda s: fs.mixed_precision(s))
    with pytest.raises(ValueError, match="applied inside the pipeline"):
        inside.init([_model()[0]], None)
    with pytest.raises(ValueError, match="fully sharded"):
        fs.mixed_precision(build(lambda s: fs.fully_shard(s, mesh, "dp")))
