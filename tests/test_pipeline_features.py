"""fs.pipeline: the split backward of zero-bubble (no work repeated), activations that are
pytrees, and explicit padding of a batch that does not split into the micro-batches."""

from __future__ import annotations

import time

import pytest
import torch
from mlp_pipeline import mlp_on_two_ranks, mse
from torch import nn

import fscale as fs
from fscale.parallel.pipeline import StageContractError, pipeline
from fscale.parallel.pipeline.split_backward import input_backward, weight_backward
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

# ---- the split backward ----------------------------------------------------------------------


def _graph_nodes(roots):
    seen, stack = set(), [r.grad_fn for r in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


def _stage(x, weights):
    w1, b1, w2, norm, tied = weights
    h = torch.tanh(x @ w1 + b1)
    h = nn.functional.layer_norm(h, (h.shape[-1],), norm, None)
    return torch.sin(h @ w2) + h @ tied + (x @ tied.T).sum()  # `tied` used twice


@pytest.mark.parametrize("seed", [0, 1])
def test_split_backward_equals_the_whole_backward(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 6), (6,), (6, 6), (6,), (6, 6)]
    weights = [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]
    x = torch.randn(3, 6, generator=g).requires_grad_(True)
    grad_y = torch.randn(3, 6, generator=g)
    expected = torch.autograd.grad(_stage(x, weights), [x, *weights], grad_y)
    y = _stage(x, weights)
    (grad_x,), work = input_backward([y], [grad_y], [x], weights)
    assert grad_x is not None and all(w.grad is None for w in weights)
    grads = weight_backward(work, weights)
    assert_trees_close([grad_x, *grads], list(expected), rtol=1e-6, atol=1e-6)


def test_weight_backward_does_not_run_the_input_backward_again():
    # A chain x -> Linear -> tanh -> Linear -> tanh: W must not run the tanh backwards again
    # (the old W differentiated from the output once more and did).
    g = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(5, 5, generator=g).requires_grad_(True) for _ in range(2))
    x = torch.randn(2, 5, generator=g).requires_grad_(True)
    y = torch.tanh(torch.tanh(x @ w1) @ w2)
    grad_y = torch.randn(2, 5, generator=g)
    expected = torch.autograd.grad(y, [x, w1, w2], grad_y, retain_graph=True)
    runs: list[str] = []
    for node in _graph_nodes([y]):
        node.register_hook(lambda *_, node=node: runs.append(node.name()))
    (grad_x,), work = input_backward([y], [grad_y], [x], [w1, w2])
    in_b = len(runs)
    grads = weight_backward(work, [w1, w2])
    in_w = runs[in_b:]
    assert_trees_close([grad_x, *grads], list(expected), rtol=1e-6, atol=1e-6)
    assert not any("Tanh" in name for name in in_w)
    assert sorted(in_w) == sorted(n for n in in_w if "Mm" in n or "Accumulate" in n)


def test_a_first_stage_without_input_gradient_does_everything_in_w():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 3, generator=g).requires_grad_(True)
    y = torch.tanh(torch.randn(2, 3, generator=g) @ w)
    grad_y = torch.randn(2, 3, generator=g)
    expected = torch.autograd.grad(y, [w], grad_y, retain_graph=True)
    found, work = input_backward([y], [grad_y], [], [w])
    assert tuple(found) == ()
    assert_trees_close(weight_backward(work, [w]), list(expected), rtol=0, atol=0)


# ---- pytree activations ----------------------------------------------------------------------


def _tree_stages():
    def first(p, b, x, key):
        h = torch.tanh(x @ p["w"])
        return {"h": h, "skip": x, "rows": (x[:, 0] > 0).long()}, b  # an int leaf too

    def middle(p, b, x, key):
        return (torch.tanh(x["h"] @ p["w"]) + x["skip"], x["rows"].to(x["h"].dtype)), b

    def last(p, b, x, key):
        hidden, rows = x
        return hidden @ p["w"] + rows[:, None] * p["scale"]

    return [first, middle, last]


def _tree_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(4, 4, generator=g)},
        {"w": torch.randn(4, 4, generator=g)},
        {"w": torch.randn(4, 2, generator=g), "scale": torch.randn(2, generator=g)},
    ]


