"""The Plan protocol: phases, layers, defaults a user plan inherits, and how a step prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fscale as fs
from fscale.testing import assert_trees_equal


def _loss(params, buffers, batch, key):
    return ((params["w"] * batch).sum() - 1.0) ** 2


def _step():
    return fs.train_step(_loss, fs.optim.sgd(0.1, momentum=0.9))


@dataclasses.dataclass(frozen=True, repr=False)
class HalveGradients(fs.Plan):
    """A user layer acting between the phases: it writes only what it changes."""

    inner: fs.Plan

    def gradients(self, step, state, batch, ctx):
        grads, aux = self.inner.gradients(step, state, batch, ctx)
        return fs.tree.map(lambda g: g / 2, grads), aux


def test_a_user_layer_changes_only_what_it_overrides():
    step = _step()
    halved = step.replace(plan=HalveGradients(step.plan))
    batch = torch.arange(3.0)
    state = halved.init({"w": torch.ones(3)})
    new, metrics = halved(state, batch)
    # The same as scaling the gradients by hand between the public phases.
    grads, aux = step.gradients(state, batch)
    expected, _ = step.apply_gradients(state, fs.tree.map(lambda g: g / 2, grads), aux)
    assert_trees_equal(new, expected)
    assert float(metrics["loss"]) == 4.0
    # Its state is full, so consolidate / shard_state pass it through with no code of its own.
    assert fs.consolidate(halved, new) is new
    assert fs.shard_state(halved, new) is new
    assert repr(halved.plan) == "HalveGradients ∘ local"


def test_the_two_phases_are_the_step():
    step = _step()
    state = step.init({"w": torch.ones(3)})
    batch = torch.arange(3.0)
    whole, _ = step(state, batch)
    grads, aux = step.gradients(state, batch)
    assert isinstance(aux, fs.GradAux)
    split, _ = step.apply_gradients(state, grads, aux)
    assert_trees_equal(split, whole)
    with pytest.raises(TypeError, match="`aux` must be the GradAux"):
        step.apply_gradients(state, grads, {"loss": 1.0})
    with pytest.raises(TypeError, match="takes a TrainState"):
        step.gradients({"w": torch.ones(3)}, batch)


class Incomplete(fs.Plan):
    """A layer with no inner plan that computes nothing."""

    inner = None


def test_an_innermost_layer_must_compute():
    step = _step().replace(plan=Incomplete())
    with pytest.raises(NotImplementedError, match="innermost layer of a plan must implement"):
        step.init({"w": torch.ones(3)})
    with pytest.raises(TypeError, match=r"not an fscale\.Plan"):
        fs.data_parallel(_step().replace(plan=object()), fs.Mesh(dp=1))


def test_layers_axes_and_print():
    mesh = fs.Mesh(replica=1, dp=1)
    step = fs.accumulate(fs.data_parallel(fs.fully_shard(_step(), mesh, "dp"), mesh, "replica"), 2)
    assert [layer.name for layer in step.plan.layers()] == [
        "accumulate",
        "data_parallel",
        "fully_shard",
        "local",
    ]
    assert step.plan.data_axes() == ("replica", "dp")
    assert step.plan.data_mesh() is mesh
    assert step.plan.find("fully_shard").axis == "dp"
    assert step.plan.find("shard_optimizer") is None
    text = repr(step)
    assert "optimizer=sgd(lr=0.1, momentum=0.9)" in text
    assert (
        "plan=accumulate(micro_batches=2, dim=0) ∘ data_parallel(axis='replica' of size 1, "
        "bucket=25 MiB) ∘ fully_shard(axis='dp' of size 1"
    ) in text


def test_layers_on_different_meshes_are_refused():
    step = fs.fully_shard(_step(), fs.Mesh(dp=1), "dp")
    with pytest.raises(ValueError, match=r"another mesh \(Mesh\(dp=1\)\).*Mesh\(replica=1, dp=1\)"):
        fs.data_parallel(step, fs.Mesh(replica=1, dp=1), "replica")


def test_context_is_immutable():
    ctx = fs.Context()
    changed = ctx.replace(loss_weight=0.5, final=False)
    assert (ctx.loss_weight, ctx.final) == (1.0, True)
    assert (changed.loss_weight, changed.final) == (0.5, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.final = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.final = True  # type: ignore[misc]
    assert changed == fs.Context(loss_weight=0.5, final=False)
    with pytest.raises(TypeError, match=r"Context.replace: no field\(s\) \['finall'\]"):
        ctx.replace(finall=False)
