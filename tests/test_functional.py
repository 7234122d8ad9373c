"""fscale.functional's parts one by one: modes, RNG seeding, buffer capture, unit placement."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

import fscale
import fscale.random as fsrandom
from fscale import functional
from fscale.functional import buffers as buffers_lib
from fscale.functional import rng, unit_calls
from fscale.functional import slots as slots_lib
from fscale.functional.units import UnitCall, UnitParams


def test_the_package_exports_the_functional_call() -> None:
    assert fscale.functionalize is functional.functionalize
    assert fscale.FunctionalModule is functional.FunctionalModule


# ---------------------------------------------------------------------------------- laziness


_IMPORT_PROBE = """
import sys
import torch
before = set(sys.modules)
import fscale
loaded = set(sys.modules) - before
print(sorted(m for m in loaded if m.split(".")[0] == "multiprocessing"))
print("fscale.testing" in sys.modules, "fscale.models" in sys.modules)
print("models" in dir(fscale), "testing" in dir(fscale))
print(fscale.models.GPT.__name__, fscale.testing.run_spmd.__name__)
print("fscale.testing" in sys.modules, "fscale.models" in sys.modules)
"""


def test_import_fscale_loads_neither_the_rank_pool_nor_the_reference_models() -> None:
    # A fresh interpreter: this one has imported everything already. torch itself imports
    # multiprocessing, so only what `import fscale` adds on top of torch is fscale's doing.
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    assert lines == [
        "[]",
        "False False",
        "True True",
        "GPT run_spmd",
        "True True",
    ], result.stderr


def test_an_unknown_attribute_of_fscale_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        fscale.nonexistent  # noqa: B018
    assert not hasattr(fscale, "nonexistent")


# ------------------------------------------------------------------------------------- slots


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.BatchNorm1d(2)))


def test_mode_switches_every_submodule_and_restores_each_own_flag() -> None:
    net = _net()
    net[1].eval()  # a submodule whose flag differs from its parent's
    before = [m.training for m in net.modules()]
    with slots_lib.mode(net, False, list(net.modules())):
        assert not any(m.training for m in net.modules())
    assert [m.training for m in net.modules()] == before
    seen = []

    def fails_inside() -> None:
        with slots_lib.mode(net, True, list(net.modules())):
            seen.append(all(m.training for m in net.modules()))
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails_inside()
    assert seen == [True]
    assert [m.training for m in net.modules()] == before


def test_mode_does_not_call_train_when_the_flags_already_match() -> None:
    class Counting(nn.Linear):
        calls = 0

        def train(self, mode: bool = True) -> Counting:
            Counting.calls += 1
            return super().train(mode)

    net = Counting(2, 2)
    with slots_lib.mode(net, True, list(net.modules())):
        pass
    assert Counting.calls == 0
    with slots_lib.mode(net, False, list(net.modules())):
        assert not net.training
    assert Counting.calls == 1 and net.training


# --------------------------------------------------------------------------------------- rng


def test_seeded_by_draws_what_manual_seed_draws_and_leaves_the_ambient_rng() -> None:
    key = fsrandom.key(3)
    torch.manual_seed(fsrandom.seed(key))
    expected = torch.rand(4)
    torch.manual_seed(0)
    ambient = torch.random.get_rng_state()
    with rng.seeded_by(key, lambda: [torch.zeros(1)]):
        drawn = torch.rand(4)
    assert torch.equal(drawn, expected)
    assert torch.equal(torch.random.get_rng_state(), ambient)


def test_seeded_by_without_a_key_draws_from_the_ambient_rng() -> None:
    def never_called() -> list[Any]:
        raise AssertionError("call_tensors is only needed with a key")

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with rng.seeded_by(None, never_called):
        drawn = torch.rand(3)
    assert torch.equal(drawn, expected)
    assert not torch.equal(torch.rand(3), expected)  # the ambient generator advanced


# ----------------------------------------------------------------------------------- buffers


class _Rebinds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x


def test_capture_records_buffers_at_the_end_of_forward_and_unhooks() -> None:
    net = _Rebinds()
    captured: dict[str, torch.Tensor] = {}
    with buffers_lib.capture(net, ["count"], captured):
        net(torch.ones(1))
    assert captured["count"].item() == 1
    captured.clear()
    net(torch.ones(1))
    assert captured == {}


def test_check_not_modified_names_every_buffer_changed_in_place() -> None:
    tensors = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}
    before = buffers_lib.versions(tensors)
    buffers_lib.check_not_modified(tensors, before)  # nothing changed: no error
    tensors["a"].add_(1)
    tensors["c"].copy_(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"modified buffers \['a', 'c'\] in place"):
        buffers_lib.check_not_modified(tensors, before)


# -------------------------------------------------------------------------------- unit calls


class _Unit:
    def __init__(self, name: str, values: Mapping[str, torch.Tensor]) -> None:
        self.name = name
        self.names = tuple(values)
        self.values = dict(values)
        self.calls = 0

    def materialize(self) -> Mapping[str, torch.Tensor]:
        return self.values

    def call(self, call: UnitCall) -> Any:
        self.calls += 1
        return call.run(self.values, call.state, call.args, call.kwargs)


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))])
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _units(params: Mapping[str, torch.Tensor], *prefixes: str) -> list[_Unit]:
    return [
        _Unit(prefix, {k: v for k, v in params.items() if k.startswith(prefix + ".")})
        for prefix in prefixes
    ]


def _module_units(module: nn.Module, params: UnitParams) -> dict[str, Any]:
    names = tuple(name for name, _ in module.named_parameters())
    return unit_calls.module_units(module, params, param_names=names, aliases={}, hint=str)


def test_module_units_are_the_units_named_after_a_called_submodule() -> None:
    tower = _Tower()
    params = dict(tower.named_parameters())
    by_block, container = _units(params, "blocks.0"), _units(params, "blocks")
    picked = _module_units(
        tower,
        UnitParams({k: v for k, v in params.items() if not k.startswith("blocks.0.")}, by_block),
    )
    assert list(picked) == ["blocks.0"]
    # A ModuleList is iterated, never called: its unit is materialized before the call.
    rest = {k: v for k, v in params.items() if not k.startswith("blocks.")}
    assert _module_units(tower, UnitParams(rest, container)) == {}


def test_module_units_refuse_nested_units_and_mismatched_names() -> None:
    tower = _Tower()
    params = dict(tower.named_parameters())
    outer = _Unit("blocks.1", {"blocks.1.0.weight": params["blocks.1.0.weight"]})
    inner = _Unit("blocks.1.0", {"blocks.1.0.bias": params["blocks.1.0.bias"]})
    rest = {k: v for k, v in params.items() if not k.startswith("blocks.1.")}
    with pytest.raises(ValueError, match=re.escape("units 'blocks.1' and 'blocks.1.0' nest")):
        _module_units(tower, UnitParams(rest, [outer, inner]))
    without_head = {k: v for k, v in params.items() if k != "head.weight"}
    with pytest.raises(ValueError, match=re.escape("missing: ['head.weight']")):
        _module_units(tower, UnitParams(without_head, []))


def test_unit_tensors_hold_placeholders_only_for_module_units() -> None:
    tower = _Tower()
    params = {k: v.detach() for k, v in tower.named_parameters()}
    units = _units(params, "blocks.0")
    unit_params = UnitParams(
        {k: v for k, v in params.items() if not k.startswith("blocks.0.")}, units
    )
    tensors = unit_calls.unit_tensors(tower, unit_params, {"blocks.0": units[0]}, list(params))
    assert tensors["blocks.0.weight"].shape == (2, 2)
    with pytest.raises(
        RuntimeError, match=re.escape("'blocks.0.weight' of unit 'blocks.0' was used outside")
    ):
        tensors["blocks.0.weight"] + 1
    assert tensors["head.weight"] is params["head.weight"]
    # Not a module unit: materialized at once.
    tensors = unit_calls.unit_tensors(tower, unit_params, {}, list(params))
    assert tensors["blocks.0.weight"] is params["blocks.0.weight"]


def test_forwards_hand_each_call_to_the_unit_and_are_removed_after() -> None:
    tower = _Tower()
    params = {k: v.detach() for k, v in tower.named_parameters()}
    (unit,) = _units(params, "blocks.0")
    x = torch.ones(3, 2)
    with unit_calls.forwards(tower, {"blocks.0": unit}):
        out = tower(x)
    assert unit.calls == 1 and torch.equal(out, tower(x))
    assert "forward" not in tower.blocks[0].__dict__


# ------------------------------------------------------------------------ checks at the boundary


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_apply_names_a_param_of_the_wrong_shape_or_kind() -> None:
    apply, params, buffers = functional.functionalize(_mlp())
    x = torch.randn(3, 4)
    widened = {**params, "2.weight": torch.zeros(2, 4), "0.bias": torch.zeros(9)}
    shape_error = r"`params\['0.bias'\]` has shape \(9,\), the module's parameter \(8,\)"
    with pytest.raises(ValueError, match=shape_error) as e:
        apply(widened, buffers, x)
    assert "`params['2.weight']` has shape (2, 4), the module's parameter (2, 8)" in str(e.value)
    integer = {**params, "0.bias": torch.zeros(8, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"`params\['0.bias'\]` is torch.int64.*integer for"):
        apply(integer, buffers, x)


def test_apply_still_checks_every_leaf_after_accepting_cast_params() -> None:
    # A mixed-precision step passes the same bf16 casts each call; once accepted, those dtypes
    # take the fast path, and a wrong shape or an integer leaf is still refused.
    module = _mlp()
    apply, params, buffers = functional.functionalize(module)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    low = {name: p.to(torch.bfloat16) for name, p in params.items()}
    for _ in range(2):
        out, _ = apply(low, buffers, x)
        assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"`params\['0.bias'\]` has shape \(9,\)"):
        apply({**low, "0.bias": torch.zeros(9, dtype=torch.bfloat16)}, buffers, x)
    with pytest.raises(ValueError, match=r"`params\['0.bias'\]` is torch.int64"):
        apply({**low, "0.bias": torch.zeros(8, dtype=torch.long)}, buffers, x)
    out, _ = apply(low, buffers, x)
    torch.testing.assert_close(out, module.to(torch.bfloat16)(x))


def test_apply_takes_a_model_cast_alike_and_names_a_leaf_cast_alone() -> None:
    module = _mlp()
    apply, params, buffers = functional.functionalize(module)
    x = torch.randn(3, 4)
    doubled = {name: p.double() for name, p in params.items()}
    out, _ = apply(doubled, buffers, x.double())
    torch.testing.assert_close(out, module.double()(x.double()))
    one_cast = {**params, "2.weight": params["2.weight"].double()}
    with pytest.raises(RuntimeError) as error:
        apply(one_cast, buffers, x)
    if sys.version_info >= (3, 11):
        assert "`params['2.weight']` is torch.float64 (the module's: torch.float32)" in "".join(
            error.value.__notes__
        )


def test_the_fast_name_check_accepts_exactly_the_names_as_tensors() -> None:
    from fscale.functional import checks

    names = frozenset({"a", "b"})
    assert checks.exactly({"a": torch.zeros(1), "b": torch.zeros(1)}, names)
    assert not checks.exactly({"a": torch.zeros(1)}, names)  # missing
    assert not checks.exactly({"a": torch.zeros(1), "b": torch.zeros(1), "c": 0}, names)
    assert not checks.exactly({"a": torch.zeros(1), "b": 1.0}, names)  # not a tensor
    module = _mlp()
    module[0].gradient_checkpointing = False  # as a Hugging Face layer declares it
    assert checks.checkpointable(list(module.named_modules())) == [("0", module[0])]


def test_huggingface_gradient_checkpointing_is_refused_with_the_fix() -> None:
    # transformers' gradient_checkpointing_enable() sets this flag on each layer; the layer
    # then recomputes through torch.utils.checkpoint in backward, outside apply.
    module = _mlp()
    module[0].gradient_checkpointing = True
    refused = r"functionalize: gradient checkpointing is enabled on `0` \(Linear"
    with pytest.raises(ValueError, match=refused):
        functional.functionalize(module)
    module[0].gradient_checkpointing = False
    apply, params, buffers = functional.functionalize(module)
    module[0].gradient_checkpointing = True  # enabled after functionalize
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"apply: .*fs\.checkpoint\(blocks\[i\]\)"):
        apply(params, buffers, x)
    # Without a backward nothing is recomputed, so evaluation runs.
    apply(params, buffers, x, train=False)
    with torch.no_grad():
        apply(params, buffers, x)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("table", torch.arange(3.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.table)


def test_state_dict_fills_every_name_of_the_module_state_dict() -> None:
    module = _Tied()
    apply, params, buffers = functional.functionalize(module)
    assert "head.weight" not in params  # one leaf for the tied tensor
    trained = {name: p + 1 for name, p in params.items()}
    state_dict = apply.state_dict(trained, {**buffers, "steps": torch.ones(())})
    assert list(state_dict) == list(module.state_dict())  # tied name in, non-persistent out
    assert state_dict["head.weight"] is state_dict["embed.weight"] is trained["embed.weight"]
    fresh = _Tied()
    fresh.load_state_dict(state_dict, strict=True)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, trained["embed.weight"]) and fresh.steps == 1
    with pytest.raises(
        ValueError, match=r"state_dict: `params` does not match(?s:.*)missing: \['head.bias'\]"
    ):
        apply.state_dict({"embed.weight": params["embed.weight"]}, buffers)
