"""The step under torch.compile: it runs, equals the eager step, breaks graphs only where it must.

Compiling is slow on a small machine, so every test builds one tiny model and compiles once.
Graph breaks are collected from Dynamo's graph-break log over two compiled steps (backend
"eager": Dynamo only, no inductor run), one per distinct site, each attributed to the innermost
fscale source file on its stack; `EXPECTED_BREAKS` lists each remaining one with the reason it
is there. ``torch._dynamo.explain`` is not used for the step: it stops reporting at a break it
cannot resume from and misses the breaks of the frames run after it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import optree
import pytest
import torch
from torch import nn

import fscale as fs
from fscale import purity, tree
from fscale.functional import buffers as buffers_lib
from fscale.functional import rng
from fscale.parallel import bucket_layout, buckets

ROOT = Path(fs.__file__).resolve().parent

# The graph-break sites of a compiled local step, by the fscale file they are in, and why each is
# there. A call to a function run outside the graph on purpose (`torch.compiler.disable`) is a
# site too: the graph ends there and resumes after it.
EXPECTED_BREAKS = {
    # On purpose: the step's key is mixed in 64-bit host integers from the step counter's value.
    "train.py": 1,
    # Required by torch: seeding the generators from the key, for dropout. Dynamo refuses every
    # operation on generator state (test_torch_refuses_generator_state_in_a_graph), so
    # `FunctionalModule.__call__` saves and seeds them in one call outside the graph
    # (`rng.seed_generators`) and restores them in another (`rng.restore_generators`), around
    # the forward in try/finally, so the graph resumes after each; the third site is the
    # new-buffers dict built from the captured buffers (an optree node Dynamo cannot rebuild).
    "functional/functionalize.py": 3,
    # Required by torch: the parameters' detached aliases are made to require grad (and get the
    # reducer's hooks, where there is one) in one call outside the graph, and
    # torch.autograd.grad is not traced (torch._dynamo.config.trace_autograd_ops is False in
    # torch 2.13): the forward is one graph, its backward AOTAutograd's.
    "grad.py": 2,
    # The grad_bytes metric reads UntypedStorage.data_ptr, which Dynamo cannot trace.
    "memory.py": 1,
    # On purpose: the optimizer's apply runs eagerly as a whole (its call site is in base.py):
    # torch's fused kernels are rejected by functionalization, and Dynamo rebuilds the trees'
    # specs held across a break around them wrongly.
    "optim/base.py": 1,
}


@functools.cache
def _dynamo_traces_optree() -> bool:
    torch._dynamo.reset()
    try:
        torch.compile(tree.leaves, backend="eager", fullgraph=True)({"a": torch.ones(1)})
    except torch._dynamo.exc.Unsupported:
        return False
    finally:
        torch._dynamo.reset()
    return True


@pytest.fixture
def optree_traced() -> None:
    """Skip where Dynamo does not trace optree's flatten (torch 2.6 to 2.9 break the graph at
    every call, and the step still equals the eager one): the graph-break accounting below is
    that of a torch that does (2.13)."""
    if not _dynamo_traces_optree():
        pytest.skip(f"Dynamo in torch {torch.__version__} breaks the graph at optree's flatten")


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


def _step(
    donate: bool, compile_loss: bool = False, remat: bool = False
) -> tuple[fs.Step, fs.TrainState]:
    """The step of `_Net` with AdamW; `compile_loss`: its loss function under torch.compile;
    `remat`: the norm and the output layer recomputed in backward (`fscale.checkpoint`)."""
    net = _Net()
    if remat:
        net.norm, net.out = fs.checkpoint(net.norm), fs.checkpoint(net.out)
    apply, params, buffers = fs.functionalize(net)

    def loss_fn(params, buffers, batch, key):
        out, new_buffers = apply(params, buffers, batch[0], key=key)
        return torch.nn.functional.mse_loss(out, batch[1]), new_buffers

    loss = torch.compile(loss_fn) if compile_loss else loss_fn
    step = fs.train_step(loss, fs.optim.adamw(1e-2), donate=donate)
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


class _BreakSites(logging.Handler):
    """Dynamo's graph-break log records, one per site, as (where, innermost fscale file)."""

    LOGGERS = ("symbolic_convert", "convert_frame", "exc")

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[tuple[str, int], str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        where = re.search(r"Graph break.*? in user code at (\S+):(\d+)", message)
        if where is None:
            return
        stack = [where.group(1), *re.findall(r'File "([^"]+)", line \d+', message)]
        ours = [Path(f).resolve() for f in stack if Path(f).resolve().is_relative_to(ROOT)]
        # A repeated site's record omits the stack: the first record of it named the file.
        site = (where.group(1), int(where.group(2)))
        if site not in self.sites:
            self.sites[site] = ours[-1].relative_to(ROOT).as_posix() if ours else "<torch>"

    def by_file(self) -> dict[str, int]:
        return dict(collections.Counter(self.sites.values()))


@contextlib.contextmanager
def _break_sites() -> Iterator[_BreakSites]:
    handler = _BreakSites()
    names = [f"torch._dynamo.{name}.__graph_breaks" for name in handler.LOGGERS]
    loggers = [logging.getLogger(name) for name in names]
    torch._logging.set_logs(graph_breaks=True)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        torch._logging.set_logs()


_FSCALE_DIR = str(Path(fs.__file__).parent)


@contextlib.contextmanager
def _dynamo_warnings() -> Iterator[list[str]]:
    """The first lines of the warnings Dynamo gives inside the block. Dynamo gives each message
    once per process, and the pool's ranks live on: its record of those given is emptied first.
    Where Dynamo cannot trace optree's flatten (torch 2.6 to 2.9) it also warns of that at each
    call, and under 2.7 of inductor's own kernels: there only a warning that names an fscale
    file counts. Enter it before the first compiled call: the first time in a process it asks
    Dynamo which of the two it is, and resets Dynamo after the question."""
    every_warning_counts = _dynamo_traces_optree()
    given = getattr(torch._dynamo.utils, "warn_once_cache", None)
    if given is not None:
        given.clear()
    first_lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield first_lines
    messages = [str(w.message) for w in caught]
    first_lines.extend(
        message.splitlines()[0]
        for message in messages
        if message.startswith("Dynamo") and (every_warning_counts or _FSCALE_DIR in message)
    )


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


def _layout_inside_a_graph(params: dict) -> object:
    return bucket_layout.layout_of(params, 1 << 20, 2)[0]


def test_bucket_layout_inside_a_graph_is_the_cached_one(optree_traced: None) -> None:
    # Dynamo reads the cache: the graph holds no layout of its own (no meta tensors in it).
    params = {"w": torch.ones(3, 5), "b": torch.ones(7)}
    eager = bucket_layout.layout_of(params, 1 << 20, 2)[0]
    torch._dynamo.reset()
    compiled = torch.compile(_layout_inside_a_graph, backend="eager", fullgraph=True)
    with _dynamo_warnings() as warned:  # e.g. of a cached function it traces as if uncached
        assert compiled(params) is eager
    assert warned == []


def test_seed_generators_draw_as_seeded_by_and_restore_the_ambient_ones() -> None:
    key = fs.random.key(3)
    torch.manual_seed(11)
    ambient = torch.rand(3)
    with rng.seeded_by(key, list):
        expected = torch.rand(4)
    torch.manual_seed(11)
    saved = rng.seed_generators(key, lambda: [torch.ones(1)])
    drawn = torch.rand(4)
    rng.restore_generators(saved)
    assert torch.equal(drawn, expected)
    assert torch.equal(torch.rand(3), ambient)


@pytest.mark.parametrize(
    ("backend", "fallback_random", "draws_the_eager_mask"),
    [("eager", False, True), ("inductor", False, False), ("inductor", True, True)],
)
def test_under_inductor_the_key_fixes_the_dropout_mask(
    backend: str, fallback_random: bool, draws_the_eager_mask: bool
) -> None:
    # The call seeds torch's generators from the key. Dynamo alone draws with them, as the
    # eager call does; inductor draws with a generator of its own seeded from torch's: the key
    # still fixes the mask, which equals the eager call's only with fallback_random (README).
    torch.manual_seed(0)
    apply, params, buffers = fs.functionalize(nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5)))
    x = torch.ones(3, 4)

    def call(params, x, key):
        return apply(params, buffers, x, key=key)[0]

    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=fallback_random):
        compiled = torch.compile(call, backend=backend)
        first, again = compiled(params, x, fs.random.key(7)), compiled(params, x, fs.random.key(7))
        other = compiled(params, x, fs.random.key(8))
    torch._dynamo.reset()
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(first, call(params, x, fs.random.key(7))) == draws_the_eager_mask