def _tree_reference(params, batch, steps):
    first, middle, last = _tree_stages()

    def loss_fn(p, b, data, key):
        x, _ = first(p[0], None, data[0], key)
        x, _ = middle(p[1], None, x, key)
        return ((last(p[2], None, x, key) - data[1]) ** 2).mean()

    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    state = step.init(params, None)
    for _ in range(steps):
        state, _ = step(state, batch)
    return state.params


def _pytree_activations(schedule):
    stages = _tree_stages()
    params = _tree_params(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    step = pipeline(
        [stages[0], _chain(stages[1], stages[2])],
        lambda out, t: ((out - t) ** 2).mean(),
        fs.optim.adam(1e-2),
        fs.Mesh(pp=2),
        micro_batches=4,
        schedule=schedule,
    )
    merged = [params[0], {"a": params[1], "b": params[2]}]
    state = step.init(merged, None)
    for _ in range(2):
        state, _ = step(state, batch)
    full = fs.consolidate(step, state).params
    expected = _tree_reference(params, batch, 2)
    return [full[0], full[1]["a"], full[1]["b"]], expected


def _chain(middle, last):
    def stage(p, b, x, key):
        y, _ = middle(p["a"], b, x, key)
        return last(p["b"], b, y, key)

    return stage


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_pytree_of_tensors_passes_between_stages(schedule):
    for params, expected in run_spmd(_pytree_activations, 2, schedule):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)


def _tuple_module_pipeline():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x), torch.tanh(self.b(x))

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(3, 2)

        def forward(self, pair):
            return self.out(pair[0] * pair[1])

    torch.manual_seed(2)
    model = nn.Sequential(Split(), Join())
    apply, params, buffers = fs.functionalize(model)
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g))
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    step = pipeline(model, mse, fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=3, balance=[1, 1])
    state = step.init(params, buffers)
    state, _ = step(state, batch)
    plain = fs.train_step(lambda p, b, d, k: mse(apply(p, b, d[0])[0], d[1]), fs.optim.sgd(0.1))
    expected, _ = plain(plain.init(params, buffers), batch)
    return fs.consolidate(step, state).params, expected.params


def test_a_module_stage_may_return_a_tuple():
    for params, expected in run_spmd(_tuple_module_pipeline, 2):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)


