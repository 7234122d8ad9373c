"""Checkpoint files: round trips, resharding across plans and world sizes, asynchronous saves.

Every plan trains the same model, a small GPT cut into an ``nn.Sequential`` (so that a pipeline
can take it) in float64: DDP, ZeRO-1/2/3 and HSDP over "dp", a pipeline over "pp" (alone and
with ZeRO per stage over "dp"), and its `tensor_parallel` copy over "tp" (alone and with DDP or
FSDP over "dp"). A checkpoint's full leaves are read back in one process (`read_leaves`), so
plans that hold their states differently are compared on the same full state.
"""

import dataclasses
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import fscale as fs
from fscale.ckpt.export import bytes_per_rank, read_leaves
from fscale.ckpt.manifest import Manifest, write_manifest
from fscale.ckpt.pieces import layout_kind, pieces_of
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.parallel.pipeline import pipeline
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

VOCAB, SEQ_LEN, BATCH = 32, 8, 8
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
    ("pp", 2),
    ("pp_zero", 4),
    ("pp_tp", 4),
    ("tp", 2),
    ("tp_ddp", 4),
    ("tp_fsdp", 4),
]
# The Sequential's names: "0" the embeddings, "1" and "2" the blocks, "3.0" the final norm and
# "3.1" the output layer.
TP_PLAN = {
    "0.token": "vocab",
    "*.attn": (tpl.Heads("n_heads"), tpl.Input("replicated")),
    "*.attn.qkv": tpl.Colwise(parts=3),
    "*.attn.proj": "rowwise",
    "*.mlp": tpl.Input("replicated"),
    "*.mlp.fc_in": "colwise",
    "*.mlp.fc_out": "rowwise",
    "3.1": tpl.Colwise(gather_output=True),
}


def _sequential():
    cfg = GPTConfig(VOCAB, SEQ_LEN, d_model=16, n_heads=4, n_layers=2, tie_embeddings=False)
    gpt = GPT(cfg, seed=3)
    return nn.Sequential(
        gpt.embed, *gpt.blocks, nn.Sequential(gpt.final_norm, gpt.lm_head)
    ).double()


def _train_step(model, optimizer):
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        logits, buffers = apply(params, buffers, batch[0], key=key)
        return lm_loss(logits, batch[1]), buffers

    return fs.train_step(loss_fn, optimizer), params, buffers


class Built(NamedTuple):
    step: Any
    state: Any
    model: Any  # what save and load are told of: the (tensor-parallel) module
    data: tuple[int, int]  # this rank's slice of the batch: (index, count)


OPTIMIZERS = {"adam": lambda: fs.optim.adam(1e-2), "adafactor": lambda: fs.optim.adafactor(1e-2)}