# ----------------------------------------------------------------------------- graph breaks


def test_loss_function_traces_without_a_graph_break(optree_traced: None) -> None:
    apply, params, buffers = fs.functionalize(_Net())

    def loss(params, buffers, x):
        out, new_buffers = apply(params, buffers, x)  # no key: see EXPECTED_BREAKS for one
        return out.square().mean(), new_buffers

    explanation = torch._dynamo.explain(loss)(params, buffers, _batch(0)[0])
    assert explanation.graph_break_count == 0, _breaks_by_file(explanation)


def test_step_breaks_graphs_only_where_expected(optree_traced: None) -> None:
    # The breaks are the same with donate=False (measured); one trace keeps the suite fast.
    step, state = _step(donate=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")
    with _break_sites() as sites:
        for index in range(2):  # the second step shows breaks a recompilation would add
            state, _ = compiled(state, _batch(index))
    assert sites.by_file() == EXPECTED_BREAKS, sites.sites


def _seeds_inside(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    return x + 1


def _graph_breaks(fn, *args) -> int:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(fn, backend="eager")(*args)
    return sum(counters["graph_break"].values())


def test_torch_refuses_generator_state_in_a_graph() -> None:
    # Why functional/rng.py keeps its break: when this starts tracing, fold the seeding in.
    assert _graph_breaks(_seeds_inside, torch.ones(2)) >= 1


def _checks_purity(x: torch.Tensor, buffers: dict, before: list[int]) -> torch.Tensor:
    purity.check_not_written("buffers", buffers, tree.leaves(buffers), before)
    return x + 1


def test_purity_check_ends_no_graph(optree_traced: None) -> None:
    buffers = {"c": torch.ones(1)}
    before = purity.versions(tree.leaves(buffers))
    assert _graph_breaks(_checks_purity, torch.ones(2), buffers, before) == 0


def _eval_call_that_writes(tensors: dict) -> torch.Tensor:
    before = buffers_lib.versions(tensors)
    with torch.no_grad():
        tensors["running"].add_(1)
    buffers_lib.check_not_modified(tensors, before)
    return tensors["running"] * 2


def test_buffer_check_holds_inside_a_graph() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_eval_call_that_writes, backend="eager")
    # The graph's assertion keeps the condition, not the message: it names the expression. Before
    # torch 2.13 the check runs outside the graph, with its own message.
    with pytest.raises(RuntimeError, match=r"Runtime assertion failed|running"):
        compiled({"running": torch.zeros(2)})


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


@pytest.mark.parametrize("composed", ["alone", "accumulate", "remat"])
def test_step_of_a_compiled_loss_function_equals_the_eager_step(composed: str) -> None:
    # The fast way to compile (bench/compile.py): the model's forward, backward and loss in one
    # graph each way, fscale's step around them eager, as torch.compile(module) in a torch loop;
    # with micro-batches, or layers recomputed in backward, inside the compiled loss function.
    remat = composed == "remat"
    if remat and torch.__version__ < "2.11":
        pytest.skip(
            "Dynamo before torch 2.11 fails to resume a frame inside fscale.checkpoint's call of "
            "a module with buffers (TypeError: 'tuple' object is not callable, under 2.6)"
        )
    torch._dynamo.reset()
    step, eager_state = _step(donate=True, remat=remat)
    compiled, compiled_state = _step(donate=True, compile_loss=True, remat=remat)
    if composed == "accumulate":
        step, compiled = fs.accumulate(step, 2), fs.accumulate(compiled, 2)
    for index in range(3):
        eager_state, eager_metrics = step(eager_state, _batch(index))
        # Compiled once: each step swaps in new parameter tensors, which must not recompile.
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            compiled_state, compiled_metrics = compiled(compiled_state, _batch(index))
        assert eager_metrics.keys() == compiled_metrics.keys()
        fs.testing.assert_trees_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


class _TiedPair(nn.Module):
    """Two Linear layers sharing one weight, recomputed in backward as one block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _tied_step(compile_loss: bool) -> tuple[fs.Step, fs.TrainState]:
    apply, params, buffers = fs.functionalize(fs.checkpoint(_TiedPair()))
    assert len(params) == 3  # the tied weight once, and the two biases

    def loss_fn(params, buffers, batch, key):
        out, new_buffers = apply(params, buffers, batch[0], key=key)
        return torch.nn.functional.mse_loss(out[:, :2], batch[1]), new_buffers

    loss = torch.compile(loss_fn) if compile_loss else loss_fn
    step = fs.train_step(loss, fs.optim.adamw(1e-2), donate=True)
    return step, step.init({name: p.clone() for name, p in params.items()}, buffers)


def test_a_compiled_loss_function_over_a_checkpointed_tied_block_compiles_once() -> None:
    # The block's tensors are collected at each call, a tied weight once, by identity: compiled,
    # that must not guard on the identities of the tensors a step swaps in (it recompiled every
    # step), and the tied weight trains as it does eagerly.
    if torch.__version__ < "2.11":
        pytest.skip(
            "Dynamo before torch 2.11 fails to build the guards of a checkpointed call inside "
            "a compiled loss function (2.6: an AssertionError in get_guard_manager_from_source)"
        )
    torch._dynamo.reset()
    (step, eager_state), (compiled, compiled_state) = _tied_step(False), _tied_step(True)
    for index in range(3):
        eager_state, _ = step(eager_state, _batch(index))
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            compiled_state, _ = compiled(compiled_state, _batch(index))
    fs.testing.assert_trees_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- several ranks


def _zero1(step: fs.Step, mesh: fs.Mesh) -> fs.Step:
    return fs.shard_optimizer(step, mesh, shard_grads=False)


PLANS = {
    "data_parallel": fs.data_parallel,
    "shard_optimizer": fs.shard_optimizer,
    "shard_optimizer(shard_grads=False)": _zero1,
    "fully_shard": fs.fully_shard,
}


def _compiled_against_eager(
    plan: str, donate: bool, what: str = "step"
) -> tuple[float, dict[str, int], int, list[str]]:
    """Two steps of `plan` on this rank's half of each batch, eager and with `what` compiled by
    inductor (the whole step, or only its loss function): max |diff|, the compiled steps'
    graph-break sites by fscale file (Dynamo decides them, whichever backend compiles), the
    graphs the compiled second step made (none: nothing the first step left may be guarded), and
    the warnings Dynamo gave while compiling."""
    rank = torch.distributed.get_rank()
    mesh = fs.Mesh(dp=torch.distributed.get_world_size())
    torch._dynamo.reset()  # the pool's ranks live on: nothing compiled by an earlier test
    graphs = torch._dynamo.utils.counters["stats"]
    results = []
    for compile_it in (False, True):
        step, state = _step(donate, compile_loss=compile_it and what == "loss_fn")
        step = PLANS[plan](step, mesh)
        state = step.init(state.params, state.buffers)
        whole = compile_it and what == "step"
        run = torch.compile(step) if whole else step
        if compile_it:  # as in a new process: a graph may not guard on what its step caches
            buckets._ZERO_RUNS.clear()
        with _break_sites() as sites, _dynamo_warnings() as warned:
            for index in range(2):
                inputs, targets = _batch(index)
                before = graphs["unique_graphs"]
                state, _ = run(state, (inputs.chunk(2)[rank], targets.chunk(2)[rank]))
        results.append(fs.consolidate(step, state).params)
    difference = max(
        (a - b).abs().max().item() for a, b in zip(tree.leaves(results[0]), tree.leaves(results[1]))
    )
    return difference, sites.by_file(), graphs["unique_graphs"] - before, warned


def _compiled_unit_step_difference(backend: str) -> float:
    """One rank, `fully_shard` with the two Linear layers as units (their slots hold
    placeholders outside their calls): eager against compiled, max |diff| after two steps."""
    torch._dynamo.reset()
    mesh = fs.Mesh(dp=torch.distributed.get_world_size())
    results = []
    for compile_it in (False, True):
        step, state = _step(donate=True)
        step = fs.fully_shard(step, mesh, units=["inp", "out"])
        state = step.init(state.params, state.buffers)
        run = torch.compile(step, backend=backend) if compile_it else step
        for index in range(2):
            state, _ = run(state, _batch(index))
        results.append(fs.consolidate(step, state).params)
    return max(
        (a - b).abs().max().item() for a, b in zip(tree.leaves(results[0]), tree.leaves(results[1]))
    )


def test_compiled_fully_shard_step_with_submodule_units_equals_the_eager_step() -> None:
    # Dynamo reads a placeholder's metadata (`is_nested`, `_is_view`, `untyped_storage`, ...)
    # when it meets one in a parameter slot; those reads must pass, computation must not.
    (difference,) = fs.testing.run_spmd(_compiled_unit_step_difference, 1, "eager", timeout=300.0)
    assert difference <= 1e-6


# The local step's sites, with the optimizer's apply called from ZeRO's update instead, and
# ZeRO's own: each one a host read or a gloo collective.
SHARD_OPTIMIZER_BREAKS = {
    **{file: n for file, n in EXPECTED_BREAKS.items() if file != "optim/base.py"},
    # On purpose: the state check, in each phase, runs outside the graph as one call: it reads
    # the shard count's value and keys its cache of state specs by the params' treedef.
    "parallel/zero/plan.py": 2,
    # Required by torch: ZeRO's update (`ZeroOptimizer.apply`, called here) runs outside the
    # graph as one call: the optimizer's fused kernels, then the all-gathers on gloo.
    "plan.py": 1,
    # On purpose, as data_parallel's: the reducer's gradient hooks are made outside the graph
    # in one call, and run eagerly (autograd calls them once per leaf: compiled, each leaf's
    # shape was a recompilation). Then the live leaves' call and torch.autograd.grad.
    "grad.py": 3,
    # Required by torch: the last bucket's reduce-scatter, which the collector starts after
    # backward, on gloo in one call outside the graph (fscale/parallel/bucket_collectives.py),
    # and the reducer's peak of gradient bytes sampled then (`LiveBytes.sample`).
    "parallel/reduce_sessions.py": 2,
    # grad_bytes, as the local step.
    "memory.py": 1,
    # The bucket collector hands the last bucket's buffer to the reducer's peak of gradient
    # bytes (`LiveBytes.track`): weak references to storages, kept outside the graph.
    "parallel/buckets.py": 1,
    # Mesh.size takes math.prod of a generator, which Dynamo does not trace (torch 2.13). The
    # break is kept: with it the reducer's session is made after a resumed graph, and Dynamo can
    # carry it across the later breaks; made inside one graph (math.prod of a list), Dynamo
    # cannot rebuild its bound methods that the gradient hooks hold at the next break, and
    # runs the rest of value_and_grad eagerly with its stand-in treedef, which then fails.
    "distributed/mesh.py": 1,
}


# The local step's sites, and data parallelism's own: each a gloo collective or host code that
# Dynamo cannot rebuild across the breaks around it. Measured the same under torch 2.11 and 2.13.
DATA_PARALLEL_BREAKS = {
    **EXPECTED_BREAKS,
    # On purpose: the reducer's gradient hooks are made outside the graph in one call
    # (`AllReduceSession.hooks`): they hold the bucket collector, a bound method of which
    # Dynamo cannot rebuild at a later break ("no bytecode reconstruction"); made inside, the
    # rest of value_and_grad ran eagerly. The hooks themselves run eagerly (see ZeRO's, above).
    # Then, as the local step: the live leaves' call and
    # torch.autograd.grad, after which Dynamo cannot step the iterator over the gradients it
    # returned and runs the rest of `_value_and_grad_autograd` eagerly.
    "grad.py": 3,
    # Dynamo's stand-in for optree refuses to unflatten with optree's own treedef, which the
    # frame resumed after the hooks' call holds, and optree's C unflatten is not traced: the
    # live leaves' tree is built between graphs (two sites, the second the fallback's).
    "tree.py": 2,
    # Required by torch: the bucket's all-reduce on gloo, started from its gradient hook in one
    # call outside the graph (`all_reduce_bucket_start`, with the watchdog's bookkeeping).
    "parallel/reduce_sessions.py": 1,
    # Mesh.size in the step's agreement on unused parameters (as ZeRO's, above).
    "distributed/mesh.py": 1,
}

# The local step's sites, and fully_shard's own: its gathers and reduce-scatters are
# differentiable collectives (autograd Functions) whose forward Dynamo traces.
FULLY_SHARD_BREAKS = {
    **EXPECTED_BREAKS,
    # Required by torch: in the all-gather's and the reduce-scatter's forward, the host
    # bookkeeping before the collective, one call outside the graph each
    # (`fscale.distributed.debug.issue`), and the transfer's start (gloo's call with
    # async_op=True, which Dynamo refuses, or the shared-memory transport's host code).
    "distributed/sharding.py": 4,
    # Required by torch: the wait on the transfer, here the shared-memory worker's future (the
    # two ranks share a host; over gloo the break is the wait on gloo's work, in watchdog.py).
    "distributed/shared_memory.py": 1,
    # On purpose: the map that gathers the units' parameters makes its units and gatherer
    # outside the graph, in one call: made in the graph, Dynamo could not rebuild their bound
    # methods across the gathers' breaks and ran the map's call eagerly.
    "parallel/fsdp/plan.py": 1,
    # The update packs the new parameters back into the shard: comparing data pointers.
    "parallel/fsdp/units.py": 1,
    # Mesh.size in the gather's resolution of its axis (as ZeRO's, above).
    "distributed/mesh.py": 1,
}


# Each plan compiled whole by inductor (2 gloo ranks) equals the eager step after two steps
# (measured: to 1.5e-8), and breaks its graphs only at the sites listed for it above. The steps
# donate their state, but for ZeRO-1 (`shard_grads=False`), which covers the other way round.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan", "donate", "expected"),
    [
        ("data_parallel", True, DATA_PARALLEL_BREAKS),
        ("shard_optimizer", True, SHARD_OPTIMIZER_BREAKS),
        ("shard_optimizer(shard_grads=False)", False, None),
        ("fully_shard", True, FULLY_SHARD_BREAKS),
    ],
)
def test_compiled_multi_rank_step_equals_the_eager_step_and_breaks_only_where_expected(
    plan: str, donate: bool, expected: dict[str, int] | None
) -> None:
    results = fs.testing.run_spmd(_compiled_against_eager, 2, plan, donate, timeout=900.0)
    assert max(difference for difference, _, _, _ in results) <= 1e-6
    assert [second_step_graphs for _, _, second_step_graphs, _ in results] == [0, 0]
    assert [warned for _, _, _, warned in results] == [[], []]
    # The sites are those of a torch whose Dynamo traces optree's flatten (see `optree_traced`);
    # under torch 2.6 to 2.9 it breaks at every call, and only the equality is checked.
    if expected is not None and _dynamo_traces_optree():
        assert results[0][1] == results[1][1] == expected, [sites for _, sites, _, _ in results]


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["data_parallel", "shard_optimizer", "fully_shard"])
def test_multi_rank_step_of_a_compiled_loss_function_equals_the_eager_step(plan: str) -> None:
    results = fs.testing.run_spmd(_compiled_against_eager, 2, plan, True, "loss_fn", timeout=900.0)
    assert max(difference for difference, _, _, _ in results) <= 1e-6
    assert [second_step_graphs for _, _, second_step_graphs, _ in results] == [0, 0]
    assert [warned for _, _, _, warned in results] == [[], []]


def _stages(compiled: bool) -> nn.Sequential:
    """What the pipeline cuts: a Sequential of five layers, each compiled or not."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*[torch.compile(layer) if compiled else layer for layer in layers])


def _pipelined_compiled_against_eager(schedule: str) -> tuple[float, int]:
    """Two steps of a 2-stage pipeline whose micro-batches but the last are recomputed in
    backward, with stage layers eager and compiled: max |diff| of the parameters, and the
    graphs the compiled layers made in the second step (new parameter tensors every step)."""
    torch._dynamo.reset()
    mesh = fs.Mesh(pp=2)
    results = []
    graphs = torch._dynamo.utils.counters["stats"]
    for compiled in (False, True):
        stages = _stages(compiled)
        step = fs.pipeline(
            stages,
            torch.nn.functional.mse_loss,
            fs.optim.adamw(1e-2),
            mesh,
            micro_batches=4,
            schedule=schedule,
            balance=[3, 2],
            checkpoint="except_last",
        )
        _, params, buffers = fs.functionalize(stages)
        state = step.init(params, buffers)
        for index in range(2):
            generator = torch.Generator().manual_seed(index)
            batch = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
            before = graphs["unique_graphs"]
            state, _ = step(state, batch)
        results.append(tree.leaves(fs.consolidate(step, state).params))
    difference = max((a - b).abs().max().item() for a, b in zip(*results))
    return difference, graphs["unique_graphs"] - before


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_pipeline_of_compiled_layers_recomputed_in_backward_equals_the_eager_one(
    schedule: str,
) -> None:
    # A recompute that stops early runs backward through a retained graph, which a compiled
    # layer's backward (AOTAutograd, with buffers it donates) refuses, and a rerun outside the
    # compiled forward's conditions saves other tensors (zero_bubble): a call with compiled
    # code is recomputed whole instead.
    # The deferred linear layers find their weights among the stage's before the compiled code
    # runs: looked up inside it, they recompiled the last stage's layers every step.
    results = fs.testing.run_spmd(_pipelined_compiled_against_eager, 2, schedule, timeout=900.0)
    assert max(difference for difference, _ in results) <= 1e-6
    assert [recompiled for _, recompiled in results] == [0, 0]
