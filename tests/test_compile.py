"""The step under torch.compile: it runs, equals the eager step, and breaks graphs only where torch must.

Compiling is slow on a small machine, so every test builds one tiny model and compiles once.
Graph breaks are counted with ``torch._dynamo.explain`` (no inductor run) and attributed to the
innermost fscale source file on the break's stack; `EXPECTED_BREAKS` lists each remaining one
with the reason it is there.
"""

from __future__ import annotations

import collections
from pathlib import Path

import optree
import pytest
import torch
from torch import nn

import fscale as fs
from fscale import tree
from fscale.functional import buffers as buffers_lib

ROOT = Path(fs.__file__).resolve().parent

# Graph breaks that remain in a local step, by the fscale file they are in, and why.
EXPECTED_BREAKS = {
    # The step's key is mixed in 64-bit host integers from the step counter's value
    # (`fscale.random`); it runs outside the graph, before any tensor work of the step.
    "train.py": 1,
    # torch.autograd.grad: Dynamo traces it only with `trace_autograd_ops=True` (off by default).
    "grad.py": 1,
    # grad_bytes counts distinct storages by address (`untyped_storage().data_ptr()`), which a
    # graph cannot express; it reads the gradients after backward, before the update.
    "memory.py": 1,
    # The optimizer reads its host step counter (`int(count)`) and runs torch's in-place fused
    # kernels eagerly (functionalization rejects them when an optional state list is empty).
    "optim/core.py": 2,
}


class _Net(nn.Module):
    """Linear -> BatchNorm -> Linear: parameters and running statistics (buffers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
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
        out, new_buffers = apply(params, buffers, x, key=fs.random.key(0))
        return out.square().mean(), new_buffers

    explanation = torch._dynamo.explain(loss)(params, buffers, _batch(0)[0])
    assert explanation.graph_break_count == 0, _breaks_by_file(explanation)


@pytest.mark.parametrize("donate", [False, True])
def test_step_breaks_graphs_only_where_expected(donate: bool) -> None:
    step, state = _step(donate)
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
        fs.testing.assert_trees_close(
            compiled_state, eager_state, rtol=1e-5, atol=1e-6
        )
