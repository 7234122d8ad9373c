"""`outside_graph`: Dynamo is imported only when something uses it, and the functions decorated
before that import run outside the graphs afterwards exactly as those decorated after it."""

from __future__ import annotations

import subprocess
import sys

from fscale.outside_graph import outside_graph

# What a traced caller of a decorated function compiles: two graphs around one break, reported
# as at a `torch.compiler.disable`d function, and neither graph holds the decorated body's
# operation (`sin`), which ran eagerly, whole.
_CALLER_CHECK = """
def caller(x):
    return apart(x * 2) + 1

x = torch.ones(3)
assert torch.equal(caller(x), (x * 2).sin() + 1)
explained = torch._dynamo.explain(caller)(x)
print(explained.graph_count, explained.graph_break_count,
      any("sin" in str(graph.graph) for graph in explained.graphs),
      all("disable" in reason.reason for reason in explained.break_reasons))
"""

_FRESH_PROCESS = (
    """
import sys
import torch
import fscale as fs
from fscale.outside_graph import outside_graph

@outside_graph
def apart(x):
    return x.sin()

print("torch._dynamo" in sys.modules)
# An eager step calls fscale's decorated functions (the key's mixing, the generators' seeding,
# the optimizer's apply, the gradient bytes) without importing Dynamo.
step = fs.train_step(lambda p, b, batch, key: ((p["w"] * batch).sum(), b), fs.optim.adamw(0.1))
state = step.init({"w": torch.ones(3)}, {})
state, metrics = step(state, torch.ones(3))
print("torch._dynamo" in sys.modules, round(metrics["loss"].item(), 4))
import torch._dynamo
"""
    + _CALLER_CHECK
)


def test_dynamo_waits_until_imported_and_then_every_decorated_function_runs_outside_graphs():
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False", "3.0", "2", "1", "False", "True"], done.stdout


def test_a_function_decorated_once_dynamo_is_imported_runs_outside_graphs_too():
    import torch._dynamo

    torch._dynamo.reset()
    scope = {"torch": torch}
    scope["apart"] = outside_graph(lambda x: x.sin())
    printed: list[str] = []
    scope["print"] = lambda *values: printed.extend(str(value) for value in values)
    exec(_CALLER_CHECK, scope)
    assert printed == ["2", "1", "False", "True"]
    torch._dynamo.reset()
