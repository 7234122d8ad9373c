"""Checkpoint files: round trips, resharding across plans and world sizes, asynchronous saves."""

import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import fscale as fs
import fscale.testing.strategies as fst
from fscale.ckpt.pieces import layout_kind
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

BATCH = 8
SAVED_AT = 2
MORE = 2
# (plan, world size) pairs the property draws from.
PLANS = [
    ("local", 1),
    ("ddp", 2),
    ("zero1", 2),
    ("zero2", 2),
    ("fsdp", 2),
    ("fsdp", 4),
    ("hsdp", 4),
]


def _case():
    return fst.ModelCase("gpt", width=8, depth=2, seed=3)


def _build(plan):
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    world = dist.get_world_size() if dist.is_initialized() else 1
    base = fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2))
    mesh = fs.Mesh(dp=world)
    if plan == "ddp":
        step = fs.data_parallel(base, mesh)
    elif plan == "zero1":
        step = fs.shard_optimizer(base, mesh, shard_grads=False)
    elif plan == "zero2":
        step = fs.shard_optimizer(base, mesh)
    elif plan == "fsdp":
        step = fs.fully_shard(base, mesh)
    elif plan == "hsdp":
        mesh = fs.Mesh(replica=2, dp=2)
        step = fs.data_parallel(fs.fully_shard(base, mesh, "dp"), mesh, "replica")
    else:
        step = base
    return case, apply, step, step.init(params, buffers)


def _batch(case, index):
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return fs.data.split_batch(case.batch(BATCH, seed=index), rank, world)


def _train(step, state, case, first, count):
    for i in range(first, first + count):
        state, _ = step(state, _batch(case, i))
    return state


def _save_run(plan, path, async_=False):
    """Train SAVED_AT steps, save, then train MORE: the uninterrupted run's full states."""
    case, apply, step, state = _build(plan)
    state = _train(step, state, case, 0, SAVED_AT)
    result = fs.ckpt.save(path, state, step=step, model=apply, async_=async_)
    if async_:
        state = _train(step, state, case, SAVED_AT, MORE)  # overlaps the write
        fs.ckpt.wait_saves()
        return fs.consolidate(step, state), Path(result.result()).name
    saved = fs.consolidate(step, state)
    state = _train(step, state, case, SAVED_AT, MORE)
    return saved, fs.consolidate(step, state)


def _resume_run(plan, path, from_step=False):
    """Load the newest checkpoint under `path` into `plan` and train MORE steps."""
    case, _, step, like = _build(plan)
    # Given the Step alone, load builds the state from the checkpoint's shapes.
    state = fs.ckpt.load(path, step) if from_step else fs.ckpt.load(path, like, step=step)
    loaded = fs.consolidate(step, state)
    state = _train(step, state, case, SAVED_AT, MORE)
    return loaded, fs.consolidate(step, state), layout_kind(step, state)


def _check_pair(source, target, from_step=False):
    with tempfile.TemporaryDirectory() as root:
        (plan, world), (plan2, world2) = source, target
        saved, uninterrupted = run_spmd(_save_run, world, plan, root)[0]
        results = run_spmd(_resume_run, world2, plan2, root, from_step)
    for loaded, resumed, _ in results:
        # Resharding is exact: the full state read back is the one that was saved.
        assert_trees_equal(loaded, saved)
        if source == target:
            assert_trees_equal(resumed, uninterrupted)
        else:
            # Another plan or world size sums gradients in another order (README, Numerics).
            assert_trees_close(resumed.params, uninterrupted.params, rtol=1e-4, atol=1e-5)


def test_same_plan_and_world_size_resumes_bit_exactly_under_every_layout():
    for plan in [("local", 1), ("zero2", 2), ("hsdp", 4)]:
        _check_pair(plan, plan)
    _check_pair(("fsdp", 2), ("fsdp", 2), from_step=True)  # and `like` given as the Step


@given(st.sampled_from(PLANS), st.sampled_from(PLANS))
def test_a_checkpoint_loads_under_any_other_plan_and_world_size(source, target):
    _check_pair(source, target)


def _layouts(plan):
    _, _, step, state = _build(plan)
    return layout_kind(step, state)


def test_each_plan_writes_only_its_own_pieces():
    assert run_spmd(_layouts, 2, "ddp") == ["full", "full"]
    assert run_spmd(_layouts, 2, "zero2") == ["shard_optimizer"] * 2
    assert run_spmd(_layouts, 4, "hsdp") == ["fully_shard"] * 4


def _zero_count():
    return torch.zeros((), dtype=torch.int64)


class Counted(NamedTuple):
    inner: Any
    updates: torch.Tensor


