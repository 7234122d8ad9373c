"""The split backward of zero-bubble schedules: B the input gradient, W the weight gradient.

A stage's backward graph, from its roots (the output, or the loss) down to its input and its
weights, is one graph: autograd nodes joined by edges pointing towards the leaves. The nodes
from which the input can be reached are the *input region* ``I``; B (`input_backward`) runs
exactly those, with ``torch.autograd.grad(roots, inputs, retain_graph=True)``, so the input's
gradient leaves for the previous stage as soon as it can. What W still needs is the gradient
arriving at the rest of the graph: walking from each weight back towards the roots, the first
nodes met that lie in ``I`` (or are roots) are the weight's *frontier*. B records, with a
pre-hook on every frontier node, the gradients flowing into it; W (`weight_backward`) then
differentiates from those edges to the weights only, through the graph B kept. Each node of
``I`` thus runs once in B for the input's side of its outputs, and once more in W for the
weights' side only (autograd computes only the outputs a call needs), and no node outside ``I``
runs in B — no work repeats (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 2).

Weights whose frontiers overlap form one group, differentiated in one call; a group with more
than one frontier node replaces, with pre-hooks, the gradient that one frontier node would pass
to another inside W by the one recorded in B, which it already includes. A stage whose input
needs no gradient (the first stage) has an empty ``I``: its frontier is the roots, B does
nothing and W is the whole backward.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightWork", "input_backward", "weight_backward"]

Tensor = torch.Tensor
Node = Any  # torch.autograd.graph.Node


@dataclasses.dataclass
class _Group:
    """Weights (by index) with their frontier nodes and the gradients B recorded there."""

    weights: list[int]
    frontier: list[Node]
    grads: dict[Node, list[Tensor | None]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WeightWork:
    """What B leaves for W: the weights' groups; `weight_backward` consumes it."""

    groups: list[_Group]
    num_weights: int


def _node(t: Tensor) -> Node:
    return get_gradient_edge(t).node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from `roots`, the nodes that have an edge into it."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upwards(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]):
    """The nodes reached from `starts` towards the roots, and the `stop` nodes where it ended."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


def _groups(frontier_of: list[set[Node]]) -> list[_Group]:
    """Weights (by index) merged into one group wherever their frontiers share a node."""
    owner: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for index, frontier in enumerate(frontier_of):
        if not frontier:
            continue  # no path from the roots: no gradient
        joined = {id(owner[f]): owner[f] for f in frontier if f in owner}
        group = _Group([index], list(frontier))
        for other in joined.values():
            group.weights += other.weights
            group.frontier += [f for f in other.frontier if f not in group.frontier]
            groups.remove(other)
        for f in group.frontier:
            owner[f] = group
        groups.append(group)
    return groups


def input_backward(
    roots: Sequence[Tensor],
    grad_roots: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    weights: Sequence[Tensor],
) -> tuple[tuple[Tensor | None, ...], WeightWork]:
    """B: the gradients of `inputs` (leaves) from `roots`, keeping what W needs.

    `grad_roots[i]` is the gradient of `roots[i]` (None for a scalar root: one). Returns the
    input gradients (None where an input is unused) and the `WeightWork` for `weight_backward`.
    """
    root_nodes = [_node(r) for r in roots]
    parents = _parents(root_nodes)
    input_nodes = [_node(x) for x in inputs]
    region, _ = _upwards(input_nodes, parents, set())
    region -= set(input_nodes)
    stop = region | set(root_nodes)
    weight_nodes = [_node(w) for w in weights]
    frontier_of = [_upwards([node], parents, stop)[1] for node in weight_nodes]
    groups = _groups(frontier_of)
    seeds = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grad_roots)]
    recorded: dict[Node, list[Tensor | None]] = {}
    # A root outside the input region is not run by B: its gradient is the seed itself.
    for root, seed in zip(roots, seeds):
        edge = get_gradient_edge(root)
        if edge.node in region:
            continue
        slots = recorded.setdefault(edge.node, [])
        slots += [None] * (edge.output_nr + 1 - len(slots))
        held = slots[edge.output_nr]
        slots[edge.output_nr] = seed if held is None else held + seed
    handles: list[Any] = []

    def record(node: Node):
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            recorded[node] = list(grad_outputs)

        return hook

    try:
        handles = [
            node.register_prehook(record(node))
            for group in groups
            for node in group.frontier
            if node in region
        ]
        found: tuple[Tensor | None, ...] = (None,) * len(inputs)
        if inputs and region:
            found = torch.autograd.grad(
                list(roots), list(inputs), seeds, retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        group.grads = {node: recorded.get(node, []) for node in group.frontier}
    return found, WeightWork(groups, len(weights))


def weight_backward(work: WeightWork, weights: Sequence[Tensor]) -> list[Tensor | None]:
    """W: the gradients of `weights` (the same leaves as B's) from what B recorded."""
    found: list[Tensor | None] = [None] * work.num_weights
    for group in work.groups:
        outputs, seeds = [], []
        for node in group.frontier:
            for output_nr, grad in enumerate(group.grads[node]):
                if grad is not None:
                    outputs.append(GradientEdge(node, output_nr))
                    seeds.append(grad)
        if not outputs:
            continue
        handles = []
        if len(group.frontier) > 1:
            for node in group.frontier:
                held = tuple(group.grads[node])
                handles.append(node.register_prehook(lambda _, held=held: held))
        try:
            grads = torch.autograd.grad(
                outputs,
                [get_gradient_edge(weights[i]) for i in group.weights],
                seeds,
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        for index, grad in zip(group.weights, grads):
            found[index] = grad
    work.groups = []
    return found
