"""Reference models: shapes, seeded init, the structure transformations rely on, losses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fscale import models
from fscale.models import building


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    pairs = zip(a.state_dict().items(), b.state_dict().items(), strict=True)
    return all(na == nb and torch.equal(ta, tb) for (na, ta), (nb, tb) in pairs)


TINY_GPT = models.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=3)


# --------------------------------------------------------------------------------------------
# Building


def test_seeded_float32_init_is_reproducible_and_restores_rng_and_dtype() -> None:
    torch.manual_seed(7)
    rng_before = torch.random.get_rng_state()
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with building.seeded_float32_init(3):
            first = (torch.get_default_dtype(), torch.rand(3))
        with building.seeded_float32_init(3):
            second = torch.rand(3)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous_dtype)
    assert first[0] == torch.float32 and torch.equal(first[1], second)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    with pytest.raises(TypeError, match="`seed` must be an int, got bool"):
        building.seeded_float32_init(True).__enter__()


def test_check_positive_ints_names_the_owner_and_the_argument() -> None:
    building.check_positive_ints("f", a=1, b=2)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"f: `b` must be a positive int"):
            building.check_positive_ints("f", a=1, b=bad)


# --------------------------------------------------------------------------------------------
# MLP


def test_mlp_layers_and_output() -> None:
    model = models.mlp([4, 8, 8, 2], activation="gelu", bias=False)
    kinds = [type(layer) for layer in model]
    assert kinds == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "2.weight", "4.weight"]
    x = torch.randn(3, 4)
    expected = F.gelu(F.gelu(x @ model[0].weight.T) @ model[2].weight.T) @ model[4].weight.T
    assert torch.allclose(model(x), expected)


def test_models_are_seeded_float32_and_leave_the_caller_rng_alone() -> None:
    rng = torch.get_rng_state()
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for build in (
            lambda seed: models.mlp([3, 5, 2], seed=seed),
            lambda seed: models.GPT(TINY_GPT, seed=seed),
            lambda seed: models.resnet(models.ResNetConfig(widths=(4,)), seed=seed),
        ):
            assert _same_params(build(0), build(0))
            assert not _same_params(build(0), build(1))
            assert all(p.dtype == torch.float32 for p in build(0).parameters())
    finally:
        torch.set_default_dtype(previous_dtype)
    assert torch.equal(torch.get_rng_state(), rng)


def test_mlp_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`sizes` needs at least an input and an output"):
        models.mlp([4])
    with pytest.raises(ValueError, match=r"`sizes\[1\]` must be a positive int, got 0"):
        models.mlp([4, 0, 2])
    with pytest.raises(ValueError, match=r"unknown `activation` 'swish'; choose one of"):
        models.mlp([4, 2], activation="swish")
    with pytest.raises(TypeError, match=r"`seed` must be an int, got float"):
        models.mlp([4, 2], seed=1.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# GPT


def test_gpt_structure_for_sharding_and_remat() -> None:
    model = models.GPT(TINY_GPT)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 3
    assert [name for name, _ in model.named_children()] == [
        "embed",
        "blocks",
        "final_norm",
        "lm_head",
    ]
    assert model.lm_head.weight is model.embed.token.weight
    assert TINY_GPT.d_ff == 64  # 4 * d_model
    untied = models.GPT(dataclasses.replace(TINY_GPT, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.token.weight
    residual_std = untied.blocks[0].attn.proj.weight.std().item()
    assert residual_std < 0.6 * untied.blocks[0].attn.qkv.weight.std().item()


def test_gpt_logits_shape_and_causality() -> None:
    model = models.GPT(TINY_GPT).eval()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 8, 32) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 32
    changed_logits = model(changed)
    assert torch.equal(changed_logits[:, :5], logits[:, :5])  # the past cannot see the future
    assert not torch.equal(changed_logits[:, 5:], logits[:, 5:])
    # Shorter sequences are prefixes (up to GEMM blocking, which depends on the length).
    assert torch.allclose(model(tokens[:, :3]), logits[:, :3], rtol=1e-5, atol=1e-6)


def test_gpt_dropout_is_active_only_in_training_mode() -> None:
    model = models.GPT(dataclasses.replace(TINY_GPT, dropout=0.2))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        first, second = model(tokens), model(tokens)
    assert not torch.equal(first, second)
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def test_gpt_follows_the_device_of_its_input() -> None:
    model = models.GPT(TINY_GPT).to("meta")
    logits = model(torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    assert logits.device.type == "meta" and logits.shape == (2, 8, 32)


def test_gpt_rejects_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match=r"`n_heads`=3 must divide `d_model`=16"):
        models.GPTConfig(d_model=16, n_heads=3)
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\), got 1.0"):
        models.GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"`n_layers` must be a positive int, got 0"):
        models.GPTConfig(n_layers=0)
    with pytest.raises(TypeError, match=r"`cfg` must be a GPTConfig, got dict"):
        models.GPT({"d_model": 16})  # type: ignore[arg-type]
    model = models.GPT(TINY_GPT)
    with pytest.raises(ValueError, match=r"int64 tensor of shape \[batch, time\], got dtype "):
        model(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"got dtype torch.int64 and shape \(8,\)"):
        model(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"length 9 do not fit; the model has seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# ResNet


def test_resnet_default_size_and_output() -> None:
    model = models.resnet()
    assert sum(p.numel() for p in model.parameters()) == 78_042
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    logits = model.eval()(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)


def test_resnet_stages_downsample_and_accept_other_sizes() -> None:
    cfg = models.ResNetConfig(in_channels=1, num_classes=4, widths=(4, 8, 8), blocks_per_stage=2)
    model = models.ResNet(cfg)
    assert len(model.stages) == 3 and all(len(stage) == 2 for stage in model.stages)
    assert isinstance(model.stages[0][0].shortcut, nn.Identity)
    assert model.stages[1][0].conv1[0].stride == (2, 2)
    assert model(torch.randn(3, 1, 12, 12)).shape == (3, 4)


def test_resnet_rejects_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match=r"`widths` needs at least one stage"):
        models.ResNetConfig(widths=())
    with pytest.raises(ValueError, match=r"`widths\[1\]` must be a positive int, got -2"):
        models.ResNetConfig(widths=(4, -2))
    with pytest.raises(ValueError, match=r"shape \[N, 3, H, W\], got shape \(2, 1, 8, 8\)"):
        models.resnet()(torch.randn(2, 1, 8, 8))


# --------------------------------------------------------------------------------------------
# Losses


def test_lm_loss_is_mean_token_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen)
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    log_probs = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(models.lm_loss(logits, targets), -log_probs.mean())
    targets[0, 0] = -100  # skipped, and the mean is over the other five positions
    assert torch.allclose(models.lm_loss(logits, targets), -log_probs.flatten()[1:].mean())
    with pytest.raises(ValueError, match=r"`targets` \[B, T\], got \(2, 3, 5\) and \(3, 2\)"):
        models.lm_loss(logits, targets.T)


def test_classification_loss_is_mean_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, generator=gen)
    labels = torch.tensor([0, 2, 1, 2])
    expected = -logits.log_softmax(-1)[torch.arange(4), labels].mean()
    assert torch.allclose(models.classification_loss(logits, labels), expected)
    with pytest.raises(ValueError, match=r"`labels` \[N\], got \(4, 3\) and \(3,\)"):
        models.classification_loss(logits, labels[:3])
