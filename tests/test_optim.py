"""fscale.optim: LAMB and Adafactor against the papers' equations, the `Sharding` hook,
chain / clip / partition / schedules, purity and donation, and errors at the boundary."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

import fscale
import fscale.optim as optim
from fscale import flat, tree
from fscale.flat import FlatBuffer
from fscale.optim import packing, schedules


def _make(seed: int, shift: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(5, 7, generator=gen) + shift,
        "blocks": [torch.randn(2, 3, 4, generator=gen) + shift, torch.randn(6, generator=gen)],
        "scale": torch.randn(1, generator=gen) + shift,
        "proj": torch.randn(3, 9, generator=gen) + shift,
    }


PARAMS = _make(0, shift=0.5)
GRADS = [_make(10 + i) for i in range(4)]


def _close(a, b, rtol=2e-5, atol=2e-6) -> None:
    tree.map(lambda x, y: torch.testing.assert_close(x, y, rtol=rtol, atol=atol), a, b)


def _train(opt, params=PARAMS, grads_seq=GRADS, **kwargs):
    state = opt.init(params, sharding=kwargs.get("sharding"))
    for grads in grads_seq:
        params, state = optim.step(opt, grads, state, params, **kwargs)
    return params, state


# ----------------------------------------------------------------------------- paper references


def _lamb_reference(params, grads_seq, lr, beta1, beta2, eps, wd):
    """You et al. 2019, Algorithm 2, one tensor at a time."""
    out = {}
    for path, p in zip(tree.paths(params), tree.leaves(params)):
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for t, grads in enumerate(grads_seq, 1):
            g = dict(zip(tree.paths(grads), tree.leaves(grads)))[path]
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            r = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + wd * p
            p_norm, r_norm = p.norm(), r.norm()
            trust = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
            p = p - lr * trust * r
        out[path] = p
    return tree.unflatten(tree.structure(params), [out[k] for k in tree.paths(params)])


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean().sqrt()


def _adafactor_reference(
    params,
    grads_seq,
    lr=None,
    clip=1.0,
    beta1=None,
    wd=0.0,
    scale=True,
    decay=0.8,
    eps1=1e-30,
    eps2=1e-3,
):
    """Shazeer & Stern 2018, Algorithms 4/5 (+ clipping, momentum), one tensor at a time."""
    out = {}
    for path, p in zip(tree.paths(params), tree.leaves(params)):
        factored = p.dim() >= 2
        row = torch.zeros(p.shape[:-1]) if factored else None
        col = torch.zeros(*p.shape[:-2], p.shape[-1]) if factored else None
        v = torch.zeros_like(p)
        m = torch.zeros_like(p)
        for t, grads in enumerate(grads_seq, 1):
            g = dict(zip(tree.paths(grads), tree.leaves(grads)))[path]
            beta2 = 1 - t ** (-decay)
            rho = min(1e-2, 1 / math.sqrt(t)) if lr is None else lr
            alpha = max(eps2, _rms(p).item()) * rho if scale else rho
            if factored:
                row = beta2 * row + (1 - beta2) * (g * g + eps1).sum(-1)
                col = beta2 * col + (1 - beta2) * (g * g + eps1).sum(-2)
                v = row[..., :, None] * col[..., None, :] / row.sum(-1)[..., None, None]
            else:
                v = beta2 * v + (1 - beta2) * (g * g + eps1)
            u = g / v.sqrt()
            if clip is not None:
                u = u / max(1.0, _rms(u).item() / clip)
            if beta1 is not None:
                m = beta1 * m + (1 - beta1) * u
                u = m
            p = p - alpha * (u + wd * p)
        out[path] = p
    return tree.unflatten(tree.structure(params), [out[k] for k in tree.paths(params)])


@given(
    lr=st.sampled_from([1e-3, 0.05]),
    betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9)]),
    eps=st.sampled_from([1e-6, 1e-3]),
    wd=st.sampled_from([0.0, 0.01]),
)
@settings(max_examples=examples(6))
def test_lamb_matches_paper(lr, betas, eps, wd):
    ours, _ = _train(optim.lamb(lr, betas=betas, eps=eps, weight_decay=wd))
    _close(ours, _lamb_reference(PARAMS, GRADS, lr, *betas, eps, wd))


def test_lamb_trust_ratio_is_one_for_zero_params():
    params = {"w": torch.zeros(4)}
    ours, _ = _train(optim.lamb(0.1), params, [{"w": torch.ones(4)}])
    _close(ours, _lamb_reference(params, [{"w": torch.ones(4)}], 0.1, 0.9, 0.999, 1e-6, 0.0))


@given(
    lr=st.sampled_from([None, 0.01]),
    clip=st.sampled_from([None, 1.0, 0.1]),
    beta1=st.sampled_from([None, 0.9]),
    wd=st.sampled_from([0.0, 0.1]),
    scale=st.booleans(),
)
@settings(max_examples=examples(8))
def test_adafactor_matches_paper(lr, clip, beta1, wd, scale):
    opt = optim.adafactor(
        lr, clip_threshold=clip, beta1=beta1, weight_decay=wd, scale_parameter=scale
    )
    ours, _ = _train(opt)
    _close(ours, _adafactor_reference(PARAMS, GRADS, lr, clip, beta1, wd, scale))


def test_adafactor_state_is_factored():
    _, state = _train(optim.adafactor())
    assert state.row["embed"].shape == (5,) and state.col["embed"].shape == (7,)
    assert state.row["blocks"][0].shape == (2, 3) and state.col["blocks"][0].shape == (2, 4)
    assert state.v["embed"].numel() == 0 and state.v["blocks"][1].shape == (6,)


# ------------------------------------------------------------------------ layout: simulated shards


class _ThreadGroup:
    """N ranks in threads; `all_reduce` sums every rank's tensor in rank order, as a collective."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = [0] * size

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.calls[rank] += 1
            self.barrier.wait()
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()  # everyone has read the slots before they are reused
            return total

        return reduce


