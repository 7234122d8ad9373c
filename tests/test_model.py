"""functionalize: the pure call equals the eager module, never mutates its inputs or the module."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fscale.random as fsrandom
from fscale import models
from fscale.functional import FunctionalModule, functionalize

Loss = Callable[[torch.Tensor], torch.Tensor]


def _tiny_gpt(dropout: float = 0.0) -> models.GPT:
    cfg = models.GPTConfig(
        vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dropout=dropout
    )
    return models.GPT(cfg, seed=1)


def _tiny_resnet() -> models.ResNet:
    return models.resnet(models.ResNetConfig(widths=(4, 8)), seed=2)


def _mlp_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], Loss]:
    gen = torch.Generator().manual_seed(10)
    x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
    return models.mlp([4, 8, 3], activation="tanh"), (x,), lambda out: (out - y).square().mean()


def _gpt_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], Loss]:
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 32, (3, 8), generator=gen)
    targets = torch.randint(0, 32, (3, 8), generator=gen)
    return _tiny_gpt(), (tokens,), lambda logits: models.lm_loss(logits, targets)


def _resnet_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], Loss]:
    gen = torch.Generator().manual_seed(12)
    images = torch.randn(4, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 10, (4,), generator=gen)
    return _tiny_resnet(), (images,), lambda logits: models.classification_loss(logits, labels)


CASES = {"mlp": _mlp_case, "gpt_tied": _gpt_case, "resnet_batchnorm": _resnet_case}


def _eager_grads(module: nn.Module, args: tuple, loss: Loss) -> dict[str, torch.Tensor]:
    """Gradients of eager `.backward()`, keyed by leaf name (a tied weight's grad is the sum)."""
    reference = copy.deepcopy(module)
    loss(reference(*args)).backward()
    return {name: p.grad for name, p in reference.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------
# Leaves


def test_params_and_buffers_share_the_module_memory() -> None:
    module = _tiny_resnet()
    apply, params, buffers = functionalize(module)
    assert isinstance(apply, FunctionalModule)
    assert list(params) == [name for name, _ in module.named_parameters()]
    assert list(buffers) == [name for name, _ in module.named_buffers()]
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, tensor in (params | buffers).items():
        assert tensor.data_ptr() == named[name].data_ptr()
        assert not tensor.requires_grad


def test_tied_weight_is_one_leaf_used_by_every_alias() -> None:
    module, (tokens,), _ = _gpt_case()
    apply, params, buffers = functionalize(module)
    assert "embed.token.weight" in params and "lm_head.weight" not in params
    assert apply.aliases == {"embed.token.weight": ("embed.token.weight", "lm_head.weight")}
    # The lm_head has no bias: with the one tied leaf zeroed, every logit must be zero, which
    # holds only if the output layer reads the leaf too.
    zeroed = params | {"embed.token.weight": torch.zeros_like(params["embed.token.weight"])}
    logits, _ = apply(zeroed, buffers, tokens)
    assert torch.equal(logits, torch.zeros_like(logits))


def test_frozen_parameters_are_buffers() -> None:
    module, (x,), loss = _mlp_case()
    module[0].weight.requires_grad_(False)
    apply, params, buffers = functionalize(module)
    assert "0.weight" not in params and list(buffers) == ["0.weight"]
    assert apply.frozen_names == ("0.weight",)
    out, new_buffers = apply(params, buffers, x)
    assert torch.equal(out, module(x))
    assert new_buffers["0.weight"] is buffers["0.weight"]
    grads = torch.func.grad(lambda p: loss(apply(p, buffers, x)[0]))(params)
    assert set(grads) == {"0.bias", "2.weight", "2.bias"}


# --------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("case", sorted(CASES))
def test_grads_equal_eager_backward_bit_for_bit(case: str) -> None:
    module, args, loss = CASES[case]()
    expected = _eager_grads(module, args, loss)
    apply, params, buffers = functionalize(module)

    def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss(apply(p, buffers, *args)[0])

    leaves = {name: t.detach().requires_grad_() for name, t in params.items()}
    autograd_grads = dict(zip(leaves, torch.autograd.grad(loss_of(leaves), list(leaves.values()))))
    func_grads = torch.func.grad(loss_of)(params)
    _, vjp_fn = torch.func.vjp(loss_of, params)
    (vjp_grads,) = vjp_fn(torch.ones(()))
    assert list(expected) == list(params)
    for grads in (autograd_grads, func_grads, vjp_grads):
        for name in params:
            assert torch.equal(grads[name], expected[name]), name


# --------------------------------------------------------------------------------------------
# Buffers


def test_batchnorm_statistics_come_back_and_inputs_are_untouched() -> None:
    module, (images,), _ = _resnet_case()
    eager = copy.deepcopy(module)
    expected_out = eager(images)
    apply, params, buffers = functionalize(module)
    before = {name: t.clone() for name, t in buffers.items()}

    out, new_buffers = apply(params, buffers, images)

    assert torch.equal(out, expected_out)
    assert list(new_buffers) == list(buffers) and new_buffers is not buffers
    for name, tensor in eager.named_buffers():
        assert torch.equal(new_buffers[name], tensor), name
        assert torch.equal(buffers[name], before[name]), name  # the input is unchanged
    assert int(new_buffers["stem.0.1.num_batches_tracked"]) == 1
    assert not torch.equal(new_buffers["stem.0.1.running_mean"], before["stem.0.1.running_mean"])


def test_eval_mode_uses_running_statistics_and_copies_nothing() -> None:
    module, (images,), _ = _resnet_case()
    apply, params, buffers = functionalize(module, train=False)
    eager = copy.deepcopy(module).eval()

    out, new_buffers = apply(params, buffers, images)

    assert torch.equal(out, eager(images))
    assert all(new_buffers[name] is buffers[name] for name in buffers)


class _Counter(nn.Module):
    """Counts its calls by rebinding a buffer, or by updating it in place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.scale = nn.Parameter(torch.ones(2))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.calls.add_(1)
        else:
            self.calls = self.calls + 1
        return x * self.scale


@pytest.mark.parametrize("train", [True, False])
def test_rebound_buffers_are_returned(train: bool) -> None:
    apply, params, buffers = functionalize(_Counter(in_place=False), train=train)
    _, new_buffers = apply(params, buffers, torch.ones(2))
    _, newer_buffers = apply(params, new_buffers, torch.ones(2))
    assert int(buffers["calls"]) == 0 and int(newer_buffers["calls"]) == 2


def test_in_place_update_in_eval_mode_is_reported() -> None:
    apply, params, buffers = functionalize(_Counter(in_place=True))
    _, new_buffers = apply(params, buffers, torch.ones(2))
    assert int(new_buffers["calls"]) == 1 and int(buffers["calls"]) == 0
    with pytest.raises(RuntimeError, match=r"evaluation mode .* modified buffers \['calls'\]"):
        apply(params, buffers, torch.ones(2), train=False)


# --------------------------------------------------------------------------------------------
# Mode and randomness


def test_module_training_flags_are_restored() -> None:
    module, (images,), _ = _resnet_case()
    module.stages[0].eval()  # a mix of flags, which must survive both modes
    flags = [m.training for m in module.modules()]
    seen: list[bool] = []
    module.head.register_forward_hook(lambda m, i, o: seen.append(m.training))
    apply, params, buffers = functionalize(module)
    for train in (True, False, None):
        apply(params, buffers, images, train=train)
        assert [m.training for m in module.modules()] == flags
    assert seen == [True, False, True]  # None falls back to functionalize's default


def _dropout_mlp() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 6))


def test_same_key_same_dropout_and_ambient_rng_untouched() -> None:
    apply, params, buffers = functionalize(_dropout_mlp())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    ambient = torch.get_rng_state()
    first, _ = apply(params, buffers, x, key=fsrandom.key(1))
    again, _ = apply(params, buffers, x, key=fsrandom.key(1))
    other, _ = apply(params, buffers, x, key=fsrandom.key(2))
    assert torch.equal(torch.get_rng_state(), ambient)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_key_driven_dropout_equals_eager_seeded_module() -> None:
    module = _tiny_gpt(dropout=0.3)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))
    key = fsrandom.fold_in(fsrandom.key(7), 3)
    apply, params, buffers = functionalize(module)
    out, _ = apply(params, buffers, tokens, key=key)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(fsrandom.seed(key))
        expected = module(tokens)
    assert torch.equal(out, expected)
    assert not torch.equal(out, apply(params, buffers, tokens, train=False)[0])


def test_without_key_dropout_draws_from_the_ambient_rng() -> None:
    module = _dropout_mlp()
    apply, params, buffers = functionalize(module)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        out, _ = apply(params, buffers, x)
        torch.manual_seed(5)
        expected = module(x)
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------------------------
# Errors


def test_functionalize_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"`module` must be a torch.nn.Module, got function"):
        functionalize(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`train` must be a bool, got str 'yes'"):
        functionalize(models.mlp([2, 2]), train="yes")  # type: ignore[arg-type]


def test_apply_lists_missing_and_unknown_names() -> None:
    module, (tokens,), _ = _gpt_case()
    apply, params, buffers = functionalize(module)
    broken = {k: v for k, v in params.items() if k != "final_norm.bias"}
    broken["lm_head.weight"] = params["embed.token.weight"]
    broken["no.such.weight"] = params["embed.token.weight"]
    with pytest.raises(ValueError, match="does not match") as info:
        apply(broken, buffers, tokens)
    message = str(info.value)
    assert "`params` does not match the module GPT" in message
    assert "missing: ['final_norm.bias']" in message
    assert "unknown: 'lm_head.weight' (tied to 'embed.token.weight'" in message
    assert "unknown: 'no.such.weight'\n" in message


def test_apply_points_misplaced_names_to_the_right_dict() -> None:
    module, (images,), _ = _resnet_case()
    apply, params, buffers = functionalize(module)
    moved = dict(params)
    moved["stem.0.1.running_mean"] = buffers["stem.0.1.running_mean"]
    with pytest.raises(ValueError, match=r"'stem.0.1.running_mean' \(a buffer: it belongs in"):
        apply(moved, buffers, images)
    with pytest.raises(ValueError, match=r"`buffers` .*\n  - missing: \['stem.0.1.running_mean'"):
        apply(params, {k: v for k, v in buffers.items() if k != "stem.0.1.running_mean"}, images)


def test_apply_rejects_wrong_types() -> None:
    apply, params, buffers = functionalize(models.mlp([2, 2]))
    x = torch.ones(1, 2)
    with pytest.raises(TypeError, match=r"`params` must be a dict of name -> tensor .* got list"):
        apply(list(params.values()), buffers, x)
    with pytest.raises(TypeError, match=r"`params\['0.bias'\]` must be a tensor, got float"):
        apply(params | {"0.bias": 0.0}, buffers, x)
    with pytest.raises(TypeError, match=r"`key` must be an fscale.random key .* got int 3"):
        apply(params, buffers, x, key=3)
    with pytest.raises(TypeError, match=r"`train` must be a bool, got int 1"):
        apply(params, buffers, x, train=1)
