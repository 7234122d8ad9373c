"""fscale.random: keys are values; folding is deterministic and separates streams."""

import pytest
import torch

from fscale import random as fsr


def test_keys_are_deterministic_values():
    assert torch.equal(fsr.key(3), fsr.key(3))
    assert not torch.equal(fsr.key(3), fsr.key(4))
    k = fsr.key(0)
    assert fsr.is_key(k) and k.dtype == torch.int64 and k.shape == (2,)


def test_fold_in_separates_steps_and_ranks():
    k = fsr.key(0)
    folded = {tuple(fsr.fold_in(k, i).tolist()) for i in range(1000)}
    assert len(folded) == 1000
    assert torch.equal(fsr.fold_in(k, 5), fsr.fold_in(fsr.key(0), 5))
    assert not torch.equal(fsr.fold_in(fsr.fold_in(k, 1), 2), fsr.fold_in(fsr.fold_in(k, 2), 1))
    assert torch.equal(fsr.fold_in(k, torch.tensor(5)), fsr.fold_in(k, 5))


def test_fold_in_all_equals_folding_one_after_another():
    k = fsr.key(7)
    for data in ([], [3], [3, 1], [2**63 + 5, -1, 0]):
        expected = k
        for d in data:
            expected = fsr.fold_in(expected, d)
        assert torch.equal(fsr.fold_in_all(k, data), expected)
    with pytest.raises(TypeError, match="fold_in_all: `data` must hold ints"):
        fsr.fold_in_all(k, [1, 2.0])
    with pytest.raises(TypeError, match="expected a key"):
        fsr.fold_in_all(torch.zeros(2), [1])


def test_split_and_seed():
    a, b = fsr.split(fsr.key(1))
    assert not torch.equal(a, b)
    seeds = {fsr.seed(fsr.fold_in(fsr.key(1), i)) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)


def test_errors():
    with pytest.raises(TypeError, match="int"):
        fsr.key(1.5)
    with pytest.raises(TypeError, match="expected a key"):
        fsr.fold_in(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="positive"):
        fsr.split(fsr.key(0), 0)
    with pytest.raises(TypeError, match="int"):
        fsr.fold_in(fsr.key(0), "x")


# ----------------------------------------------------------------------------- RngState


def _mask(device="cpu"):
    return torch.nn.functional.dropout(torch.ones(64, device=device), 0.5, training=True)


def test_rng_state_restored_draws_the_same_mask_and_leaves_the_caller_stream_alone():
    torch.manual_seed(0)
    state = fsr.RngState.capture([torch.zeros(1)])
    first = _mask()
    after_first = torch.get_rng_state()
    with state.restored():
        replayed = _mask()
    assert torch.equal(replayed, first)
    # The replay neither rewinds nor advances the caller's generator.
    assert torch.equal(torch.get_rng_state(), after_first)
    with state.restored():
        assert torch.equal(_mask(), first)  # a state can be replayed again
    assert not torch.equal(_mask(), first)  # the caller's stream moved on from `first`


def test_rng_state_capture_ignores_non_cuda_devices_and_refuses_other_items():
    state = fsr.RngState.capture(["cpu", torch.device("meta"), torch.zeros(2)])
    assert state.cuda == {}
    assert torch.equal(state.cpu, torch.get_rng_state())
    with pytest.raises(TypeError, match="`where` must hold tensors or devices, got a int"):
        fsr.RngState.capture([3])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: replays its generator"
)
def test_rng_state_replays_cuda_generators():
    device = torch.device("cuda", torch.cuda.current_device())
    state = fsr.RngState.capture([torch.zeros(1, device=device)])
    assert list(state.cuda) == [device]
    first = _mask(device)
    after_first = torch.cuda.get_rng_state(device)
    with state.restored():
        assert torch.equal(_mask(device), first)
    assert torch.equal(torch.cuda.get_rng_state(device), after_first)