def _bad_leaf():
    def first(p, b, x, key):
        return {"h": x @ p["w"], "n": 3}, b

    def last(p, b, x, key):
        return x["h"] @ p["w"]

    step = pipeline(
        [first, last], lambda o, t: o.mean(), fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=2
    )
    state = step.init([{"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)}], None)
    try:
        step(state, (torch.ones(4, 2), torch.ones(4, 2)))
    except StageContractError as error:
        return str(error)
    return None


def _wrong_leaf_shape():
    def first(p, b, x, key):
        return {"h": x @ p["w"], "gate": x[:, :1]}, b

    def last(p, b, x, key):
        return (x["h"] * x["gate"]) @ p["w"]

    step = pipeline(
        [first, last], lambda o, t: o.mean(), fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=2
    )
    state = step.init([{"w": torch.ones(2, 3)}, {"w": torch.ones(2, 2)}], None)
    try:
        step(state, (torch.ones(4, 2), torch.ones(4, 2)))
    except StageContractError as error:
        return str(error)
    return None


def test_contracts_check_every_leaf():
    for message in run_spmd(_bad_leaf, 2):
        assert message is not None
        assert "stage 0 (rank 0 along 'pp') failed" in message
        assert "its output leaf 'n' is a int, not a tensor" in message
    for message in run_spmd(_wrong_leaf_shape, 2):
        assert message is not None
        assert "stage 1 (rank 1 along 'pp') failed on stage 0's output (a pytree" in message
        assert "shape (2, 1) and dtype torch.float32; shape (2, 3) and dtype" in message


def _one_rank_pipeline(model, **options):
    """`model` as a pipeline of one stage on one rank, built with `options`."""
    loss = lambda o, t: o.mean()  # noqa: E731
    balance = [len(model)]
    return pipeline(model, loss, fs.optim.sgd(0.1), fs.Mesh(pp=1), balance=balance, **options)


# ---- padding ---------------------------------------------------------------------------------


def _padded(size, micro_batches, schedule):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    step, (apply, params, buffers), batch = mlp_on_two_ranks(
        model, size, schedule, [2, 1], micro_batches, 6, pad=True
    )
    state = step.init(params, buffers)
    plain = fs.train_step(lambda p, b, d, k: mse(apply(p, b, d[0])[0], d[1]), fs.optim.adam(1e-2))
    expected = plain.init(params, buffers)
    losses, expected_losses = [], []
    for _ in range(2):
        state, metrics = step(state, batch)
        expected, expected_metrics = plain(expected, batch)
        losses.append(float(metrics["loss"]))
        expected_losses.append(float(expected_metrics["loss"]))
    return fs.consolidate(step, state).params, expected.params, losses, expected_losses, repr(step)


@pytest.mark.parametrize(
    ("size", "micro_batches", "schedule"), [(10, 4, "1f1b"), (6, 4, "zero_bubble"), (5, 2, "gpipe")]
)
def test_padding_gives_the_unpadded_batch_results(size, micro_batches, schedule):
    # 10 in 4: 3, 3, 3 and 1 real samples; 6 in 4: 2, 2, 2 and a micro-batch of padding only.
    for params, expected, losses, expected_losses, description in run_spmd(
        _padded, 2, size, micro_batches, schedule
    ):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert "pad=True" in description


def test_padding_is_asked_for_not_assumed():
    model = nn.Sequential(nn.Linear(4, 4))
    step = pipeline(
        model, lambda o, t: o.mean(), fs.optim.sgd(0.1), fs.Mesh(pp=1), micro_batches=4, balance=[1]
    )
    state = step.init(*fs.functionalize(model)[1:])
    with pytest.raises(ValueError, match=r"or fscale.pipeline\(..., pad=True\)"):
        step(state, (torch.randn(6, 4), torch.randn(6, 4)))
    with pytest.raises(TypeError, match="`pad` must be a bool"):
        _one_rank_pipeline(model, micro_batches=4, pad="yes")


# ---- when receives are posted ----------------------------------------------------------------


def _mlp_pipeline(schedule, balance, **options):
    """A 3-layer MLP pipeline on 2 ranks, 4 micro-batches, after its first step (which checks
    the stage contracts), and its batch."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    step, (_, params, buffers), batch = mlp_on_two_ranks(
        model, 8, schedule, balance, 4, 8, **options
    )
    state, _ = step(step.init(params, buffers), batch)
    return step, state, batch


def _receive_policy(schedule, receive_ahead):
    from fscale.parallel.pipeline import transport

    # gloo's posted receives (neighbours of one host otherwise use shared memory, which posts
    # none).
    fs.distributed.set_shared_memory(False)

    balance = [2, 3] if schedule != "interleaved" else [1, 1, 1, 2]
    step, state, batch = _mlp_pipeline(schedule, balance, receive_ahead=receive_ahead)
    outstanding: list[int] = []
    expect = transport.Mailbox.expect

    def counted(self, *args):
        expect(self, *args)
        outstanding.append(len(self._expected))

    transport.Mailbox.expect = counted  # type: ignore[method-assign]
    try:
        state, metrics = step(state, batch)
    finally:
        transport.Mailbox.expect = expect  # type: ignore[method-assign]
    return fs.consolidate(step, state).params, float(metrics["loss"]), outstanding, repr(step)


def _messages_through(schedule, shared):
    from fscale.parallel.pipeline import transport

    fs.distributed.set_shared_memory(shared)
    balance = [2, 3] if schedule != "interleaved" else [1, 1, 1, 2]
    step, state, batch = _mlp_pipeline(schedule, balance)
    posted: list[int] = []
    post_receive = transport._post_receive

    def counted(*args):
        posted.append(1)
        return post_receive(*args)

    transport._post_receive = counted
    try:
        state, metrics = step(state, batch)
    finally:
        transport._post_receive = post_receive
    return fs.consolidate(step, state).params, float(metrics["loss"]), len(posted)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_messages_through_shared_memory_give_gloo_s_bits_and_post_no_receive(schedule):
    through_memory = run_spmd(_messages_through, 2, schedule, True)
    over_gloo = run_spmd(_messages_through, 2, schedule, False)
    for (params, loss, posted), (gloo_params, gloo_loss, gloo_posted) in zip(
        through_memory, over_gloo
    ):
        assert_trees_equal(params, gloo_params)
        assert loss == gloo_loss
        assert posted == 0 and gloo_posted > 0


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_receives_posted_all_at_once_ahead_or_at_use_give_the_same_bits(schedule):
    # One rank's receives in a step, one per micro-batch (4) and message kind: under 1F1B rank 0
    # receives the gradients of one boundary, rank 1 its activations; interleaved (stages 0, 2
    # on rank 0, 1, 3 on rank 1), 3 boundaries cross between the ranks, each carrying an
    # activation one way and a gradient back: 12 messages into each rank.
    per_rank = {"1f1b": [4, 4], "interleaved": [12, 12]}[schedule]
    runs = {ahead: run_spmd(_receive_policy, 2, schedule, ahead) for ahead in (None, 1, 0)}
    for rank in range(2):
        params, loss, outstanding, _ = runs[None][rank]
        # All posted before the first action, none in flight until the first is used.
        assert outstanding[: per_rank[rank]] == list(range(1, per_rank[rank] + 1))
        assert len(outstanding) == per_rank[rank]
        assert max(runs[1][rank][2]) == 1 and len(runs[1][rank][2]) == per_rank[rank]
        assert runs[0][rank][2] == []  # each receive made at its use
        assert "receive_ahead=1" in runs[1][rank][3] and "receive_ahead" not in runs[None][rank][3]
        for ahead in (1, 0):
            assert_trees_equal(runs[ahead][rank][0], params)
            assert runs[ahead][rank][1] == loss


def _step_traffic():
    step, state, batch = _mlp_pipeline("1f1b", [2, 3])
    with fs.distributed.comm_ledger() as ledger:
        _, metrics = step(state, batch)
    sent = sorted((r.op, r.axis, str(r.dtype), r.numel) for r in ledger.records)
    return sent, float(metrics["loss"])


def test_the_loss_goes_from_the_last_stage_in_one_message_not_a_collective():
    # 1F1B on 2 ranks, 4 micro-batches of 2 samples, width 6 at the cut: rank 0 sends four
    # activations; rank 1 four gradients and the loss (sum, count, whether counted) once, as
    # soon as its last forward is done, so no rank waits for the other's last backward.
    (rank0, loss0), (rank1, loss1) = run_spmd(_step_traffic, 2)
    assert rank0 == [("send", "pp", "torch.float32", 12)] * 4
    assert rank1 == [("send", "pp", "torch.float32", 12)] * 4 + [("send", "pp", "torch.float64", 3)]
    assert loss0 == loss1


def test_the_loss_values_give_the_mean_and_the_count_as_the_loss_said():
    from fscale.parallel.pipeline.loss_message import loss_of, loss_values

    shares = loss_values(torch.tensor(0.75), [])  # weighted by the samples' shares
    loss, count = loss_of(shares)
    assert shares.dtype == torch.float64 and float(loss) == 0.75 and count is None
    counted = loss_values(torch.tensor(9.0), [torch.tensor(2.0), torch.tensor(4.0)])
    loss, count = loss_of(counted)  # a (mean, count) loss: the sum over the total count
    assert float(loss) == 1.5 and float(count) == 6.0
    assert float(loss_of(loss_values(None, []))[0]) == 0.0  # every micro-batch padding
    # A count computed from tracked tensors does not put the message in a graph.
    tracked = torch.tensor(3.0, requires_grad=True) * 1.0
    assert not loss_values(tracked.detach(), [tracked]).requires_grad


class _FailsWhenArmed(nn.Linear):
    armed = False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("the stage failed on its own data")
        return super().forward(x)


def _stage_fails_in_the_second_step():
    from fscale.distributed import watchdog

    previous = watchdog.collective_timeout()
    watchdog.set_collective_timeout(0.2)  # 1F1B, 2 ranks, 4 micro-batches: 15 ticks, 3 s
    try:
        torch.manual_seed(0)
        failing = _FailsWhenArmed(4, 4)
        model = nn.Sequential(nn.Linear(4, 4), failing)
        step, (_, params, buffers), batch = mlp_on_two_ranks(model, 8, "1f1b", [1, 1], 4, 0)
        state, _ = step(step.init(params, buffers), batch)
        failing.armed = True  # on rank 1, which runs it: its first forward of step 2 raises
        try:
            step(state, batch)
        except RuntimeError as error:  # rank 1 stays, as a process that caught it would
            if "on its own data" not in str(error):
                raise
            # Its receives of step 2 are still posted: a next step is refused at once.
            failing.armed = False
            with pytest.raises(RuntimeError, match="an earlier step failed on this rank while"):
                step(state, batch)
            time.sleep(6)  # longer than rank 0's wait: the pool would end rank 0 at our return
    finally:
        watchdog.set_collective_timeout(previous)


def test_a_stage_that_fails_mid_run_is_named_by_its_peer_in_bounded_time():
    # Rank 0 sends two activations and then waits for the first gradient, which rank 1 never
    # sends: the wait ends after the table's ticks times the collective timeout, with the
    # message and both ranks named,
    # not at the process group's timeout in gloo's "Timed out waiting ... for recv". Rank 1,
    # whose stage failed, refuses its next step (its posted receives would take its messages).
    from fscale.distributed import RankError

    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_spmd(_stage_fails_in_the_second_step, 2)
    text = str(caught.value)
    assert "rank 0 of 2 failed" in text
    assert (
        "pipeline: rank 0 (pp=0) waited for the gradient of stage 0's output for micro-batch 0 "
        "from rank 1 (pp=1) in vain: the wait timed out (this rank waits at most 3 s" in text
    )
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("bad", [-1, 1.5, True, "all"])
def test_receive_ahead_must_be_none_or_a_count(bad):
    with pytest.raises(ValueError, match="`receive_ahead` must be None"):
        _one_rank_pipeline(nn.Sequential(nn.Linear(4, 4)), micro_batches=2, receive_ahead=bad)


def test_a_transport_that_cannot_carry_the_messages_is_refused():
    from fscale.parallel.pipeline.transport import check_transport

    cpu, gpu, other_gpu = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    with pytest.raises(NotImplementedError, match="runs on 'nccl'; pipeline messages travel on"):
        check_transport("nccl", {gpu}, "pp")  # NCCL alone: no host transport for the messages
    with pytest.raises(NotImplementedError, match=r"fscale\.launch\(\.\.\., backend='gloo'\)"):
        check_transport("nccl", {cpu}, "pp")
    with pytest.raises(ValueError, match=r"several devices \(cpu, cuda:0\); put each rank's"):
        check_transport("cpu:gloo,cuda:nccl", {cpu, gpu}, "pp")
    with pytest.raises(ValueError, match=r"several devices \(cuda:0, cuda:1\)"):
        check_transport("gloo", {gpu, other_gpu}, "pp")
    # What messages arrive on: the one device of the rank's stages and batch (host: no tensor).
    assert check_transport("gloo", {cpu}, "pp") == cpu  # what every other test here runs on
    assert check_transport("cpu:gloo,cuda:nccl", {gpu}, "pp") == gpu
    assert check_transport("gloo", {gpu}, "pp") == gpu
    assert check_transport("gloo", set(), "pp") == cpu


def test_a_batch_on_another_device_than_the_stages_is_refused_at_the_first_step():
    # The batch reaches every rank whole; each rank's stages and batch must share one device
    # (the one its messages arrive on). "meta" stands in for a GPU on a host without one.
    model = nn.Sequential(nn.Linear(4, 4))
    step = _one_rank_pipeline(model, micro_batches=2)
    _, params, buffers = fs.functionalize(model)
    state = step.init(params, buffers)
    batch = (torch.ones(4, 4, device="meta"), torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\); put each rank's stage"):
        step(state, batch)
    state, metrics = step(state, (torch.ones(4, 4), torch.ones(4, 4)))  # the same step, on one
    assert torch.isfinite(metrics["loss"])
    # A batch of the same shapes on another device later is checked again, not taken as known.
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        step(state, batch)
