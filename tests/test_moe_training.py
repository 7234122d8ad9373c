"""A GPT with MoE MLPs trained over a dp x ep = 2 x 2 mesh under data_parallel, shard_optimizer
and fully_shard over "dp" with the experts sharded over "ep" equals one process running the
same routing groups with every expert."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.models import GPTConfig, MoEGPT, MoEGPTConfig, lm_loss
from fscale.testing import run_spmd

WORLD = 4
STEPS = 2
F64 = torch.float64


def config(capacity: str) -> MoEGPTConfig:
    gpt = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=16)
    return MoEGPTConfig(gpt, num_experts=4, moe={"k": 2, "capacity": capacity})


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_loss(apply):
    def loss_fn(params, buffers, batch, key):
        (logits, aux_loss), _ = apply(params, buffers, batch[0], key=key)
        return lm_loss(logits, batch[1]) + aux_loss

    return loss_fn


def _sharded_case(strategy: str, capacity: str, steps: int = STEPS):
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config(capacity), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    transform = {
        "data_parallel": fs.data_parallel,
        "shard_optimizer": fs.shard_optimizer,
        "fully_shard": fs.fully_shard,
    }[strategy]
    step = fs.expert_parallel(transform(step, mesh, "dp"), mesh, "ep")
    state = step.init(params, buffers)
    expert_shape = tuple(fs.consolidate(step, state).params["blocks.1.mlp.experts.w_in"].shape)
    losses = []
    for i in range(steps):
        state, metrics = step(state, batch(i, dist.get_rank()))
        losses.append(float(metrics["loss"]))
    full = fs.consolidate(step, state)
    # shard_state cuts the full state back into this rank's: consolidating it again is exact.
    again = fs.consolidate(step, fs.shard_state(step, full))
    fs.testing.assert_trees_equal(again.params, full.params)
    fs.testing.assert_trees_equal(again.opt_state, full.opt_state)
    return losses, full.params, expert_shape, repr(step.plan)


def reference(capacity: str, steps: int = STEPS, micro_batches: int = 1):
    """One process with every expert, over the routing groups of the sharded run: each rank's
    batch, or each of its `micro_batches` slices (the step's loss is the mean of the groups')."""
    model = MoEGPT(config(capacity), seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    per_group = make_loss(apply)

    def loss_fn(params, buffers, batches, key):
        return sum(per_group(params, buffers, b, key) for b in batches) / len(batches)

    step = fs.train_step(loss_fn, fs.optim.sgd(0.2, momentum=0.9))
    state = step.init(params, buffers)
    losses = []
    for i in range(steps):
        groups = []
        for r in range(WORLD):
            inputs, targets = batch(i, r)
            size = inputs.shape[0] // micro_batches
            groups += [
                (inputs[j * size : (j + 1) * size], targets[j * size : (j + 1) * size])
                for j in range(micro_batches)
            ]
        state, metrics = step(state, groups)
        losses.append(float(metrics["loss"]))
    return losses, state.params


@pytest.mark.parametrize(
    ("strategy", "capacity"),
    [("data_parallel", "fixed"), ("shard_optimizer", "dropless"), ("fully_shard", "fixed")],
)
def test_moe_gpt_over_dp_and_ep_equals_one_process(strategy, capacity):
    expected_losses, expected_params = reference(capacity)
    for losses, params, expert_shape, plan in run_spmd(_sharded_case, WORLD, strategy, capacity):
        assert plan.startswith("expert_parallel(axis='ep' of size 2)")
        assert expert_shape == (4, 16, 16)  # consolidated: all four experts
        assert losses == pytest.approx(expected_losses, rel=1e-6)  # metrics reduce in float32
        assert set(params) == set(expected_params)
        for name, value in expected_params.items():
            torch.testing.assert_close(
                params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}"
            )


def _bad_expert_parallel_case():
    mesh = fs.Mesh(dp=1, ep=2)
    plain = fs.train_step(lambda p, b, batch, key: p["w"].sum(), fs.optim.sgd(0.1))
    with pytest.raises(ValueError, match="no parameter is an expert leaf"):
        fs.expert_parallel(plain, mesh).init({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"expert leaf `experts.w` of shape \(3, 2\)"):
        fs.expert_parallel(plain, mesh).init({"w": torch.zeros(4), "experts.w": torch.zeros(3, 2)})
    with pytest.raises(TypeError, match="`experts` must be a predicate"):
        fs.expert_parallel(plain, mesh, experts="experts")
    with pytest.raises(ValueError, match="already splits its batch over axis 'ep'"):
        fs.expert_parallel(fs.expert_parallel(plain, mesh), mesh)
    # A sharding layer outside expert_parallel would lay out the full experts before they are
    # sliced: refused where it is built, with the order that works.
    for shard in (fs.fully_shard, fs.shard_optimizer):
        with pytest.raises(ValueError, match="must be outside the sharding"):
            shard(fs.expert_parallel(plain, mesh), mesh, "dp")
    return True


def test_expert_parallel_bad_input():
    assert run_spmd(_bad_expert_parallel_case, 2) == [True, True]


def test_moe_module_eval_mode_and_model_outputs():
    cfg = MoEGPTConfig(
        GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=16),
        num_experts=4,
        moe={"k": 1, "capacity_factor": 0.25, "eval_capacity_factor": 4.0},
    )
    model = MoEGPT(cfg, seed=1)
    assert any(".mlp.experts." in name for name, _ in model.named_parameters())
    assert "blocks.0.mlp.fc_in.weight" in dict(model.named_parameters())  # block 0 stays dense
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    moe = model.blocks[1].mlp
    x = torch.randn(16, 16)
    params = {"gate": {"weight": moe.gate["weight"]}, "experts": dict(moe.experts.items())}
    with torch.no_grad():
        _, train_aux = moe.dispatch(params, x, training=True)
        model.eval()
        y_eval, _ = moe(x)
        expected, eval_aux = moe.dispatch(params, x, training=False)
        logits, aux_loss = model(tokens)
    torch.testing.assert_close(y_eval, expected, rtol=0, atol=0)
    assert int(train_aux["dropped_tokens"]) > 0 and int(eval_aux["dropped_tokens"]) == 0
    assert logits.shape == (2, 8, 32) and aux_loss.dim() == 0 and float(aux_loss) > 0


def _accumulated_case(order: str, capacity: str):
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config(capacity), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    if order == "inside":  # each rank accumulates its micro-batches, then the layers reduce
        step = fs.expert_parallel(fs.data_parallel(fs.accumulate(step, 2), mesh, "dp"), mesh, "ep")
    else:
        step = fs.accumulate(fs.expert_parallel(fs.data_parallel(step, mesh, "dp"), mesh, "ep"), 2)
    state = step.init(params, buffers)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, batch(i, dist.get_rank()))
        losses.append(float(metrics["loss"]))
    return losses, fs.consolidate(step, state).params


@pytest.mark.parametrize(("order", "capacity"), [("inside", "dropless"), ("outside", "fixed")])
def test_expert_parallel_with_accumulation_equals_one_process_over_micro_batch_groups(
    order, capacity
):
    # Every (rank, micro-batch) slice is a routing group of its own.
    expected_losses, expected_params = reference(capacity, micro_batches=2)
    if capacity == "fixed":  # the groups decide the capacity: whole-rank groups train otherwise
        assert reference(capacity)[0] != pytest.approx(expected_losses, rel=1e-6)
    for losses, params in run_spmd(_accumulated_case, WORLD, order, capacity):
        assert losses == pytest.approx(expected_losses, rel=1e-6)
        for name, value in expected_params.items():
            torch.testing.assert_close(
                params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}"
            )


def _data_parallel_outside():
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config("dropless"), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    step = fs.data_parallel(fs.expert_parallel(step, mesh, "ep"), mesh, "dp")
    return _trained(step, params, buffers)


def test_data_parallel_outside_expert_parallel_equals_one_process():
    # data_parallel keeps full parameters, so it may wrap expert_parallel as well as sit in it.
    _, expected = reference("dropless")
    for params in run_spmd(_data_parallel_outside, WORLD):
        fs.testing.assert_trees_close(params, expected, rtol=1e-9, atol=1e-11)


def _mixed(order: str, param_dtype: torch.dtype, mesh_shape: dict[str, int] | None):
    mesh = None if mesh_shape is None else fs.Mesh(**mesh_shape)
    model = MoEGPT(config("dropless"), mesh=mesh, seed=3)
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    if mesh is None:  # one process over the four routing groups
        per_group = step.loss_fn

        def loss_fn(params, buffers, batches, key):
            return sum(per_group(params, buffers, b, key) for b in batches) / len(batches)

        step = fs.mixed_precision(step.replace(loss_fn=loss_fn), param_dtype=param_dtype)
        state = step.init(params, buffers)
        for i in range(STEPS):
            state, _ = step(state, [batch(i, r) for r in range(WORLD)])
        return state.params
    dp = fs.data_parallel(step, mesh, "dp")
    if order == "outside":
        step = fs.mixed_precision(fs.expert_parallel(dp, mesh, "ep"), param_dtype=param_dtype)
    else:
        step = fs.expert_parallel(fs.mixed_precision(dp, param_dtype=param_dtype), mesh, "ep")
    return _trained(step, params, buffers)


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_mixed_precision_with_expert_parallel_in_either_order(order):
    # A float32 policy runs every cast and reduction of the policy's path: one process's result.
    expected = _mixed(order, torch.float32, None)
    for params in run_spmd(_mixed, WORLD, order, torch.float32, {"dp": 2, "ep": 2}):
        fs.testing.assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
    # In bfloat16 every rank ends with the same full model (the replicas stay one model).
    trained = run_spmd(_mixed, WORLD, order, torch.bfloat16, {"dp": 2, "ep": 2})
    for params in trained[1:]:
        fs.testing.assert_trees_equal(params, trained[0])
    assert all(bool(torch.isfinite(t).all()) for t in trained[0].values())


def _checkpointed(remat: bool, capacity: str):
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config(capacity), mesh=mesh, seed=3).double()
    if remat:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = fs.checkpoint(block)
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    step = fs.expert_parallel(fs.data_parallel(step, mesh, "dp"), mesh, "ep")
    state = step.init(params, buffers)
    with fs.remat.track() as stats:
        for i in range(STEPS):
            state, _ = step(state, batch(i, dist.get_rank()))
    return fs.consolidate(step, state).params, stats.recomputations


@pytest.mark.parametrize("capacity", ["dropless", "fixed"])
def test_checkpointed_moe_blocks_redo_their_all_to_alls_and_change_no_bit(capacity):
    # The recompute runs the blocks' all-to-alls again, in the same order on every rank.
    plain = run_spmd(_checkpointed, WORLD, False, capacity)
    for (params, recomputed), (expected, _) in zip(
        run_spmd(_checkpointed, WORLD, True, capacity), plain
    ):
        fs.testing.assert_trees_equal(params, expected)
        assert recomputed == STEPS  # one of the two blocks a step; the last one is kept


def _wrapped(kind: str):
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config("dropless"), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    optimizer = fs.optim.sgd(0.2, momentum=0.9)
    if kind == "offload_optimizer":
        optimizer = fs.offload_optimizer(optimizer)
    inner = fs.data_parallel(fs.train_step(make_loss(apply), optimizer), mesh, "dp")
    if kind == "loss_scale":
        inner = fs.loss_scale(inner)
    step = fs.expert_parallel(inner, mesh, "ep")
    return _trained(step, params, buffers)


@pytest.mark.parametrize("kind", ["offload_optimizer", "loss_scale"])
def test_offloaded_or_loss_scaled_expert_parallel_steps_equal_one_process(kind):
    _, expected = reference("dropless")
    for params in run_spmd(_wrapped, WORLD, kind):
        fs.testing.assert_trees_close(params, expected, rtol=1e-9, atol=1e-11)


def _trained(step, params, buffers):
    """`step`'s full parameters after `STEPS` steps on this rank's batches."""
    state = step.init(params, buffers)
    for i in range(STEPS):
        state, _ = step(state, batch(i, dist.get_rank()))
    return fs.consolidate(step, state).params