def _build(plan, optimizer_name="adam"):
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _sequential()
    optimizer = OPTIMIZERS[optimizer_name]()
    if plan.startswith("pp"):
        mesh = fs.Mesh(dp=world // 2, pp=2)
        if plan == "pp_tp":
            mesh = fs.Mesh(pp=2, tp=2)
            model = tpl.tensor_parallel(model, mesh, "tp", TP_PLAN)
        per_stage = (lambda s: fs.shard_optimizer(s, mesh, "dp")) if plan == "pp_zero" else None
        data = (mesh.rank("dp"), mesh.size("dp")) if "dp" in mesh.axis_names else (0, 1)
        step = pipeline(
            model, lm_loss, optimizer, mesh, micro_batches=2, balance=[2, 2], per_stage=per_stage
        )
        _, params, buffers = fs.functionalize(model)
        return Built(step, step.init(params, buffers), model, data)
    mesh = fs.Mesh(dp=world)
    if plan.startswith("tp"):
        mesh = fs.Mesh(dp=world // 2, tp=2)
        model = tpl.tensor_parallel(model, mesh, "tp", TP_PLAN)
        optimizer = tpl.tensor_parallel_optimizer(optimizer, model)
    base, params, buffers = _train_step(model, optimizer)
    data = (rank, world)
    if plan in ("ddp", "tp_ddp"):
        step = fs.data_parallel(base, mesh, "dp")
    elif plan == "zero1":
        step = fs.shard_optimizer(base, mesh, shard_grads=False)
    elif plan == "zero2":
        step = fs.shard_optimizer(base, mesh)
    elif plan in ("fsdp", "tp_fsdp"):
        step = fs.fully_shard(base, mesh, "dp")
    elif plan == "hsdp":
        mesh = fs.Mesh(replica=2, dp=2)
        step = fs.data_parallel(fs.fully_shard(base, mesh, "dp"), mesh, "replica")
    else:
        step = base
    if plan.startswith("tp"):
        data = (mesh.rank("dp"), mesh.size("dp"))
    return Built(step, step.init(params, buffers), model, data)


def _batch(built, index):
    g = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=g)
    return fs.data.split_batch((tokens[:, :-1], tokens[:, 1:]), *built.data)


def _train(built, state, first, count):
    for i in range(first, first + count):
        state, _ = built.step(state, _batch(built, i))
    return state


def _save(built, state, root, **kwargs):
    return fs.ckpt.save(root, state, step=built.step, model=built.model, **kwargs)


def _save_run(plan, root, async_=False, optimizer_name="adam"):
    """Train SAVED_AT steps, save under root/saved, train MORE, save under root/uninterrupted."""
    built = _build(plan, optimizer_name)
    state = _train(built, built.state, 0, SAVED_AT)
    result = _save(built, state, f"{root}/saved", async_=async_)
    state = _train(built, state, SAVED_AT, MORE)  # overlaps an asynchronous write
    if async_:
        fs.ckpt.wait_saves()
        result = result.result()
    _save(built, state, f"{root}/uninterrupted")
    return Path(result).name, layout_kind(built.step, state)


def _resume_run(plan, root, from_step=False, optimizer_name="adam"):
    """Load root/saved into `plan`, save it as root/loaded, train MORE, save as root/resumed."""
    built = _build(plan, optimizer_name)
    like = built.step if from_step else built.state
    state = fs.ckpt.load(f"{root}/saved", like, step=built.step, model=built.model)
    _save(built, state, f"{root}/loaded")
    state = _train(built, state, SAVED_AT, MORE)
    _save(built, state, f"{root}/resumed")
    return layout_kind(built.step, state)


def _leaves(path):
    return read_leaves(path)[1]


def _check_pair(source, target, from_step=False, optimizer_name="adam"):
    with tempfile.TemporaryDirectory() as root:
        (plan, world), (plan2, world2) = source, target
        run_spmd(_save_run, world, plan, root, False, optimizer_name)
        run_spmd(_resume_run, world2, plan2, root, from_step, optimizer_name)
        saved = _leaves(f"{root}/saved")
        # Resharding is exact: the full state read back is the one that was saved.
        assert_trees_equal(_leaves(f"{root}/loaded"), saved)
        resumed, uninterrupted = _leaves(f"{root}/resumed"), _leaves(f"{root}/uninterrupted")
        if source == target:
            assert_trees_equal(resumed, uninterrupted)
        else:
            # Another plan or world size sums gradients in another order (README, Numerics).
            assert_trees_close(resumed, uninterrupted, rtol=1e-9, atol=1e-12)


def test_same_plan_and_world_size_resumes_bit_exactly_under_every_layout():
    for plan in [("local", 1), ("zero2", 2), ("hsdp", 4), ("pp_zero", 4), ("tp_ddp", 4)]:
        _check_pair(plan, plan)
    _check_pair(("fsdp", 2), ("fsdp", 2), from_step=True)  # and `like` given as the Step
    _check_pair(("tp", 2), ("tp", 2), from_step=True)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (("tp", 2), ("local", 1)),  # tp=2 x dp=1 -> one process
        (("pp", 2), ("local", 1)),
        (("ddp", 2), ("pp_zero", 4)),  # DDP -> pp=2 x dp=2 with ZeRO per stage
        (("tp", 2), ("tp_fsdp", 4)),  # tp=2 -> tp=2 with another dp and plan
        (("pp_zero", 4), ("tp_ddp", 4)),
    ],
    ids=lambda pair: f"{pair[0]}{pair[1]}",
)
def test_pipeline_and_tensor_parallel_states_reshard(source, target):
    _check_pair(source, target)


