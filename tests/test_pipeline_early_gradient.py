"""Unsplit schedules: a stage fed by another rank sends its input's gradient before computing its
linear layers' weight gradients: the one backward it replaces, bit for bit for one micro-batch,
and within rounding once later micro-batches' products are accumulated into the sums."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mlp_pipeline import mlp_on_two_ranks
from torch import nn

import fscale as fs
from fscale.parallel.pipeline import one_f_one_b, simulate
from fscale.parallel.pipeline.stages import module_stages
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd


def _model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)
    )


def _step(model, schedule, balance, checkpoint="never", micro_batches=4):
    """`model` on two ranks, `micro_batches` micro-batches, and a batch of 8 samples."""
    step, (_, params, buffers), batch = mlp_on_two_ranks(
        model, 8, schedule, balance, micro_batches, 12, checkpoint=checkpoint
    )
    return step, params, buffers, batch


def _without_the_early_send(step):
    """The same step with every stage's backward as one autograd call (the reference)."""
    stages = step.plan.stages
    plain = dataclasses.replace(stages, deferrable=(False,) * len(stages))
    object.__setattr__(step.plan, "stages", plain)
    return step


def _trained(schedule, balance, checkpoint, early, micro_batches):
    step, params, buffers, batch = _step(_model(), schedule, balance, checkpoint, micro_batches)
    if not early:
        step = _without_the_early_send(step)
    state = step.init(params, buffers)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.params, state.opt_state, losses


@pytest.mark.parametrize(("schedule", "balance"), [("gpipe", [2, 3]), ("1f1b", [2, 3])])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_early_send_gives_the_bits_of_one_backward_for_one_micro_batch(
    schedule, balance, checkpoint
):
    # One micro-batch per step: every weight gradient is one product, as autograd computes it.
    early = run_spmd(_trained, 2, schedule, balance, checkpoint, True, 1)
    plain = run_spmd(_trained, 2, schedule, balance, checkpoint, False, 1)
    for (params, opt_state, losses), (params0, opt_state0, losses0) in zip(early, plain):
        assert_trees_equal(params, params0)
        assert_trees_equal(opt_state, opt_state0)
        assert losses == losses0


@pytest.mark.parametrize(
    ("schedule", "balance"),
    [("gpipe", [2, 3]), ("1f1b", [2, 3]), ("interleaved", [1, 1, 2, 1])],
)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_early_send_gives_one_backward_s_result_within_rounding(schedule, balance, checkpoint):
    # Four micro-batches: the later products are accumulated into the sums by the products
    # themselves (`deferred_linear`), equal to autograd's product-then-add within rounding.
    early = run_spmd(_trained, 2, schedule, balance, checkpoint, True, 4)
    plain = run_spmd(_trained, 2, schedule, balance, checkpoint, False, 4)
    for (params, opt_state, losses), (params0, opt_state0, losses0) in zip(early, plain):
        assert_trees_close(params, params0, rtol=1e-5, atol=1e-7)
        _assert_within_rounding_of_each_leaf_s_scale(opt_state, opt_state0)
        assert losses == pytest.approx(losses0, rel=1e-6)


def _assert_within_rounding_of_each_leaf_s_scale(actual, expected, ulps=16):
    """Every element within `ulps` units in the last place of its leaf's largest magnitude.

    The sums add the same products in another order, so an element whose terms cancel to a
    small value keeps an error of the size of its terms, not of itself: a moment of -2.0e-4 in
    a leaf whose terms reach 5e-2 differed by 3.7e-9 under torch 2.6's BLAS, 1.8e-5 of itself
    and half a unit in the last place of the leaf's scale."""
    paths, leaves, _ = fs.tree.flatten_with_paths(actual)
    _, expected_leaves, _ = fs.tree.flatten_with_paths(expected)
    assert len(leaves) == len(expected_leaves)
    for path, got, want in zip(paths, leaves, expected_leaves):
        if not torch.is_floating_point(want):
            assert torch.equal(got, want), path
            continue
        scale = float(want.abs().max()) if want.numel() else 0.0
        bound = ulps * torch.finfo(want.dtype).eps * scale
        error = float((got - want).abs().max()) if want.numel() else 0.0
        assert error <= bound, f"{path}: max abs error {error:.3g} over {bound:.3g}"