@dataclasses.dataclass(frozen=True, repr=False)
class CountUpdates(fs.Plan):
    """A user layer that adds to the optimizer state (so it is saved consolidated)."""

    inner: fs.Plan
    name = "count_updates"

    def init(self, step, params, buffers, key, ctx):
        state = self.inner.init(step, params, buffers, key, ctx)
        return state._replace(
            opt_state=Counted(state.opt_state, torch.zeros((), dtype=torch.int64))
        )

    def gradients(self, step, state, batch, ctx):
        return self.inner.gradients(
            step, state._replace(opt_state=state.opt_state.inner), batch, ctx
        )

    def apply_gradients(self, step, state, grads, aux, ctx):
        ours = state.opt_state
        new, metrics = self.inner.apply_gradients(
            step, state._replace(opt_state=ours.inner), grads, aux, ctx
        )
        return new._replace(opt_state=Counted(new.opt_state, ours.updates + 1)), metrics

    def consolidate(self, step, state):
        return self.inner.consolidate(step, state._replace(opt_state=state.opt_state.inner))

    def shard_state(self, step, full_state):
        state = self.inner.shard_state(step, full_state)
        return state._replace(
            opt_state=Counted(state.opt_state, torch.zeros((), dtype=torch.int64))
        )


def _user_plan_run(path, save):
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    base = fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2))
    mesh = fs.Mesh(dp=dist.get_world_size())
    step = fs.shard_optimizer(base.replace(plan=CountUpdates(base.plan)), mesh)
    state = step.init(params, buffers)
    if save:
        state = _train(step, state, case, 0, SAVED_AT)
        fs.ckpt.save(path, state, step=step)
    else:
        state = fs.ckpt.load(path, state, step=step)
    kind = layout_kind(step, state)
    return (
        kind,
        fs.consolidate(step, state),
        fs.consolidate(step, _train(step, state, case, SAVED_AT, MORE)),
    )


def test_a_user_layer_that_adds_state_is_saved_consolidated_and_resumes():
    with tempfile.TemporaryDirectory() as root:
        kind, saved, uninterrupted = run_spmd(_user_plan_run, 2, root, True)[0]
        assert kind == "consolidated"
        for _, loaded, resumed in run_spmd(_user_plan_run, 2, root, False):
            assert_trees_equal(loaded, saved)
            assert_trees_equal(resumed, uninterrupted)


def _mutate_after_async_save(path):
    case, _, step, state = _build("zero2")
    state = _train(step, state, case, 0, SAVED_AT)
    expected = fs.tree.map(torch.clone, fs.consolidate(step, state))
    future = fs.ckpt.save(path, state, step=step, async_=True)
    with torch.no_grad():  # what a donated in-place update would do to the saved buffers
        for leaf in fs.tree.leaves(state.params):
            leaf.add_(1.0)
        for leaf in fs.tree.leaves(state.opt_state):
            if leaf.is_floating_point():
                leaf.mul_(3.0)
    committed = fs.ckpt.wait_saves()
    _, _, _, like = _build("zero2")
    loaded = fs.consolidate(step, fs.ckpt.load(path, like, step=step))
    return expected, loaded, str(committed[0]) == str(future.result())


def test_async_save_writes_the_state_as_it_was_when_save_returned():
    with tempfile.TemporaryDirectory() as root:
        for expected, loaded, same in run_spmd(_mutate_after_async_save, 2, root):
            assert_trees_equal(loaded, expected)
            assert same


def test_async_save_overlapping_training_resumes_exactly():
    with tempfile.TemporaryDirectory() as root:
        (_, name), _ = run_spmd(_save_run, 2, "fsdp", root, True)
        assert name == f"step_{SAVED_AT:010d}"
        _, uninterrupted = run_spmd(_save_run, 2, "fsdp", tempfile.mkdtemp(dir=root))[0]
        for _, resumed, _ in run_spmd(_resume_run, 2, "fsdp", root):
            assert_trees_equal(resumed, uninterrupted)


def test_a_single_process_async_save_is_quiet_and_writes_the_state_at_save(tmp_path):
    case, _, step, state = _build("local")
    state = _train(step, state, case, 0, SAVED_AT)
    expected = fs.tree.map(torch.clone, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        future = fs.ckpt.save(tmp_path, state, step=step, async_=True)
        with torch.no_grad():  # changed while the write may still run
            for leaf in fs.tree.leaves(state.params):
                leaf.add_(1.0)
        committed = fs.ckpt.wait_saves()
    # DCP warns from the thread that writes when it runs without torch.distributed.
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert committed == [future.result()] == [tmp_path / f"step_{SAVED_AT:010d}"]
    assert_trees_equal(fs.ckpt.load(tmp_path, _build("local")[3], step=step), expected)


def test_latest_and_keep_last(tmp_path):
    case, _, step, state = _build("local")
    for _ in range(4):
        state = _train(step, state, case, int(state.step), 1)
        fs.ckpt.save(tmp_path, state, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step_{3:010d}",
        f"step_{4:010d}",
    ]
    assert fs.ckpt.latest(tmp_path) == tmp_path / f"step_{4:010d}"
    assert fs.ckpt.latest(tmp_path / "missing") is None
    loaded = fs.ckpt.load(tmp_path, step.init(*_build("local")[3][:2]), step=step)
    assert_trees_equal(loaded, state)
    # Saving the same step again replaces it.
    fs.ckpt.save(tmp_path, state, step=step)
    assert fs.ckpt.latest(tmp_path) == tmp_path / f"step_{4:010d}"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
