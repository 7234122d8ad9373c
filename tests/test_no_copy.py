"""No second copy of the model: after step.init the module holds no tensor memory, and every
tensor byte reachable from the step, the state and the module is the state's own."""

from __future__ import annotations

import copy
import gc
import sys
import types

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.memory import tree_bytes
from fscale.testing import assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

CASE = fst.ModelCase("gpt", width=16, depth=2, seed=3)  # tied embeddings, no buffers
CNN = fst.ModelCase("cnn", width=4, depth=2, seed=3)  # BatchNorm running statistics


def reachable_tensors(*roots: object) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` through object references (gc referents).

    Modules' and classes' namespaces are not followed (they reach everything in the process),
    and functions are followed through their closures and defaults only, for the same reason.
    """
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    stack = list(roots)
    tensors: list[torch.Tensor] = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if id(obj) in module_dicts:
            continue
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            stack.extend(t for t in (obj.grad, obj._base) if t is not None)
        if isinstance(obj, types.FunctionType):
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            stack.extend([*cells, obj.__defaults__, obj.__kwdefaults__, obj.__dict__])
            continue
        stack.extend(gc.get_referents(obj))
    return tensors


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def test_reachable_tensors_finds_closures_and_counts_a_storage_once():
    weight = torch.zeros(10)
    view = weight[2:5]

    def fn():
        return view

    found = reachable_tensors(fn, {"again": weight})
    assert any(t is view for t in found) and any(t is weight for t in found)
    assert tree_bytes(found) == 40  # the view's storage is the weight's


def _strategy(name: str, step: fs.Step, mesh: fs.Mesh) -> fs.Step:
    if name == "data_parallel":
        return fs.data_parallel(step, mesh)
    if name == "shard_optimizer":
        return fs.shard_optimizer(step, mesh)
    if name == "fully_shard":
        return fs.fully_shard(step, mesh)
    return step


def _bytes_after_init_and_steps(case: fst.ModelCase, strategy: str, donate: bool):
    """Per rank, after init and after each of 3 steps: (bytes reachable from the step, the
    state and the module; bytes of the state plus the mesh's; bytes the module holds)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = case.module()
    apply, params, buffers = fs.functionalize(model)
    mesh = fs.Mesh(dp=world)
    step = _strategy(
        strategy, fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2), donate=donate), mesh
    )
    state = step.init(params, buffers)
    del params, buffers  # the caller's own references: what remains is the step's business
    # The one working buffer: the device mesh's table of ranks (int32, one per rank), which a
    # plan with data axes holds through its mesh.
    mesh_tensors = reachable_tensors(mesh) if strategy != "local" else []
    assert tree_bytes(mesh_tensors) == (4 * world if strategy != "local" else 0)
    figures = []
    for i in range(3):
        module_bytes = tree_bytes([*model.parameters(), *model.buffers()])
        reachable = tree_bytes(reachable_tensors(step, state, model))
        figures.append((reachable, tree_bytes([state, mesh_tensors]), module_bytes))
        state, _ = step(state, fs.data.split_batch(case.batch(8, seed=i), rank, world))
    return figures


@pytest.mark.parametrize("strategy", ["data_parallel", "shard_optimizer", "fully_shard"])
def test_the_step_the_state_and_the_module_hold_only_the_state_on_each_rank(strategy):
    for figures in run_spmd(_bytes_after_init_and_steps, 2, CASE, strategy, False):
        for reachable, own, module_bytes in figures:  # after init, and after each step
            assert module_bytes == 0
            assert reachable == own


@pytest.mark.parametrize("donate", [False, True])
def test_one_process_holds_only_the_state(donate):
    for reachable, own, module_bytes in _bytes_after_init_and_steps(CASE, "local", donate):
        assert module_bytes == 0 and reachable == own


def test_buffers_are_taken_too_under_fully_shard():
    for figures in run_spmd(_bytes_after_init_and_steps, 2, CNN, "fully_shard", True):
        for reachable, own, module_bytes in figures:
            assert module_bytes == 0 and reachable == own


def test_the_released_module_keeps_its_structure_and_apply_runs_as_before():
    model = CASE.module()
    apply, params, buffers = fs.functionalize(model)
    inputs = CASE.inputs(CASE.batch(4, seed=0))
    expected, _ = apply(params, buffers, inputs, train=False)
    shapes = {name: (p.shape, p.dtype, p.requires_grad) for name, p in model.named_parameters()}
    step = fs.fully_shard(fs.train_step(CASE.loss_fn(apply), fs.optim.sgd(0.1)), fs.Mesh(dp=1))
    state = step.init(params, buffers)
    assert all(p.is_meta for p in model.parameters())
    assert {n: (p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()} == shapes
    assert model.lm_head.weight is model.embed.token.weight  # still tied
    full = fs.consolidate(step, state)
    output, _ = apply(full.params, full.buffers, inputs, train=False)
    assert torch.equal(output, expected)
    del params, buffers  # nothing holds the original tensors any more: only the shards remain
    with pytest.raises(ValueError, match=r"called by itself.*apply\.load"):
        model(inputs)
    _, again, again_buffers = fs.functionalize(model)
    with pytest.raises(ValueError, match=r"taken by the state of an earlier step\.init"):
        step.init(again, again_buffers)


def test_a_released_module_gets_back_the_tensors_the_caller_still_holds():
    model = CASE.module()
    reference = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)
    step = fs.data_parallel(fs.train_step(CASE.loss_fn(apply), fs.optim.sgd(0.1)), fs.Mesh(dp=1))
    step.init(params, buffers)
    assert all(p.is_meta for p in model.parameters())
    _, again, _ = fs.functionalize(model)  # `params` still holds the values: lent back
    assert all(a.data_ptr() == params[n].data_ptr() for n, a in again.items())
    assert model.lm_head.weight is model.embed.token.weight
    step.init(params, buffers)
    inputs = CASE.inputs(CASE.batch(4, seed=0))
    with torch.no_grad():  # an eager call too gets the module as it was
        assert torch.equal(model.eval()(inputs), reference.eval()(inputs))


def test_load_puts_a_trained_state_back_into_the_released_module():
    model = CASE.module()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(CASE.loss_fn(apply), fs.optim.adam(1e-2))
    state, _ = step(step.init(params, buffers), CASE.batch(4, seed=1))
    assert apply.load(state.params, state.buffers) is model
    assert model.lm_head.weight is model.embed.token.weight
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
    assert_trees_equal(apply.state_dict(state.params, state.buffers), dict(model.state_dict()))
    inputs = CASE.inputs(CASE.batch(4, seed=2))
    with torch.no_grad():
        expected, _ = apply(state.params, state.buffers, inputs, train=False)
        assert torch.equal(model.eval()(inputs), expected)
    with pytest.raises(ValueError, match=r"load: `params` does not match"):
        apply.load({}, state.buffers)


def test_release_refuses_unknown_names():
    apply, _, _ = fs.functionalize(CASE.module())
    with pytest.raises(ValueError, match=r"release: `names` \['nope'\]"):
        apply.release(["nope"])


def test_a_handed_out_tensor_freed_after_the_registry_global_is_gone_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At interpreter exit a module's globals are cleared while tensors a compiled graph still
    # holds are freed later: their callbacks must not look the registry up by its global name.
    from fscale.functional import ownership

    _, params, _ = fs.functionalize(torch.nn.Linear(2, 2))
    weight = params["weight"]
    ident, registry = id(weight), ownership._OWNERS
    assert ident in registry
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(ownership, "_OWNERS", None)
    del weight, params
    gc.collect()
    assert unraisable == []
    assert ident not in registry