class _UnderAutocast(nn.Module):
    """A linear layer that computes in bfloat16 under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def _trained_with(layer_class, early, micro_batches=4):
    """Three 1F1B steps of a model whose second stage starts with `layer_class()`."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), layer_class(), nn.Linear(6, 3))
    step, params, buffers, batch = _step(model, "1f1b", [2, 2], micro_batches=micro_batches)
    if not early:
        step = _without_the_early_send(step)
    state = step.init(params, buffers)
    for _ in range(3):
        state, _ = step(state, batch)
    return state.params


def test_a_stage_with_a_layer_under_autocast_sends_early_and_trains_as_one_backward():
    # The autocast layer's weight gradient stays autograd's (cast back to float32); the
    # stage's plain last layer still waits for the send.
    early = run_spmd(_trained_with, 2, _UnderAutocast, True, 1)
    plain = run_spmd(_trained_with, 2, _UnderAutocast, False, 1)
    for params, params0 in zip(early, plain):
        assert all(t.dtype == torch.float32 for t in fs.tree.leaves(params))
        assert_trees_equal(params, params0)


def _events(schedule, balance):
    from fscale.parallel.pipeline import deferred_linear, transport

    step, params, buffers, batch = _step(_model(), schedule, balance)
    state, _ = step(step.init(params, buffers), batch)  # the first step checks contracts
    events: list[str] = []
    post, weight_grads = transport.Mailbox.post, deferred_linear.LinearStore.add_weight_grads

    def posted(self, tensor, comm, to, tag):
        events.append("send")
        post(self, tensor, comm, to, tag)

    def deferred(self, sums):
        events.append(f"W{len(self.entries)}")
        weight_grads(self, sums)

    transport.Mailbox.post = posted  # type: ignore[method-assign]
    deferred_linear.LinearStore.add_weight_grads = deferred  # type: ignore[method-assign]
    try:
        step(state, batch)
    finally:
        transport.Mailbox.post = post  # type: ignore[method-assign]
        deferred_linear.LinearStore.add_weight_grads = weight_grads  # type: ignore[method-assign]
    return events


def test_a_stage_sends_its_input_gradient_before_its_weight_gradients():
    stage0, stage1 = run_spmd(_events, 2, "1f1b", [2, 3])
    # The first stage sends one activation per micro-batch; its input needs no gradient, so
    # its backward stays one call.
    assert stage0 == ["send"] * 4
    # The second (two linear layers and a norm) sends each micro-batch's input gradient, then
    # computes the two layers' weight gradients; the loss goes once, after its last forward.
    assert stage1 == ["send", "W2"] * 3 + ["send"] + ["send", "W2"]


def _timed_with_slow_weight_gradients():
    import time

    from fscale.parallel.pipeline import deferred_linear, record_timeline

    step, params, buffers, batch = _step(_model(), "1f1b", [2, 3])
    state, _ = step(step.init(params, buffers), batch)
    weight_grads = deferred_linear.LinearStore.add_weight_grads

    def slow(self, sums):
        time.sleep(0.02)
        weight_grads(self, sums)

    deferred_linear.LinearStore.add_weight_grads = slow  # type: ignore[method-assign]
    try:
        with record_timeline(activations=False) as timeline:
            step(state, batch)
    finally:
        deferred_linear.LinearStore.add_weight_grads = weight_grads  # type: ignore[method-assign]
    return timeline.steps[0]