@pytest.mark.parametrize(
    "target", [("tp", 2), ("local", 1), ("tp_fsdp", 4)], ids=lambda pair: f"{pair[0]}{pair[1]}"
)
def test_a_tensor_parallel_adafactor_state_is_the_dense_one_and_reshards(target):
    # Its row and column factors are the full tensor's, the same on every tp rank
    # (tensor_parallel_optimizer), so the checkpoint holds them once and any layout takes them.
    _check_pair(("tp", 2), target, optimizer_name="adafactor")


@given(st.sampled_from(PLANS), st.sampled_from(PLANS))
def test_a_checkpoint_loads_under_any_other_plan_and_world_size(source, target):
    _check_pair(source, target)


def _layouts(plan):
    built = _build(plan)
    return layout_kind(built.step, built.state)


def _pieces_written(plan, root):
    built = _build(plan)
    _save(built, built.state, root)
    return layout_kind(built.step, built.state)


def test_each_plan_writes_only_its_own_pieces(tmp_path):
    assert run_spmd(_layouts, 2, "ddp") == ["full", "full"]
    assert run_spmd(_layouts, 2, "zero2") == ["shard_optimizer"] * 2
    assert run_spmd(_layouts, 4, "hsdp") == ["fully_shard"] * 4
    assert run_spmd(_layouts, 4, "pp_zero") == ["shard_optimizer"] * 4
    assert run_spmd(_layouts, 4, "tp_fsdp") == ["fully_shard"] * 4
    # Under pp=2 x tp=2 each rank writes its stages' shards alone, about a quarter of the
    # state (the replicated norms and biases are written once, by one rank or another).
    assert run_spmd(_pieces_written, 4, "pp_tp", str(tmp_path)) == ["full"] * 4
    manifest, leaves = read_leaves(tmp_path)
    assert manifest.placements == (
        "pipeline over 'pp': 2 stages on 2 ranks",
        "tensor_parallel over 'tp': 2 shards",
    )
    total = sum(leaf.numel() * leaf.element_size() for leaf in leaves.values())
    written = bytes_per_rank(fs.latest(tmp_path))
    assert sorted(written) == [0, 1, 2, 3]
    assert max(n.data for n in written.values()) < 0.3 * total
    assert sum(n.data for n in written.values()) == total  # each box once


def _write_version_1(root):
    """A checkpoint as format version 1 wrote it: every leaf as its 1-D flattening."""
    built = _build("local")
    state = _train(built, built.state, 0, SAVED_AT)
    layout, pieces = pieces_of(built.step, state)
    directory = Path(root) / f"step_{SAVED_AT:010d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {p.key: p.values.reshape(-1) for p in pieces},
            storage_writer=FileSystemWriter(directory),
        )  # no process group here: DCP writes from this process alone
    leaves = {p.key: (p.shape, str(p.dtype).removeprefix("torch.")) for p in pieces}
    manifest = Manifest(SAVED_AT, 1, repr(built.step.plan), layout.kind, leaves, version=1)
    write_manifest(directory, manifest)
    return {p.key: p.values for p in pieces}


def _load_version_1(plan, root):
    built = _build(plan)
    state = fs.ckpt.load(root, built.state, step=built.step, model=built.model)
    _save(built, state, f"{root}/loaded")