def _shard(values, size: int, rank: int):
    leaves, treedef = tree.flatten(values)
    buffer = FlatBuffer(leaves, num_shards=size)
    pieces = buffer.fragment_views(rank, buffer.shard(rank))
    return tree.unflatten(treedef, [p.clone() for p in pieces]), buffer.fragments(rank)


def _train_sharded(opt, size: int, params=PARAMS, grads_seq=GRADS):
    """Train on `size` simulated ranks; returns the reassembled params and all-reduce calls."""
    group = _ThreadGroup(size)
    treedef = tree.structure(params)

    def rank_main(rank: int):
        local, fragments = _shard(params, size, rank)
        sharding = optim.Sharding(tree.unflatten(treedef, fragments), group.all_reduce(rank))
        state = opt.init(local, sharding=sharding)
        for grads in grads_seq:
            local_grads, _ = _shard(grads, size, rank)
            local, state = optim.step(opt, local_grads, state, local, sharding=sharding)
        return tree.leaves(local)

    with ThreadPoolExecutor(size) as pool:
        per_rank = list(pool.map(rank_main, range(size)))
    full = [
        torch.cat([per_rank[r][i] for r in range(size)]).view(p.shape)
        for i, p in enumerate(tree.leaves(params))
    ]
    return tree.unflatten(treedef, full), group.calls


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    ("make", "calls_per_step"),
    [
        (lambda: optim.lamb(0.05, weight_decay=0.01), 1),
        (lambda: optim.adafactor(clip_threshold=None, beta1=0.9), 1),
        (lambda: optim.adafactor(0.01, weight_decay=0.1), 2),
        (lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adam(0.01)), 1),
        (
            lambda: optim.partition(
                lambda path, leaf: "matrix" if leaf.dim() >= 2 else "vector",
                {
                    "matrix": optim.adafactor(clip_threshold=None),
                    "vector": optim.sgd(0.1, momentum=0.9),
                },
            ),
            1,
        ),
    ],
)
def test_sharded_update_equals_unsharded(size, make, calls_per_step):
    unsharded, _ = _train(make())
    sharded, calls = _train_sharded(make(), size)
    _close(sharded, unsharded)
    assert calls == [calls_per_step * len(GRADS)] * size