def test_the_timeline_records_when_a_backward_sent_before_its_weight_gradients():
    first, second = run_spmd(_timed_with_slow_weight_gradients, 2)
    # The first stage sends nothing early (its backward is one call).
    assert first.sends() == {} and all(a.sent is None for a in first.actions)
    backwards = [a for a in second.actions if a.kind == "B"]
    assert set(second.sends()) == {("B", m, 1) for m in range(4)}
    for action in backwards:
        # Sent, then at least the 20 ms of its weight gradients.
        assert action.sent is not None and 0 <= action.sent <= action.busy - 0.02
    # Simulated with the sends, the first stage's last backward starts that much sooner.
    table = one_f_one_b(2, 4)
    costs = {**first.costs(), **second.costs()}
    late = simulate(table, costs)
    early = simulate(table, costs, sends=second.sends())
    last = ("B", 3, 1)
    assert (
        early.starts[("B", 3, 0)]
        <= late.starts[("B", 3, 0)] - (costs[last] - second.sends()[last]) + 1e-9
    )


def _deferred_under_policy():
    from fscale.parallel.pipeline import deferred_linear

    step, params, buffers, batch = _step(_model(), "1f1b", [2, 3])
    step = fs.mixed_precision(step, param_dtype=torch.bfloat16)
    state, _ = step(step.init(params, buffers), batch)
    calls: list[int] = []
    weight_grads = deferred_linear.LinearStore.add_weight_grads

    def deferred(self, sums):
        calls.append(len(self.entries))
        weight_grads(self, sums)

    deferred_linear.LinearStore.add_weight_grads = deferred  # type: ignore[method-assign]
    try:
        step(state, batch)
    finally:
        deferred_linear.LinearStore.add_weight_grads = weight_grads  # type: ignore[method-assign]
    return calls


def test_a_mixed_precision_pipeline_keeps_one_backward():
    # Weights seen through a cast are not the leaves the deferral looks for: one backward.
    assert run_spmd(_deferred_under_policy, 2) == [[], []]


def test_only_module_stages_with_plain_linear_layers_can_defer():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 3))
    assert module_stages(model, [1, 1, 1], "t").deferrable == (True, False, True)
    functions = fs.parallel.pipeline.stages.function_stages([lambda p, b, x, k: x] * 2, "t")
    assert functions.deferrable == (False, False)


class _SharedWeight(nn.Module):
    """A linear layer whose weight the stage also uses outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) + (x @ self.out.weight.T).sin()


def test_a_weight_also_used_outside_its_layer_gets_both_parts():
    # Its two parts join the sum one after the other: equal to one backward within rounding.
    for early, plain in zip(
        run_spmd(_trained_with, 2, _SharedWeight, True),
        run_spmd(_trained_with, 2, _SharedWeight, False),
    ):
        assert_trees_close(early, plain, rtol=1e-6, atol=1e-7)


def _recording_forwards(schedule, balance):
    """How many of this rank's stage forwards recorded their linear layers in one step."""
    from fscale.parallel.pipeline import runner

    entered = []
    deferring = runner.deferring

    def counted(weights):
        entered.append(len(weights))
        return deferring(weights)

    runner.deferring = counted
    try:
        step, params, buffers, batch = _step(_model(), schedule, balance)
        step(step.init(params, buffers), batch)
    finally:
        runner.deferring = deferring
    return len(entered)


@pytest.mark.parametrize(
    ("schedule", "balance", "expected"),
    [
        ("gpipe", [2, 3], [0, 4]),
        ("1f1b", [2, 3], [0, 4]),
        ("zero_bubble", [2, 3], [0, 4]),
        # Stages 0 and 2 on rank 0, 1 and 3 on rank 1; stage 1 (a Tanh) has no linear layer.
        ("interleaved", [1, 1, 2, 1], [4, 4]),
    ],
)
def test_only_stages_whose_input_gradient_goes_to_another_rank_record_linear_layers(
    schedule, balance, expected
):
    # Stage 0's backward feeds no stage: split or not, it computes its weights' gradients in
    # the one backward (under zero-bubble its W only adds them), as recording its linear layers
    # would cost its forwards more than the order could gain. 4 micro-batches.
    assert run_spmd(_recording_forwards, 2, schedule, balance) == expected