def test_a_version_1_checkpoint_loads_under_any_plan():
    with tempfile.TemporaryDirectory() as root:
        saved = _write_version_1(root)
        for plan, world in [("tp", 2), ("fsdp", 2)]:
            run_spmd(_load_version_1, world, plan, root)
            assert_trees_equal(_leaves(f"{root}/loaded"), saved)
            shutil.rmtree(f"{root}/loaded")


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
    base, params, buffers = _train_step(_sequential(), fs.optim.adam(1e-2))
    mesh = fs.Mesh(dp=dist.get_world_size())
    step = fs.shard_optimizer(base.replace(plan=CountUpdates(base.plan)), mesh)
    built = Built(step, step.init(params, buffers), None, (dist.get_rank(), mesh.size("dp")))
    state = built.state
    if save:
        state = _train(built, state, 0, SAVED_AT)
        fs.ckpt.save(path, state, step=step)
    else:
        state = fs.ckpt.load(path, state, step=step)
    kind = layout_kind(step, state)
    return (
        kind,
        fs.consolidate(step, state),
        fs.consolidate(step, _train(built, state, SAVED_AT, MORE)),
    )


def test_a_user_layer_that_adds_state_is_saved_consolidated_and_resumes():
    with tempfile.TemporaryDirectory() as root:
        kind, saved, uninterrupted = run_spmd(_user_plan_run, 2, root, True)[0]
        assert kind == "consolidated"
        for _, loaded, resumed in run_spmd(_user_plan_run, 2, root, False):
            assert_trees_equal(loaded, saved)
            assert_trees_equal(resumed, uninterrupted)


def _mutate_after_async_save(path):
    built = _build("zero2")
    state = _train(built, built.state, 0, SAVED_AT)
    expected = fs.tree.map(torch.clone, fs.consolidate(built.step, state))
    future = _save(built, state, path, async_=True)
    with torch.no_grad():  # what a donated in-place update would do to the saved buffers
        for leaf in fs.tree.leaves(state.params):
            leaf.add_(1.0)
        for leaf in fs.tree.leaves(state.opt_state):
            if leaf.is_floating_point():
                leaf.mul_(3.0)
    committed = fs.ckpt.wait_saves()
    like = _build("zero2").state
    loaded = fs.consolidate(built.step, fs.ckpt.load(path, like, step=built.step))
    return expected, loaded, str(committed[0]) == str(future.result())


def test_async_save_writes_the_state_as_it_was_when_save_returned():
    with tempfile.TemporaryDirectory() as root:
        for expected, loaded, same in run_spmd(_mutate_after_async_save, 2, root):
            assert_trees_equal(loaded, expected)
            assert same


def test_async_save_overlapping_training_resumes_exactly():
    with tempfile.TemporaryDirectory() as root:
        name, _ = run_spmd(_save_run, 2, "fsdp", root, True)[0]
        assert name == f"step_{SAVED_AT:010d}"
        run_spmd(_resume_run, 2, "fsdp", root)
        assert_trees_equal(_leaves(f"{root}/resumed"), _leaves(f"{root}/uninterrupted"))


def test_a_single_process_async_save_is_quiet_and_writes_the_state_at_save(tmp_path):
    built = _build("local")
    state = _train(built, built.state, 0, SAVED_AT)
    expected = fs.tree.map(torch.clone, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        future = _save(built, state, tmp_path, async_=True)
        with torch.no_grad():  # changed while the write may still run
            for leaf in fs.tree.leaves(state.params):
                leaf.add_(1.0)
        committed = fs.ckpt.wait_saves()
    # DCP warns from the thread that writes when it runs without torch.distributed.
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert committed == [future.result()] == [tmp_path / f"step_{SAVED_AT:010d}"]
    assert_trees_equal(fs.ckpt.load(tmp_path, _build("local").state, step=built.step), expected)


def test_latest_and_keep_last(tmp_path):
    built = _build("local")
    state = built.state
    for _ in range(4):
        state = _train(built, state, int(state.step), 1)
        _save(built, state, tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step_{3:010d}",
        f"step_{4:010d}",
    ]
    assert fs.ckpt.latest(tmp_path) == tmp_path / f"step_{4:010d}"
    assert fs.ckpt.latest(tmp_path / "missing") is None
    loaded = fs.ckpt.load(tmp_path, _build("local").state, step=built.step)
    assert_trees_equal(loaded, state)
    # Saving the same step again replaces it.
    _save(built, state, tmp_path)
    assert fs.ckpt.latest(tmp_path) == tmp_path / f"step_{4:010d}"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
