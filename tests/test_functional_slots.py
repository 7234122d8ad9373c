"""The slots a functional call swaps: resolved once, swapped directly, restored on any exit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fscale
import fscale.random as fsrandom
from fscale.functional import rng
from fscale.functional import slots as slots_lib


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # rebinds the buffer
        return self.head(self.norm(self.embed(tokens)))


def test_named_slots_resolves_every_alias_and_refuses_plain_attributes() -> None:
    net = _Tied()
    names = ["embed.weight", "norm.running_mean", "calls"]
    found = slots_lib.named_slots(net, names, {"embed.weight": ("embed.weight", "head.weight")})
    assert found is not None
    assert found["head.weight"] == (net.head, "_parameters", "weight")
    assert found["norm.running_mean"] == (net.norm, "_buffers", "running_mean")
    assert found["calls"] == (net, "_buffers", "calls")
    net.plain = torch.zeros(1)  # an attribute, not a registered tensor
    assert slots_lib.named_slots(net, ["plain"], {}) is None
    assert slots_lib.named_slots(net, ["missing.weight"], {}) is None


def test_holding_named_swaps_and_restores_even_when_the_block_raises() -> None:
    net = _Tied()
    own = net.embed.weight
    found = slots_lib.named_slots(net, ["embed.weight", "head.weight"], {})
    assert found is not None
    given = torch.ones(5, 3)
    seen = []

    def fails_inside() -> None:
        with slots_lib.holding_named(found, {"embed.weight": given, "head.weight": given}):
            seen.append(net.embed.weight is given and net.head.weight is given)
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails_inside()
    assert seen == [True]
    assert net.embed.weight is own and net.head.weight is own


def test_apply_walks_no_module_tree_and_keeps_tied_and_rebound_tensors() -> None:
    net = _Tied()
    apply, params, buffers = fscale.functionalize(net)
    tokens = torch.tensor([0, 1, 2, 4])
    expected = copy.deepcopy(net)(tokens)
    walks = []
    originals = {
        name: getattr(nn.Module, name)
        for name in ("named_modules", "named_parameters", "named_buffers", "get_submodule")
    }

    def counting(name):
        def method(self, *args, **kwargs):
            walks.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    try:
        for name in originals:
            setattr(nn.Module, name, counting(name))
        output, new_buffers = apply(params, buffers, tokens)
    finally:
        for name, method in originals.items():
            setattr(nn.Module, name, method)
    assert walks == []
    assert torch.equal(output, expected)
    assert float(new_buffers["calls"]) == 1.0 and float(buffers["calls"]) == 0.0
    assert net.head.weight is net.embed.weight


def test_seeded_by_restores_the_ambient_rng_when_the_block_raises() -> None:
    torch.manual_seed(0)
    ambient = torch.random.get_rng_state()

    def fails_inside() -> None:
        with rng.seeded_by(fsrandom.key(1), lambda: [torch.zeros(1)]):
            torch.rand(3)
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails_inside()
    assert torch.equal(torch.random.get_rng_state(), ambient)


def test_training_modes_sets_flags_inside_and_restores_them_even_when_the_block_raises() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.BatchNorm1d(2))
    model[1].eval()  # flags that differ from module to module
    before = [m.training for m in model.modules()]
    wanted = [(m, i % 2 == 0) for i, m in enumerate(model.modules())]
    with slots_lib.training_modes(wanted):
        assert [m.training for m in model.modules()] == [flag for _, flag in wanted]
        assert all(type(m.training) is bool for m in model.modules())
    assert [m.training for m in model.modules()] == before
    with pytest.raises(RuntimeError, match="inside"), slots_lib.training_modes(wanted):
        raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == before
    # The flags are the modules' own: train() and eval() still see and change them.
    with slots_lib.training_modes([(m, False) for m in model.modules()]):
        assert not any(m.training for m in model.modules())
        model.train()
        assert all(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before


def test_state_slots_with_the_owners_given_equals_its_own_walk() -> None:
    model = _Tied()
    tensors, slots, num_parameters = slots_lib.state_slots(model)
    given = slots_lib.state_slots(model, list(model.modules()))
    assert [id(t) for t in tensors] == [id(t) for t in given[0]]
    assert (slots, num_parameters) == (given[1], given[2])
    assert num_parameters == 3  # the tied weight once, the norm's weight and bias


def test_the_key_scans_the_call_tensors_for_accelerators_only_where_one_is_available(
    monkeypatch,
) -> None:
    scanned: list[bool] = []

    def call_tensors() -> list[object]:
        scanned.append(True)
        return [torch.zeros(1), torch.empty(2, device="meta"), "not a tensor"]

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert rng._accelerator_types(call_tensors) == [] and not scanned
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert rng._accelerator_types(call_tensors) == [] and scanned  # cpu and meta need no seed
