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
