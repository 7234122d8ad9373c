"""fscale.checkpoint: gradients equal the un-checkpointed function's under every grad path,
randomness and buffer updates replay once, memory drops to one input per block (exact bytes)."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fscale as fs
import fscale.random as fsrandom
from fscale.functional import functionalize
from fscale.models import GPT, GPTConfig, ResNetConfig, lm_loss, resnet
from fscale.offload import transfer
from fscale.remat import (
    MutatedArgumentError,
    checkpoint,
    checkpoint_call,
    name,
    save_matmuls,
    save_names,
    track,
)
from fscale.testing import run_spmd

# ----------------------------------------------------------------------------------------------
# helpers


def _f64(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)


def _block(x, w):
    """A small residual block with dropout drawn from the ambient RNG."""
    h = name(torch.tanh(x @ w), "hidden")
    return x + F.dropout(h, 0.25, training=True) @ w.t()


def _seeded_loss(fn):
    def loss(x, w):
        torch.manual_seed(7)
        return fn(x, w).sin().sum()

    return loss


def _grad_of_grad(loss):
    """The gradient in (x, w) of the squared norm of loss's gradient in x."""
    return torch.func.grad(lambda x, w: torch.func.grad(loss)(x, w).pow(2).sum(), (0, 1))


def _first_order(loss, path, x, w):
    if path == "autograd":
        return torch.autograd.grad(loss(x, w), (x, w))
    if path == "func.grad":
        return torch.func.grad(loss, argnums=(0, 1))(x, w)
    _, vjp_fn = torch.func.vjp(loss, x, w)
    with torch.no_grad():
        return vjp_fn(torch.ones((), dtype=torch.float64))


def _assert_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