def test_sharding_must_match_params():
    opt = optim.lamb(0.1)
    params = {"w": torch.ones(4)}
    bad = optim.Sharding({"w": flat.Fragment(torch.Size([8]), 0, 3)}, lambda t: t)
    with pytest.raises(ValueError, match="fragment"):
        optim.step(opt, params, opt.init(params), params, sharding=bad)
    as_tuple = optim.Sharding({"w": flat.Fragment((2, 4), 2, 6)}, lambda t: t)
    new, _ = optim.step(opt, params, opt.init(params, sharding=as_tuple), params, sharding=as_tuple)
    assert new["w"].shape == (4,)
    wrong_tree = optim.Sharding([flat.Fragment(torch.Size([4]), 0, 4)], lambda t: t)
    with pytest.raises(ValueError, match="structure"):
        optim.step(opt, params, opt.init(params), params, sharding=wrong_tree)


# ----------------------------------------------------------------------------- combinators


def test_chain_scale_then_sgd_is_exact():
    ours, _ = _train(optim.chain(optim.scale(0.5), optim.sgd(0.1)))
    expected, _ = _train(optim.sgd(0.05))
    tree.map(lambda a, b: torch.equal(a, b) or pytest.fail("differs"), ours, expected)
    assert optim.chain(optim.sgd(0.1), optim.scale(2.0)).apply is None


def test_clip_by_global_norm():
    grads = GRADS[0]
    norm = torch.cat([g.reshape(-1) for g in tree.leaves(grads)]).norm()
    clipped, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    clipped_norm = torch.cat([g.reshape(-1) for g in tree.leaves(clipped)]).norm()
    torch.testing.assert_close(clipped_norm, torch.tensor(1.0), rtol=1e-5, atol=0)
    _close(clipped, tree.map(lambda g: g / (norm + 1e-6), grads))
    unchanged, _ = optim.clip_by_global_norm(1e3).update(grads, optim.EmptyState())
    tree.map(lambda a, b: torch.equal(a, b) or pytest.fail("changed"), unchanged, grads)


def test_float64_norms_are_computed_in_float64():
    """Clipping, LAMB and Adafactor must not round a float64 run's statistics to float32."""
    grads = tree.map(lambda g: g.double() * 3, GRADS[0])
    clipped, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in tree.leaves(grads)]
    for p, g in zip(reference, tree.leaves(grads)):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    for ours, p in zip(tree.leaves(clipped), reference):
        torch.testing.assert_close(ours, p.grad, rtol=1e-14, atol=0)
    params = tree.map(torch.Tensor.double, PARAMS)
    grads_seq = [tree.map(torch.Tensor.double, g) for g in GRADS]
    ours, _ = _train(optim.lamb(0.05, weight_decay=0.01), params, grads_seq)
    _close(
        ours,
        _lamb_reference(params, grads_seq, 0.05, 0.9, 0.999, 1e-6, 0.01),
        rtol=1e-13,
        atol=1e-15,
    )
    ours, _ = _train(optim.adafactor(beta1=0.9), params, grads_seq)
    _close(ours, _adafactor_reference(params, grads_seq, beta1=0.9), rtol=1e-13, atol=1e-15)


def test_step_without_apply_uses_update():
    opt = optim.scale(-0.1)
    new, _ = optim.step(opt, GRADS[0], opt.init(PARAMS), PARAMS)
    _close(new, tree.map(lambda p, g: p - 0.1 * g, PARAMS, GRADS[0]))


def test_update_and_apply_updates_agree_with_apply():
    opt = optim.adam(0.01)
    updates, _ = opt.update(GRADS[0], opt.init(PARAMS), PARAMS)
    exact, _ = opt.apply(GRADS[0], opt.init(PARAMS), PARAMS)
    _close(optim.apply_updates(PARAMS, updates), exact)


