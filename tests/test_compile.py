"""The step under torch.compile: it runs, equals the eager step, breaks graphs only where it must.

Compiling is slow on a small machine, so every test builds one tiny model and compiles once.
Graph breaks are counted with ``torch._dynamo.explain`` (no inductor run) and attributed to the
innermost fscale source file on the break's stack; `EXPECTED_BREAKS` lists each remaining one
with the reason it is there.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import optree
import pytest
import torch
from torch import nn

import fscale as fs
from fscale import tree
from fscale.functional import buffers as buffers_lib

ROOT = Path(fs.__file__).resolve().parent

# Graph breaks torch._dynamo.explain reports in a local step, by the fscale file they are in, and
# why each is there. Code run outside the graph on purpose (`torch.compiler.disable`: the step's
# key in train.py, the fused optimizer kernels in optim/core.py) is not a break explain reports.
EXPECTED_BREAKS = {
    # `fscale.random.seed(key)` reads the key's two words on the host to seed torch's generator
    # for dropout (a tensor's value read on the host ends a graph).
    "random.py": 1,
    # ... and it does so inside a `with` block (`functional.rng.seeded_by`), where Dynamo cannot
    # resume a graph: the call's Python runs eagerly, the module's forward is compiled.
    "functional/functionalize.py": 1,
    # The check that the loss did not write into its params or buffers compares tensors'
    # version counters, which are symbolic inside a graph.
    "purity.py": 2,
}


class _Net(nn.Module):
    """Linear -> BatchNorm -> Linear: parameters and running statistics (buffers).

    The first layer has no bias: BatchNorm cancels it, so its gradient would be rounding noise,
    which Adam's normalised update turns into steps of size lr in either direction.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8, bias=False)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def _step(donate: bool) -> tuple[fs.Step, fs.TrainState]:
    apply, params, buffers = fs.functionalize(_Net())

    def loss_fn(params, buffers, batch, key):
        out, new_buffers = apply(params, buffers, batch[0], key=key)
        return torch.nn.functional.mse_loss(out, batch[1]), new_buffers

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2), donate=donate)
    params = {name: p.clone() for name, p in params.items()}
    return step, step.init(params, {name: b.clone() for name, b in buffers.items()})


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def _breaks_by_file(explanation) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for reason in explanation.break_reasons:
        files = [Path(f.filename).resolve() for f in reason.user_stack]
        ours = [f for f in files if f.is_relative_to(ROOT)]
        counts[ours[-1].relative_to(ROOT).as_posix() if ours else "<torch>"] += 1
    return dict(counts)


# ----------------------------------------------------------------------------- building blocks


class _Rebinds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * self.scale


def test_call_returns_the_buffers_the_forward_left_and_restores_the_module() -> None:
    net = _Rebinds()
    given = {"count": torch.full((), 5.0), "scale": torch.full((), 2.0)}
    output, captured = buffers_lib.call(net, given, (torch.ones(2),), {}, ["count"])
    assert torch.equal(output, torch.full((2,), 2.0))
    assert captured["count"].item() == 6.0
    assert net.count.item() == 0.0 and net.scale.item() == 1.0  # the module's own are back
    with pytest.raises(RuntimeError, match="scale"):  # every name must be given
        buffers_lib.call(net, {"count": torch.zeros(())}, (torch.ones(2),), {}, ["count"])


def test_same_structure_ignores_dict_order_and_tells_structures_apart() -> None:
    a = tree.structure({"x": torch.ones(1), "y": [torch.ones(1), None]})
    b = tree.structure({"y": [torch.zeros(2), None], "x": torch.zeros(3)})
    assert tree.same_structure(a, b)
    assert not tree.same_structure(a, tree.structure({"x": torch.ones(1), "y": [torch.ones(1)]}))
    assert not tree.same_structure(a, tree.structure({"x": torch.ones(1), "z": [1, None]}))


def _compare_inside_a_graph(outside: optree.PyTreeSpec, value: dict) -> bool:
    return tree.same_structure(tree.structure(value), outside)


def test_same_structure_compares_a_traced_treedef_with_an_eager_one() -> None:
    value = {"b": torch.ones(2), "a": torch.ones(1)}
    outside = tree.structure({"a": torch.ones(1), "b": torch.ones(2)})
    compiled = torch.compile(_compare_inside_a_graph, backend="eager")
    assert compiled(outside, value)
    assert not compiled(outside, {"a": torch.ones(1)})


# ----------------------------------------------------------------------------- graph breaks


def test_loss_function_traces_without_a_graph_break() -> None:
    apply, params, buffers = fs.functionalize(_Net())

    def loss(params, buffers, x):
        out, new_buffers = apply(params, buffers, x)  # no key: see EXPECTED_BREAKS for one
        return out.square().mean(), new_buffers

    explanation = torch._dynamo.explain(loss)(params, buffers, _batch(0)[0])
    assert explanation.graph_break_count == 0, _breaks_by_file(explanation)


def test_step_breaks_graphs_only_where_expected() -> None:
    # The breaks are the same with donate=False (measured); one trace keeps the suite fast.
    step, state = _step(donate=True)
    explanation = torch._dynamo.explain(step)(state, _batch(0))
    assert _breaks_by_file(explanation) == EXPECTED_BREAKS


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("donate", [False, True])
def test_compiled_local_step_equals_the_eager_step(donate: bool) -> None:
    step, eager_state = _step(donate)
    _, compiled_state = _step(donate)
    compiled = torch.compile(step)
    for index in range(2):
        eager_state, eager_metrics = step(eager_state, _batch(index))
        compiled_state, compiled_metrics = compiled(compiled_state, _batch(index))
        assert eager_metrics.keys() == compiled_metrics.keys()
        assert eager_metrics["grad_bytes"] == compiled_metrics["grad_bytes"]
        fs.testing.assert_trees_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- several ranks

PLANS = {
    "data_parallel": fs.data_parallel,
    "shard_optimizer": fs.shard_optimizer,
    "fully_shard": fs.fully_shard,
}


def _compiled_against_eager(plan: str, donate: bool) -> float:
    """Two steps of `plan` on this rank's half of each batch, eager and compiled; max |diff|."""
    rank = torch.distributed.get_rank()
    mesh = fs.Mesh(dp=torch.distributed.get_world_size())
    results = []
    for compile_it in (False, True):
        step, state = _step(donate)
        step = PLANS[plan](step, mesh)
        state = step.init(state.params, state.buffers)
        run = torch.compile(step) if compile_it else step
        for index in range(2):
            inputs, targets = _batch(index)
            state, _ = run(state, (inputs.chunk(2)[rank], targets.chunk(2)[rank]))
        results.append(fs.consolidate(step, state).params)
    return max(
        (a - b).abs().max().item() for a, b in zip(tree.leaves(results[0]), tree.leaves(results[1]))
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FSCALE_COMPILE_RANKS") != "1",
    reason="compiles on every rank (minutes on two cores); set FSCALE_COMPILE_RANKS=1 to run",
)
@pytest.mark.parametrize("plan", list(PLANS))
def test_compiled_multi_rank_step_equals_the_eager_step(plan: str) -> None:
    differences = fs.testing.run_spmd(_compiled_against_eager, 2, plan, True, timeout=900.0)
    assert max(differences) <= 1e-6
