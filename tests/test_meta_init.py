"""A model built on the meta device: fully_shard makes each rank's shards only, bit for bit the
shards of the full model initialised the same way; clear errors where that cannot happen."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale.memory import tree_bytes
from fscale.testing import assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

GPT = fst.ModelCase("gpt", width=16, depth=2, seed=0)  # tied embedding and output layer
CNN = fst.ModelCase("cnn", width=4, depth=2, seed=0)  # BatchNorm buffers
MLP = fst.ModelCase("mlp", width=8, depth=2, seed=0)
KEY = 11


def gpt_init(path: str, module: nn.Module) -> None:
    """GPT-2's initialisation, one submodule at a time (what `fs.models.GPT` does at build)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = 0.02 / math.sqrt(2 * GPT.depth) if path.endswith(("proj", "fc_out")) else 0.02
        nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


INITS = {"gpt": gpt_init, "cnn": "reset_parameters", "mlp": "reset_parameters"}
CASES = {"gpt": GPT, "cnn": CNN, "mlp": MLP}


def _meta(kind: str) -> nn.Module:
    with torch.device("meta"):
        return CASES[kind].module()


def _reference(kind: str) -> tuple[dict, dict]:
    """The full model: ``to_empty`` (ties kept), then the same init on every module in order."""
    model = _meta(kind)
    init = INITS[kind]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # keeps tied weights tied
    try:
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(fs.random.seed(fs.random.key(KEY)))
        for path, module in model.named_modules():
            owns = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if not owns:
                continue
            if init == "reset_parameters":
                getattr(module, "reset_parameters", lambda: None)()
            else:
                init(path, module)
    _, params, buffers = fs.functionalize(model)
    return params, buffers


@pytest.mark.parametrize("kind", ["gpt", "cnn", "mlp"])
def test_materialize_equals_the_same_init_on_the_full_model(kind):
    model = _meta(kind)
    apply, params, buffers = fs.functionalize(model, init=INITS[kind])
    assert all(t.is_meta for t in [*params.values(), *buffers.values()])
    full_params, full_buffers = apply.materialize(KEY)
    expected_params, expected_buffers = _reference(kind)
    assert_trees_equal(full_params, expected_params)
    assert_trees_equal(full_buffers, expected_buffers)
    assert all(p.is_meta for p in model.parameters())  # the values are in the returned dicts
    assert tree_bytes(full_params) > 0


def _sharded_from_meta(kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[kind]
    mesh = fs.Mesh(dp=world)
    apply, params, buffers = fs.functionalize(_meta(kind), init=INITS[kind])
    step = fs.fully_shard(fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2)), mesh)
    state = step.init(params, buffers, key=KEY)
    # The same model, made whole on this process and sharded by the usual path.
    full_apply, full_params, full_buffers = fs.functionalize(_meta(kind), init=INITS[kind])
    full_params, full_buffers = full_apply.materialize(KEY)
    reference_step = fs.fully_shard(
        fs.train_step(case.loss_fn(full_apply), fs.optim.adam(1e-2)), mesh
    )
    reference = reference_step.init(full_params, full_buffers, key=KEY)
    batch = fs.data.split_batch(case.batch(8, seed=0), rank, world)
    state, metrics = step(state, batch)
    reference, reference_metrics = reference_step(reference, batch)
    return (
        (state.params, state.buffers),
        (reference.params, reference.buffers),
        (metrics["loss"], reference_metrics["loss"]),
    )


@pytest.mark.parametrize(("kind", "world"), [("gpt", 2), ("cnn", 2), ("gpt", 4)])
def test_fully_shard_makes_the_shards_of_the_full_model_bit_for_bit(kind, world):
    # The initial shards against the full model's, and the buffers every rank keeps whole:
    for expected_shards, shards, expected_buffers, buffers in run_spmd(
        _initial_shards, world, kind
    ):
        assert_trees_equal(shards, expected_shards)
        assert_trees_equal(buffers, expected_buffers)
    # One step from them trains exactly as one from the full model sharded the usual way:
    for ours, reference, (loss, reference_loss) in run_spmd(_sharded_from_meta, world, kind):
        assert torch.equal(loss, reference_loss)
        assert_trees_equal(ours, reference)