def test_partition_equals_torch_param_groups():
    """No weight decay and another lr for vectors: torch.optim's param groups, bit for bit."""
    label = lambda path, leaf: "decay" if leaf.dim() >= 2 else "plain"  # noqa: E731
    opt = optim.partition(
        label,
        {
            "decay": optim.adamw(0.01, weight_decay=0.1),
            "plain": optim.adamw(0.02, weight_decay=0.0),
        },
    )
    ours, _ = _train(opt)
    torch_params = [torch.nn.Parameter(p.clone()) for p in tree.leaves(PARAMS)]
    torch_opt = torch.optim.AdamW(
        [
            {"params": [p for p in torch_params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in torch_params if p.dim() < 2], "lr": 0.02, "weight_decay": 0.0},
        ],
        lr=0.01,
        fused=True,
    )
    for grads in GRADS:
        for p, g in zip(torch_params, tree.leaves(grads)):
            p.grad = g.clone()
        torch_opt.step()
    for a, b in zip(tree.leaves(ours), torch_params):
        assert torch.equal(a, b.detach())


def test_partition_with_a_frozen_group_keeps_the_other_group_exact():
    """A gradient-transform group (scale(0) freezes) must not cost the others bit-exactness."""
    labels = tree.map(lambda p: "a" if p.dim() >= 2 else "b", PARAMS)
    opt = optim.partition(labels, {"a": optim.sgd(0.1, momentum=0.9), "b": optim.scale(0.0)})
    ours, _ = _train(opt)
    alone, _ = _train(optim.sgd(0.1, momentum=0.9))
    for path, a, b, frozen in zip(
        tree.paths(ours), tree.leaves(ours), tree.leaves(alone), tree.leaves(PARAMS)
    ):
        expected = frozen if a.dim() < 2 else b
        assert torch.equal(a, expected), f"{path} differs"


def test_partition_labels_tree_and_errors():
    labels = tree.map(lambda p: "a" if p.dim() >= 2 else "b", PARAMS)
    opt = optim.partition(labels, {"a": optim.sgd(0.1), "b": optim.scale(0.0)})
    new, _ = _train(opt)
    assert torch.equal(new["scale"], PARAMS["scale"])
    assert optim.partition(labels, {"a": optim.scale(2.0), "b": optim.scale(0.0)}).apply is None
    with pytest.raises(ValueError, match="label 'c'"):
        optim.partition(lambda path, leaf: "c", {"a": optim.sgd(0.1)}).init(PARAMS)
    with pytest.raises(ValueError, match="structure"):
        optim.partition({"w": "a"}, {"a": optim.sgd(0.1)}).init(PARAMS)


# ----------------------------------------------------------------------------- schedules


def test_schedules_values():
    assert schedules.constant(0.3)(7) == 0.3
    warm = schedules.linear_warmup(1.0, warmup_steps=4, start=0.2)
    assert [warm(c) for c in (0, 2, 4, 100)] == pytest.approx([0.2, 0.6, 1.0, 1.0], abs=1e-15)
    cos = schedules.cosine(1.0, total_steps=12, warmup_steps=2, final=0.1)
    assert cos(0) == 0.0 and cos(1) == 0.5 and cos(2) == 1.0
    assert math.isclose(cos(7), 0.55) and cos(12) == pytest.approx(0.1) and cos(50) == cos(12)
    with pytest.raises(ValueError, match="total_steps"):
        schedules.cosine(1.0, total_steps=3, warmup_steps=3)
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.linear_warmup(1.0, warmup_steps=0)


def test_schedule_is_called_with_count():
    seen = []
    opt = optim.sgd(lambda count: seen.append(count) or 0.1)
    assert seen == [0]  # checked when the optimizer is built
    _train(opt)
    assert seen == [0, 0, 1, 2, 3]


# ----------------------------------------------------------------------------- purity and donation


OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam": lambda: optim.adam(0.01, amsgrad=True, maximize=True),
    "adamw": lambda: optim.adamw(0.01),
    "rmsprop": lambda: optim.rmsprop(0.01, momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": lambda: optim.adagrad(0.1, initial_accumulator_value=0.1),
    "adadelta": lambda: optim.adadelta(weight_decay=0.1, maximize=True),
    "adamax": lambda: optim.adamax(weight_decay=0.1),
    "lamb": lambda: optim.lamb(0.01, weight_decay=0.1),
    "adafactor": lambda: optim.adafactor(beta1=0.9, weight_decay=0.1),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.01)),
    "partition": lambda: optim.partition(
        lambda path, leaf: "m" if leaf.dim() >= 2 else "v",
        {"m": optim.lamb(0.01), "v": optim.sgd(0.1, momentum=0.9)},
    ),
}