class _CountOps(TorchDispatchMode):
    """Counts ATen operators by name."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = func.overloadpacket.__name__
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------
# gradients


POLICIES = [None, save_names("hidden"), save_matmuls()]


@pytest.mark.parametrize("path", ["autograd", "func.grad", "vjp"])
@pytest.mark.parametrize("policy", POLICIES, ids=["inputs", "names", "matmuls"])
def test_first_order_gradients_are_bit_exact(path, policy):
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    expected = _first_order(_seeded_loss(_block), path, x, w)
    actual = _first_order(_seeded_loss(checkpoint(_block, policy=policy)), path, x, w)
    _assert_equal(actual, expected)


@pytest.mark.parametrize("policy", POLICIES, ids=["inputs", "names", "matmuls"])
def test_second_order_gradients_match(policy):
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)

    def grad_norm(loss):
        return lambda x, w: torch.func.grad(loss)(x, w).pow(2).sum()

    plain, remat = _seeded_loss(_block), _seeded_loss(checkpoint(_block, policy=policy))
    expected = torch.func.grad(grad_norm(plain), argnums=(0, 1))(x, w)
    torch.testing.assert_close(torch.func.grad(grad_norm(remat), argnums=(0, 1))(x, w), expected)
    # The same through plain autograd with create_graph.
    (gx,) = torch.autograd.grad(remat(x, w), x, create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(gx.pow(2).sum(), (x, w)), expected)


@pytest.mark.parametrize("path", ["autograd", "func.grad", "vjp", "grad-of-grad"])
def test_nested_checkpoints(path):
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    inner = checkpoint(_block)
    outer = checkpoint(lambda x, w: inner(inner(x, w), w), policy=save_names("hidden"))
    plain, remat = (_seeded_loss(lambda x, w: _block(_block(x, w), w)), _seeded_loss(outer))
    if path == "grad-of-grad":
        expected, actual = (_grad_of_grad(f)(x, w) for f in (plain, remat))
        torch.testing.assert_close(actual, expected)
    else:
        # w is shared by both inner calls: its two contributions are summed in another order.
        torch.testing.assert_close(_first_order(remat, path, x, w), _first_order(plain, path, x, w))


def test_pytree_inputs_keywords_and_non_tensor_outputs():
    def fn(inputs, scale, *, bias=None, tag="t"):
        y = inputs["a"] * scale + inputs["pair"][0] @ inputs["pair"][1]
        if bias is not None:
            y = y + bias
        return {"y": y, "tag": tag, "count": torch.tensor(3), "none": None}

    def run(f):
        a, p, q, b = _f64(3, 3, seed=0), _f64(3, 4, seed=1), _f64(4, 3, seed=2), _f64(3, seed=3)
        out = f({"a": a, "pair": (p, q)}, 2.0, bias=b, tag="hello")
        return out, torch.autograd.grad(out["y"].pow(2).sum(), (a, p, q, b))

    (plain_out, expected), (out, actual) = run(fn), run(checkpoint(fn))
    assert torch.equal(out["y"], plain_out["y"])
    assert out["tag"] == "hello" and out["none"] is None
    assert out["count"].dtype == torch.int64 and not out["count"].requires_grad
    _assert_equal(actual, expected)


def test_decorator_forms_keep_the_signature():
    @checkpoint
    def plain(x):
        """Doubles."""
        return 2 * x

    @checkpoint(offload=True)
    def offloaded(x):
        return 3 * x

    assert plain.__name__ == "plain" and plain.__doc__ == "Doubles."
    assert plain.__wrapped__(torch.ones(1)).item() == 2.0
    x = torch.ones(2, requires_grad=True)
    assert torch.autograd.grad(offloaded(x).sum(), x)[0].tolist() == [3.0, 3.0]


def test_returning_an_input_or_a_view_of_it_under_offload():
    x = _f64(3, 4, seed=0)
    for fn in (lambda t: t, lambda t: t.t(), lambda t: t[1]):
        remat = checkpoint(fn, offload=True)
        expected = torch.autograd.grad(fn(x).sum() * 2, x)
        _assert_equal(torch.autograd.grad(remat(x).sum() * 2, x), expected)
        _assert_equal((torch.func.grad(lambda t, remat=remat: remat(t).sum() * 2)(x),), expected)


@pytest.mark.parametrize("path", ["autograd", "func.grad", "vjp"])
@pytest.mark.parametrize("policy", [None, save_names("hidden")], ids=["inputs", "names"])
def test_parked_copies_restore_exactly(monkeypatch, path, policy):
    # On CPU offloading is a no-op; pretending the tensors live on an accelerator sends the
    # inputs and kept values through the host copies a CUDA run uses.
    monkeypatch.setattr(transfer, "on_host", lambda t: False)
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    expected = _first_order(_seeded_loss(_block), path, x, w)
    remat = checkpoint(_block, offload=True, policy=policy)
    with track() as stats:
        actual = _first_order(_seeded_loss(remat), path, x, w)
    _assert_equal(actual, expected)
    assert stats.offloaded_bytes == stats.saved_bytes == (30 + 25 + (30 if policy else 0)) * 8


# ----------------------------------------------------------------------------------------------
# early stop: the first-order recompute ends with the last tensor backward reads


def _two_matmuls(x, w1, w2):
    return torch.tanh(x @ w1) @ w2  # nothing saves the second product


def test_the_recompute_stops_once_backward_has_every_saved_tensor():
    x, w1, w2 = _f64(4, 4, seed=1), _f64(4, 4, seed=2), _f64(4, 4, seed=3)
    expected = torch.autograd.grad(_two_matmuls(x, w1, w2).sum(), (x, w1, w2))
    y = checkpoint(_two_matmuls)(x, w1, w2)
    with _CountOps() as ops:
        got = torch.autograd.grad(y.sum(), (x, w1, w2))
    _assert_equal(got, expected)
    # Backward's four products and the recompute's first one; the second is not run again.
    assert ops.counts["mm"] == 5 and ops.counts["tanh"] == 1, ops.counts


def test_an_early_stopped_graph_differentiates_twice_with_retain_graph():
    x, w1, w2 = _f64(3, 4, seed=4), _f64(4, 4, seed=5), _f64(4, 2, seed=6)
    expected = torch.autograd.grad(_two_matmuls(x, w1, w2).sum(), (x, w1, w2))
    y = checkpoint(_two_matmuls)(x, w1, w2).sum()
    _assert_equal(torch.autograd.grad(y, (x, w1, w2), retain_graph=True), expected)
    _assert_equal(torch.autograd.grad(y, (x, w1, w2)), expected)


def test_a_recompute_that_saves_other_tensors_is_refused_with_the_cause():
    runs = []

    def changing(x):
        runs.append(1)
        return (x if len(runs) == 1 else x[:2]).sin().sum()

    x = _f64(4, seed=7)
    y = checkpoint(changing)(x)
    with pytest.raises(RuntimeError, match=r"saved a \(2,\) .* where the forward saved a \(4,\)"):
        torch.autograd.grad(y, x)
    with pytest.raises(TypeError, match="early_stop"):
        checkpoint_call(lambda state, x: x.sin(), (x,), early_stop=1)  # type: ignore[arg-type]


def test_a_finished_call_leaves_no_graph_behind():
    # The graph's saved-tensor hooks must not hold the call: that cycle runs through autograd's
    # C++ nodes, which the garbage collector cannot see, and leaked every call's graph.
    import gc

    from fscale.remat.early_stop import EarlyStopGraph

    x, w1, w2 = _f64(4, 4, seed=1), _f64(4, 4, seed=2), _f64(4, 4, seed=3)
    for _ in range(3):
        y = checkpoint(_two_matmuls)(x, w1, w2)
        torch.autograd.grad(y.sum(), (x, w1, w2))
        del y
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is EarlyStopGraph]


def test_the_recorded_graph_tells_whether_it_runs_compiled_code():
    # A call whose graph holds a compiled function's backward is recomputed whole (engine);
    # tests/test_compile.py trains compiled pipeline stages that way.
    from fscale.remat.early_stop import EarlyStopGraph

    w = _f64(4, 4, seed=1)

    def fn(tensors):
        return (torch.relu(tensors[0] @ tensors[1]) @ tensors[1]).sum()

    torch._dynamo.reset()
    found = []
    for run in (fn, torch.compile(fn, backend="aot_eager")):
        graph = EarlyStopGraph()
        graph.outputs = [graph.build(run, [_f64(3, 4, seed=2), w])]
        found.append(graph.runs_compiled_code())
    torch._dynamo.reset()
    assert found == [False, True]


def test_without_early_stop_the_recompute_runs_to_the_end():
    x, w1, w2 = _f64(4, 4, seed=1), _f64(4, 4, seed=2), _f64(4, 4, seed=3)
    y = checkpoint_call(
        lambda state, x: _two_matmuls(x, *state), (x,), state=[w1, w2], early_stop=False
    )
    with _CountOps() as ops:
        torch.autograd.grad(y.sum(), (x, w1, w2))
    assert ops.counts["mm"] == 6, ops.counts


# ----------------------------------------------------------------------------------------------
# what runs, what is kept


def test_no_grad_just_runs_fn_and_keeps_nothing():
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin() * 2

    remat = checkpoint(fn)
    x = torch.ones(3, requires_grad=True)
    with track() as stats, torch.no_grad():
        remat(x)
    assert len(calls) == 1 and stats.calls == 0 and stats.saved_bytes == 0
    with track() as stats:
        torch.autograd.grad(remat(x).sum(), x)
    assert len(calls) == 3 and stats.calls == 1 and stats.recomputations == 1
    assert stats.saved_bytes == 12  # x only


def test_named_value_is_not_recomputed():
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    for policy, expected_tanh in ((None, 2), (save_names("hidden"), 1)):
        with _CountOps() as ops:
            torch.autograd.grad(checkpoint(_block, policy=policy)(x, w).sum(), (x, w))
        assert ops.counts["tanh"] == expected_tanh  # forward, plus the recompute without name
    with _CountOps() as ops:
        torch.autograd.grad(checkpoint(_block, policy=save_matmuls())(x, w).sum(), (x, w))
    # 2 forward products, none recomputed; 4 in backward (2 per product).
    assert ops.counts["mm"] == 6


def test_named_value_modified_in_place_is_recomputed_exactly():
    def fn(x):
        h = x * 3.0
        h.add_(1.0)  # after the op that made it: replaying that op's output would add twice
        return name(h, "h").sin()

    x = _f64(4, seed=0)
    expected = torch.autograd.grad(fn(x).sum(), x)
    _assert_equal(torch.autograd.grad(checkpoint(fn, policy=save_names("h"))(x).sum(), x), expected)


def test_policy_name_never_marked_lists_the_names_that_were():
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    remat = checkpoint(_block, policy=save_names("hiden", "hidden"))
    with pytest.raises(ValueError, match=r"\['hiden'\] were never marked.*were \['hidden'\]"):
        remat(x, w).sum().backward()


def test_name_is_an_identity_outside_checkpoints():
    x = torch.ones(2)
    assert name(x, "anything") is x
    with pytest.raises(TypeError, match="`label` must be a string"):
        name(x, 3)
    with pytest.raises(TypeError, match="`value` must be a tensor"):
        name([1.0], "a")


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"`fn` must be a callable or an nn\.Module, got int"):
        checkpoint(3)
    with pytest.raises(TypeError, match="`offload` must be True or False"):
        checkpoint(torch.sin, offload="yes")
    with pytest.raises(TypeError, match="`policy` must be None or a SavePolicy"):
        checkpoint(torch.sin, policy=["attn"])
    with pytest.raises(ValueError, match="at least one name"):
        save_names()
    with pytest.raises(TypeError, match="names must be strings"):
        save_names("a", 1)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint(checkpoint(nn.Linear(2, 2)))


def test_backward_leaves_the_ambient_rng_where_forward_left_it():
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    streams = []
    for fn in (_block, checkpoint(_block)):
        torch.manual_seed(3)
        torch.autograd.grad(fn(x, w).sum(), (x, w))
        streams.append(torch.rand(4))
    _assert_equal(streams[1:], streams[:1])


# ----------------------------------------------------------------------------------------------
# modules


def test_checkpointed_module_shares_weights_keeps_names_and_leaves_the_original():
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    remat = checkpoint(block)
    assert isinstance(remat, nn.Sequential) and type(remat).__name__ == "CheckpointedSequential"
    assert list(remat.state_dict()) == list(block.state_dict())
    assert remat[0].weight is block[0].weight
    assert type(block) is nn.Sequential
    for clone in (copy.deepcopy(remat), pickle.loads(pickle.dumps(remat))):
        assert type(clone).__name__ == "CheckpointedSequential"
        torch.testing.assert_close(clone(torch.ones(1, 3)), block(torch.ones(1, 3)))


def test_tied_weights_get_every_use_in_their_gradient():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    module, x = Tied().double(), _f64(2, 3, seed=0)
    apply, params, buffers = functionalize(module)
    remat_apply, _, _ = functionalize(checkpoint(module))

    def grads(apply_fn):
        return torch.func.grad(lambda p: apply_fn(p, buffers, x)[0].pow(2).sum())(params)

    expected, actual = grads(apply), grads(remat_apply)
    assert list(actual) == list(expected) == ["a.weight", "a.bias", "b.bias"]
    _assert_equal(list(actual.values()), list(expected.values()))


def _gpt(checkpoint_blocks, **options):
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=2, dropout=0.2)
    model = GPT(cfg, seed=0)
    if checkpoint_blocks:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint(block, **options)
    return model


@pytest.mark.parametrize("path", ["autograd", "func.grad"])
@pytest.mark.parametrize("offload", [False, True])
def test_gpt_blocks_with_key_seeded_dropout_are_bit_exact(path, offload):
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    key = fsrandom.key(11)

    def grads(model):
        apply, params, buffers = functionalize(model)

        def loss(p):
            logits, _ = apply(p, buffers, tokens[:, :-1], key=key)
            return lm_loss(logits, tokens[:, 1:])

        if path == "func.grad":
            return torch.func.grad(loss)(params)
        leaves = {k: v.requires_grad_() for k, v in params.items()}
        return dict(zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values()))))

    expected, actual = grads(_gpt(False)), grads(_gpt(True, offload=offload))
    assert list(actual) == list(expected)
    _assert_equal(list(actual.values()), list(expected.values()))


def test_batchnorm_running_stats_are_updated_once():
    cfg = ResNetConfig(widths=(4, 8), blocks_per_stage=1)
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))

    def step(model):
        apply, params, buffers = functionalize(model)
        leaves = {k: v.requires_grad_() for k, v in params.items()}
        logits, new_buffers = apply(leaves, buffers, images)
        return torch.autograd.grad(logits.pow(2).mean(), list(leaves.values())), new_buffers

    model = resnet(cfg, seed=0)
    expected_grads, expected_buffers = step(model)
    for stage in model.stages:
        stage[0] = checkpoint(stage[0])
    grads, new_buffers = step(model)
    _assert_equal(grads, expected_grads)
    assert new_buffers.keys() == expected_buffers.keys()
    _assert_equal(list(new_buffers.values()), list(expected_buffers.values()))


# ----------------------------------------------------------------------------------------------
# memory


def _saved_activation_bytes(model, x):
    """Bytes of the storages autograd saves for backward, parameters excluded."""
    apply, params, buffers = functionalize(model)
    params = {k: v.requires_grad_() for k, v in params.items()}
    state = {t.untyped_storage().data_ptr() for t in (*params.values(), *buffers.values())}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = apply(params, buffers, x)
    return sum(saved.values()), y


class _Blocks(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_checkpoint_per_block_keeps_one_input_per_block():
    batch, seq, d_model, heads, layers = 2, 256, 32, 2, 3
    cfg = GPTConfig(vocab_size=64, seq_len=seq, d_model=d_model, n_heads=heads, n_layers=layers)
    blocks = GPT(cfg, seed=0).blocks
    x = torch.randn(batch, seq, d_model)
    plain_bytes, _ = _saved_activation_bytes(_Blocks(blocks), x)
    remat = _Blocks(nn.ModuleList(checkpoint(b) for b in blocks))
    with track() as stats:
        remat_bytes, _ = _saved_activation_bytes(remat, x)

    # A pre-LN block saves, in units of one [B, T, d] float32 activation: its input and the
    # residual after attention (1 + 1), both LayerNorm outputs (2), q/k/v (3), the attention
    # output (1), the MLP's hidden pre- and post-GELU (4 + 4): 16 units; plus per position the
    # two LayerNorms' mean and rstd (4 floats) and the attention log-sum-exp per head.
    activation = batch * seq * d_model * 4
    per_block = 16 * activation + batch * seq * (4 + heads) * 4
    assert plain_bytes == pytest.approx(layers * per_block, rel=0.02)
    # Checkpointed, each block keeps exactly its input.
    assert remat_bytes == layers * activation == stats.saved_bytes
    assert plain_bytes / remat_bytes == pytest.approx(16 + (4 + heads) / d_model, rel=0.02)


def test_offload_on_cpu_accounts_every_saved_byte_as_offloaded():
    cfg = GPTConfig(vocab_size=64, seq_len=64, d_model=16, n_heads=2, n_layers=3)
    model = GPT(cfg, seed=0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint(block, offload=True)
    x = torch.randn(2, 64, 16)
    with track() as stats:
        saved, y = _saved_activation_bytes(_Blocks(model.blocks), x)
        y.sum().backward()
    assert stats.calls == stats.recomputations == 3
    assert stats.offloaded_bytes == stats.saved_bytes == 3 * x.numel() * 4
    assert saved == 3 * x.numel() * 4  # on CPU, "offloaded" inputs stay where they are


def test_named_values_are_counted_as_saved():
    x, w = _f64(6, 5, seed=0), _f64(5, 5, seed=1)
    with track() as stats:
        checkpoint(_block, policy=save_names("hidden"))(x, w)
    # x and w (inputs) and the kept tanh output, all float64.
    assert stats.saved_bytes == (6 * 5 + 5 * 5 + 6 * 5) * 8


@pytest.mark.parametrize(("module_mode", "call_mode"), [(True, True), (False, True), (True, False)])
def test_recompute_replays_the_train_mode_of_its_forward(module_mode, call_mode):
    """functionalize's apply restores the modules' modes before backward recomputes."""
    import copy

    import fscale as fs
    from fscale import models

    cfg = models.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dropout=0.3)
    plain = models.GPT(cfg)
    checkpointed = copy.deepcopy(plain)
    for i, block in enumerate(checkpointed.blocks):
        checkpointed.blocks[i] = fs.checkpoint(block)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))

    def grads(model):
        model.train(module_mode)
        apply, params, buffers = fs.functionalize(model)

        def loss_fn(p, b, batch, key):
            out, _ = apply(p, b, batch[:, :-1], key=key, train=call_mode)
            return models.lm_loss(out, batch[:, 1:])

        return fs.value_and_grad(loss_fn, params, buffers, tokens, fs.random.key(3))[1]

    expected, actual = grads(plain), grads(checkpointed)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# ----------------------------------------------------------------------------------------------
# checkpoint_call: one call with extra inputs


def _scaled_block(state, x, *, shift):
    """fn for checkpoint_call: `state` = (weight, buffer), the buffer updated in place when it
    is a float64 one (torch.func refuses in-place updates of tensors it did not create)."""
    w, running = state
    if running.dtype == torch.float64:
        with torch.no_grad():
            running.mul_(0.5).add_(x.detach().mean())
    return torch.tanh(x @ w + shift) * running.sum()


@pytest.mark.parametrize("path", ["autograd", "func.grad"])
def test_checkpoint_call_extra_inputs_get_exact_gradients_and_fn_is_recomputed(path):
    x, w = _f64(4, 3, seed=0), _f64(3, 3, seed=1)
    shift = _f64(3, seed=2)

    def loss(fn, x, w, shift, running):
        return fn([w, running], x, shift=shift).sin().sum()

    calls = []

    def counted(state, x, *, shift):
        calls.append(1)
        return _scaled_block(state, x, shift=shift)

    def remat(state, x, *, shift):
        return checkpoint_call(counted, (x,), {"shift": shift}, state=state, mutable=[1])

    results = {}
    for label, fn in (("plain", _scaled_block), ("remat", remat)):
        running = torch.ones(2, dtype=torch.float64 if path == "autograd" else torch.float32)
        if path == "autograd":
            grads = torch.autograd.grad(loss(fn, x, w, shift, running), (x, w, shift))
        else:
            grads = torch.func.grad(
                lambda x, w, shift, fn=fn, running=running: loss(fn, x, w, shift, running),
                argnums=(0, 1, 2),
            )(x, w, shift)
        results[label] = (grads, running)
    _assert_equal(results["remat"][0], results["plain"][0])
    # The buffer is updated once (by the forward), not again by the recompute.
    _assert_equal((results["remat"][1],), (results["plain"][1],))
    assert path != "autograd" or not torch.equal(results["remat"][1], torch.ones(2))
    assert len(calls) == 2  # the forward, and the recompute in backward


def test_checkpoint_call_keeps_arguments_but_not_state():
    x, w = _f64(4, 3, seed=0), _f64(3, 3, seed=1)
    with track() as stats:
        y = checkpoint_call(lambda state, x: x @ state[0], (x,), state=[w])
        torch.autograd.grad(y.sum(), (x, w))
    assert stats.calls == 1 and stats.recomputations == 1
    assert stats.saved_bytes == 4 * 3 * 8  # x only: the caller holds w anyway
    with torch.no_grad():
        assert torch.equal(checkpoint_call(lambda state, x: x @ state[0], [x], state=[w]), x @ w)


def test_checkpoint_call_refuses_bad_arguments():
    x = _f64(2, seed=0)

    def fn(state, x):
        return x * 2

    with pytest.raises(TypeError, match="`fn` must be callable"):
        checkpoint_call(3, (x,))
    with pytest.raises(TypeError, match="`args` must be a tuple or list"):
        checkpoint_call(fn, x)
    with pytest.raises(TypeError, match="`kwargs` must be a mapping"):
        checkpoint_call(fn, (x,), [1])
    with pytest.raises(TypeError, match=r"`state\[1\]` must be a tensor"):
        checkpoint_call(fn, (x,), state=[x, 1.0])
    for mutable in ([1], [0.0], ["0"], [True]):  # out of range, or not an int
        with pytest.raises(ValueError, match="`mutable` must hold indexes into `state`"):
            checkpoint_call(fn, (x,), state=[x], mutable=mutable)
    with pytest.raises(TypeError, match="`offload` must be True or False"):
        checkpoint_call(fn, (x,), offload=1)
    with pytest.raises(TypeError, match="`policy` must be None or a SavePolicy"):
        checkpoint_call(fn, (x,), policy="attn")


# ----------------------------------------------------------------------------------------------
# side effects on non-tensor arguments


class _Cache:
    """A key/value cache as transformers keeps one: each call appends its keys to a layer."""

    def __init__(self):
        self.keys = []

    def update(self, key):
        self.keys.append(key)
        return torch.cat(self.keys)


class _CachedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, cache=None, scale=1.0):
        k = self.proj(x)
        keys = k if cache is None else cache.update(k)
        return (x @ keys.t()).softmax(-1) @ keys * scale


def test_a_forward_that_changes_a_non_tensor_argument_is_refused_with_the_fix():
    block = checkpoint(_CachedBlock())
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(MutatedArgumentError, match=r"argument `cache` \(a _Cache\)") as error:
        block(x, cache=_Cache())
    assert "use_cache=False" in str(error.value)
    assert isinstance(error.value, ValueError)
    # Positional, and inside a pytree: named by position and path.
    with pytest.raises(MutatedArgumentError, match=r"argument at position 1 \(inside it: 0\)"):
        checkpoint(lambda x, caches: caches[0].update(x).sum())(x, [_Cache()])


def test_a_tensor_attribute_updated_in_place_or_rebound_counts_as_a_change():
    class Counter:
        def __init__(self):
            self.total = torch.zeros(())

    def add_in_place(x, counter):
        counter.total += 1
        return x * 2

    def rebind(x, counter):
        counter.total = counter.total + 1
        return x * 2

    x = torch.randn(3, requires_grad=True)
    for fn in (add_in_place, rebind):
        with pytest.raises(MutatedArgumentError, match="position 1"):
            checkpoint(fn)(x, Counter())


def test_arguments_only_read_pass_and_nothing_is_checked_without_recompute():
    block = _CachedBlock()
    checkpointed = checkpoint(block)
    x = torch.randn(3, 4, requires_grad=True)
    cache = _Cache()
    cache.update(torch.ones(2, 4))

    def read_only(x, cache, config):
        return (x @ cache.keys[0].t()).sum() * config["scale"]

    config = {"scale": 0.5, "names": ["a"]}
    y = checkpoint(read_only)(x, cache, config)
    (grad,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(grad, torch.ones(3, 2) @ cache.keys[0] * 0.5)
    # No recompute, no check: the cache is appended to once, as in eager code.
    with torch.no_grad():
        checkpointed(x, cache=cache)
    assert len(cache.keys) == 2
    # A module without a cache works as before.
    torch.testing.assert_close(checkpointed(x), block(x))


class _CachedStack(nn.Module):
    """Blocks that share one cache argument, as a transformers decoder's layers do."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_CachedBlock(), _CachedBlock()])

    def forward(self, x, use_cache=True):
        cache = _Cache() if use_cache else None
        for block in self.blocks:
            x = block(x, cache=cache)
        return x


def _fully_shard_remat(use_cache):
    torch.manual_seed(0)
    apply, params, buffers = functionalize(_CachedStack())

    def loss_fn(params, buffers, x, key):
        return apply(params, buffers, x, use_cache=use_cache, key=key)[0].square().mean()

    world = dist.get_world_size()
    step = fs.fully_shard(
        fs.train_step(loss_fn, fs.optim.sgd(0.1)), fs.Mesh(dp=world), reshard_after_forward="remat"
    )
    state = step.init(params, buffers)
    try:
        _, metrics = step(state, torch.randn(2, 4))
    except MutatedArgumentError as error:
        return str(error)
    return float(metrics["loss"])


def test_fully_shard_remat_refuses_a_cache_argument_on_every_rank():
    for message in run_spmd(_fully_shard_remat, 2, True):
        assert "argument `cache` (a _Cache)" in message and "use_cache=False" in message
    assert all(isinstance(loss, float) for loss in run_spmd(_fully_shard_remat, 2, False))