def _initial_shards(kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params, buffers = fs.functionalize(_meta(kind), init=INITS[kind])
    step = fs.fully_shard(
        fs.train_step(CASES[kind].loss_fn(apply), fs.optim.adam(1e-2)), fs.Mesh(dp=world)
    )
    state = step.init(params, buffers, key=KEY)
    full_params, full_buffers = _reference(kind)
    return step.plan.layout.shard(full_params, rank), state.params, full_buffers, state.buffers


def _largest_live_during_init(kind: str):  # an MLP
    """Per init call: real tensor bytes the whole model holds (beyond the shards)."""
    world = dist.get_world_size()
    model = _meta(kind)
    seen: list[tuple[int, int]] = []

    def init(path: str, module: nn.Module) -> None:
        module.reset_parameters()  # the MLP's modules with tensors of their own are Linears
        own = tree_bytes([*module.parameters(recurse=False), *module.buffers(recurse=False)])
        seen.append((tree_bytes([*model.parameters(), *model.buffers()]), own))

    apply, params, buffers = fs.functionalize(model, init=init)
    step = fs.fully_shard(
        fs.train_step(CASES[kind].loss_fn(apply), fs.optim.adam(1e-2)), fs.Mesh(dp=world)
    )
    state = step.init(params, buffers, key=KEY)
    full = sum(t.numel() * t.element_size() for t in [*params.values()])
    return seen, full, tree_bytes(state.params), tree_bytes([*model.parameters()])


def test_the_module_holds_one_submodule_at_a_time_while_shards_are_made():
    for seen, full, shard_bytes, after in run_spmd(_largest_live_during_init, 2, "mlp"):
        # No ties in the MLP: during each init the model holds exactly that module's tensors.
        assert all(live == own for live, own in seen)
        assert max(live for live, _ in seen) < full / 2
        assert shard_bytes < full and after == 0


def test_a_meta_model_without_init_is_refused_with_the_fix():
    apply, params, buffers = fs.functionalize(_meta("mlp"))
    step = fs.fully_shard(fs.train_step(MLP.loss_fn(apply), fs.optim.sgd(0.1)), fs.Mesh(dp=1))
    with pytest.raises(ValueError, match=r"on the meta device.*init='reset_parameters'"):
        step.init(params, buffers)
    with pytest.raises(ValueError, match=r"materialize: .*no values; say how"):
        apply.materialize()


@pytest.mark.parametrize("transform", [None, fs.data_parallel, fs.shard_optimizer])
def test_meta_tensors_reaching_a_plan_that_cannot_create_them_are_refused(transform):
    apply, params, buffers = fs.functionalize(_meta("mlp"), init="reset_parameters")
    step = fs.train_step(MLP.loss_fn(apply), fs.optim.sgd(0.1))
    if transform is not None:
        step = transform(step, fs.Mesh(dp=1))
    with pytest.raises(ValueError, match=r"this plan cannot create values; shard it with"):
        step.init(params, buffers)


def test_meta_tensors_not_from_functionalize_are_refused():
    step = fs.fully_shard(
        fs.train_step(lambda p, b, batch, key: p["w"].sum(), fs.optim.sgd(0.1)), fs.Mesh(dp=1)
    )
    with pytest.raises(ValueError, match=r"params\['w'\] is a meta tensor that fscale"):
        step.init({"w": torch.empty(4, device="meta")})


def test_an_init_that_leaves_a_tensor_unset_is_named():
    class Scale(nn.Module):  # a raw parameter, and no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    apply, params, buffers = fs.functionalize(model, init="reset_parameters")
    step = fs.fully_shard(
        fs.train_step(lambda p, b, x, k: apply(p, b, x)[0].sum(), fs.optim.sgd(0.1)),
        fs.Mesh(dp=1),
    )
    with pytest.raises(ValueError, match=r"the init left '1.gain' unset \(NaN\).*\(Scale\)"):
        step.init(params, buffers)
    with pytest.raises(ValueError, match=r"'1.gain' unset"):
        apply.materialize()


def test_bad_init_arguments_are_refused():
    with pytest.raises(TypeError, match=r"functionalize: `init` must be None, 'reset_parameters'"):
        fs.functionalize(nn.Linear(2, 2), init="xavier")
    apply, _, _ = fs.functionalize(nn.Linear(2, 2), init="reset_parameters")
    with pytest.raises(ValueError, match=r"'weight' must be a meta tensor.*on cpu"):
        apply.materialize()


def test_a_meta_model_trains_under_fully_shard_and_consolidates_into_the_module():
    model = _meta("gpt")
    apply, params, buffers = fs.functionalize(model, init=gpt_init)
    step = fs.fully_shard(fs.train_step(GPT.loss_fn(apply), fs.optim.adam(1e-2)), fs.Mesh(dp=1))
    state, _ = step(step.init(params, buffers, key=KEY), GPT.batch(4, seed=0))
    full = fs.consolidate(step, state)
    apply.load(full.params, full.buffers)
    assert model.lm_head.weight is model.embed.token.weight
    tokens = GPT.inputs(GPT.batch(2, seed=1))
    with torch.no_grad():
        expected, _ = apply(full.params, full.buffers, tokens, train=False)
        assert torch.equal(copy.deepcopy(model).eval()(tokens), expected)


def _hybrid_from_meta_and_from_full():
    """HSDP (sharded over `dp`, replicated over `replica`): meta init vs the full model."""
    mesh = fs.Mesh(replica=2, dp=2)
    rank = dist.get_rank()
    results = []
    for meta in (True, False):
        apply, params, buffers = fs.functionalize(_meta("mlp"), init="reset_parameters")
        if not meta:
            params, buffers = apply.materialize(KEY)
        step = fs.fully_shard(
            fs.train_step(MLP.loss_fn(apply), fs.optim.adam(1e-2)),
            mesh,
            replicate_axis="replica",
        )
        state = step.init(params, buffers, key=KEY)
        state, _ = step(state, fs.data.split_batch(MLP.batch(8, seed=0), rank, 4))
        results.append(state.params)
    return results


def test_hybrid_sharding_from_meta_equals_it_from_the_full_model():
    for from_meta, from_full in run_spmd(_hybrid_from_meta_and_from_full, 4):
        assert_trees_equal(from_meta, from_full)