def _clone(x):
    return tree.map(torch.clone, x)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b))) and (
        tree.structure(a) == tree.structure(b)
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pure_unless_donated(name):
    opt = OPTIMIZERS[name]()
    params, state = PARAMS, opt.init(PARAMS)
    params, state = optim.step(opt, GRADS[0], state, params)  # state past its first step
    saved = _clone((params, state, GRADS[1]))
    new_params, new_state = optim.step(opt, GRADS[1], state, params)
    assert _equal((params, state, GRADS[1]), saved), "inputs were mutated with donate=False"
    donated = optim.step(opt, GRADS[1], *_clone((state, params)), donate=True)
    assert _equal(donated, (new_params, new_state))
    again = optim.step(opt, GRADS[1], state, params)
    assert _equal(again, (new_params, new_state))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_params_that_require_grad_give_plain_results(name):
    """nn.Parameters (or live leaves, or views of one such buffer) are read as values."""
    opt = OPTIMIZERS[name]()
    expected = optim.step(opt, GRADS[0], opt.init(PARAMS), PARAMS)
    separate = tree.map(lambda p: torch.nn.Parameter(p.clone()), PARAMS)
    flat = torch.cat([p.reshape(-1) for p in tree.leaves(PARAMS)]).requires_grad_()
    views = tree.unflatten(
        tree.structure(PARAMS),
        [  # consecutive: copied as one span
            v.view(p.shape)
            for v, p in zip(
                flat.split([p.numel() for p in tree.leaves(PARAMS)]), tree.leaves(PARAMS)
            )
        ],
    )
    for params in (separate, views):
        result = optim.step(opt, GRADS[0], opt.init(params), params)
        assert _equal(result, expected)
        assert not any(t.requires_grad for t in tree.leaves(result))
        updates, _ = opt.update(GRADS[0], opt.init(params), params)
        assert not any(t.requires_grad for t in tree.leaves(updates))
    assert _equal(separate, PARAMS)


def test_outputs_are_views_of_flat_buffers_and_donation_is_in_place():
    opt = optim.adam(0.01)
    params, state = optim.step(opt, GRADS[0], opt.init(PARAMS), PARAMS)
    leaves = tree.leaves(params)
    assert packing.span(leaves) is not None  # next step copies one span, not each leaf
    assert all(packing.span(tree.leaves(field)) is not None for field in state[1:3])
    pointers = [t.data_ptr() for t in leaves]
    donated, _ = optim.step(opt, GRADS[1], state, params, donate=True)
    assert [t.data_ptr() for t in tree.leaves(donated)] == pointers


def test_mixed_dtypes_are_grouped():
    params = {"a": torch.ones(5), "b": torch.ones(3, dtype=torch.float64)}
    grads = tree.map(torch.ones_like, params)
    opt = optim.adam(0.1)
    new, state = optim.step(opt, grads, opt.init(params), params)
    assert new["b"].dtype == torch.float64 and state.exp_avg["b"].dtype == torch.float64
    torch.testing.assert_close(new["b"], torch.full((3,), 0.9, dtype=torch.float64))


POINTWISE = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax"]


@pytest.mark.parametrize("name", POINTWISE)
def test_each_dtype_group_steps_as_if_alone(name):
    """A mixed-dtype tree gives, leaf for leaf and bit for bit, what each dtype's subtree gives."""
    opt = OPTIMIZERS[name]()

    def some_double(tree_):
        return {k: v.double() if k in ("proj", "scale") else v for k, v in tree_.items()}

    params = some_double(PARAMS)
    grads_seq = [some_double(g) for g in GRADS[:2]]
    mixed = _train(opt, params, grads_seq)
    for keys in (["embed", "blocks"], ["proj", "scale"]):
        alone = _train(
            opt, {k: params[k] for k in keys}, [{k: g[k] for k in keys} for g in grads_seq]
        )
        assert _equal(alone[0], {k: mixed[0][k] for k in keys})


# ----------------------------------------------------------------------------- errors


def test_mismatched_trees_name_the_structures():
    opt = optim.adam()
    state = opt.init(PARAMS)
    grads = {k: v for k, v in GRADS[0].items() if k != "scale"}
    with pytest.raises(ValueError, match=r"`grads` has structure .* but `params` has structure"):
        optim.step(opt, grads, state, PARAMS)
    other = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"`state.exp_avg` has structure .*'w'"):
        optim.step(opt, other, state, other)
    with pytest.raises(ValueError, match="grads leaf 'embed' is"):
        optim.step(opt, dict(GRADS[0], embed=torch.ones(2)), state, PARAMS)


def test_integer_params_are_refused():
    with pytest.raises(TypeError, match=r"'n' has dtype torch\.int64"):
        optim.sgd(0.1).init({"n": torch.ones(3, dtype=torch.int64)})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.adam(-1e-3), "`lr` must be >= 0"),
        (lambda: optim.sgd(-0.1), "`lr` must be >= 0"),
        (lambda: optim.adam(eps=-1.0), "`eps` must be >= 0"),
        (lambda: optim.rmsprop(eps=-1.0), "`eps` must be >= 0"),
        (lambda: optim.lamb(eps=float("nan")), "`eps` must be >= 0"),
        (lambda: optim.adam(betas=(1.0, 0.9)), r"`betas\[0\]` must lie in \[0, 1\)"),
        (lambda: optim.adamax(betas=(0.9, -0.1)), r"`betas\[1\]` must be >= 0"),
        (lambda: optim.lamb(betas=(0.9,)), "pair"),
        (lambda: optim.adafactor(beta1=1.5), "`beta1` must lie in"),
        (lambda: optim.sgd(0.1, nesterov=True), "Nesterov"),
        (lambda: optim.chain(), "at least one"),
    ],
)
def test_bad_hyper_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="betas1"):
        optim.adam(1e-3, betas1=0.9)
    with pytest.raises(TypeError, match="momentom"):
        optim.sgd(0.1, momentom=0.9)


def test_negative_schedule_value_fails_at_that_step():
    opt = optim.adam(lambda count: 0.1 - 0.1 * count)
    params, state = optim.step(opt, GRADS[0], opt.init(PARAMS), PARAMS)
    params, state = optim.step(opt, GRADS[1], state, params)
    with pytest.raises(ValueError, match=r"returned -0\.1.* at count=2"):
        optim.step(opt, GRADS[2], state, params)


def test_wrong_state_type_and_missing_params():
    opt = optim.adam()
    with pytest.raises(TypeError, match="AdamState"):
        optim.step(opt, GRADS[0], optim.sgd(0.1).init(PARAMS), PARAMS)
    with pytest.raises(ValueError, match="`params` is required"):
        opt.update(GRADS[0], opt.init(PARAMS))


def test_clip_by_global_norm_keeps_scalar_leaves_scalar():
    grads = {"scale": torch.tensor(3.0), "w": torch.tensor([4.0])}
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    assert clipped["scale"].shape == () and clipped["w"].shape == (1,)
    assert torch.allclose(clipped["scale"], torch.tensor(0.6), atol=1e-6)


def test_optimizers_print_the_call_that_made_them():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, weight_decay=0.1))
    assert (
        repr(opt) == "chain(clip_by_global_norm(max_norm=1.0), adamw(lr=0.0003, weight_decay=0.1))"
    )
    assert repr(optim.partition(lambda path: "a", {"a": optim.sgd(0.1)})) == (
        "partition(labels=<lambda>, optimizers={'a': sgd(lr=0.1)})"
    )
    assert (
        repr(fscale.offload_optimizer(optim.sgd(0.1))) == "offload_optimizer(optimizer=sgd(lr=0.1))"
    )
    # The description is metadata only: optimizers with and without it behave the same.
    assert optim.sgd(0.1)._replace(description="").pointwise


def test_a_state_missing_a_buffer_its_configuration_needs_is_named():
    params = {"w": torch.ones(3)}
    plain = optim.sgd(0.1)
    with_momentum = optim.sgd(0.1, momentum=0.9)
    # A state made without momentum has no momentum buffer; the momentum step says which.
    with pytest.raises(TypeError, match=r"sgd: the state's `momentum_buffer` is None"):
        optim.step(with_momentum, {"w": torch.ones(3)}, plain.init(params), params)
