"""Hugging Face GPT-2, Llama and BERT (tiny, random-init): every strategy equals torch DDP.

Configs only, never a download. Dropout is off, so the DDP reference and fscale run the same
function without sharing an RNG; the loss is the model's own `out.loss` (GPT-2, Llama) or
computed here from the logits (BERT).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.parallel import consolidate, fully_shard, shard_optimizer
from fscale.remat import MutatedArgumentError
from fscale.testing import assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face integration tests need `transformers` (the `integration` extra)",
)

VOCAB, HIDDEN, LAYERS, SEQ = 128, 32, 2, 8
BATCH, STEPS = 4, 2
# The first call on a rank imports transformers there (seconds, more on a loaded machine).
TIMEOUT = 300.0
OPTIMIZER = fst.OptimizerCase("adamw", (("lr", 1e-2), ("weight_decay", 0.01)))
KINDS = ("gpt2", "llama", "bert")
STRATEGIES = ("data_parallel", "zero1", "zero2", "fully_shard", "fully_shard_remat", "checkpoint")


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=LAYERS, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _blocks(kind: str, model: torch.nn.Module) -> torch.nn.ModuleList:
    if kind == "gpt2":
        return model.transformer.h
    if kind == "llama":
        return model.model.layers
    return model.bert.encoder.layer


def _loss(kind: str, model_call, ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
    """The mean loss of one call of the model (`model_call(ids, **kwargs)`) on `ids`."""
    if kind == "bert":
        logits = model_call(ids).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
    return model_call(ids, labels=ids, use_cache=use_cache).loss


def _loss_fn(kind: str, apply, use_cache: bool = False):
    def loss_fn(params, buffers, ids, key):
        def call(ids, **kwargs):
            return apply(params, buffers, ids, key=key, **kwargs)[0]

        return _loss(kind, call, ids, use_cache)

    return loss_fn


def _batch(step_index: int, rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step_index))
    return fs.data.split_batch(ids, rank, world)


def _step(kind: str, strategy: str, model: torch.nn.Module, mesh: fs.Mesh):
    if strategy == "checkpoint":
        blocks = _blocks(kind, model)
        for i, block in enumerate(blocks):
            blocks[i] = fs.checkpoint(block)
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(_loss_fn(kind, apply), OPTIMIZER.fscale())
    if strategy in ("data_parallel", "checkpoint"):
        step = fs.data_parallel(step, mesh)
    elif strategy in ("zero1", "zero2"):
        step = shard_optimizer(step, mesh, shard_grads=strategy == "zero2", bucket_mb=1e-3)
    else:
        remat = strategy == "fully_shard_remat"
        step = fully_shard(step, mesh, reshard_after_forward="remat" if remat else True)
    return apply, step, step.init(params, buffers)


def _ddp_params(kind: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    optimizer = OPTIMIZER.torch(list(ddp.parameters()))
    for i in range(STEPS):
        optimizer.zero_grad()
        _loss(kind, ddp, _batch(i, rank, world)).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def _every_strategy_and_ddp(kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.Mesh(dp=world)
    pristine = _model(kind)
    results = {}
    for strategy in STRATEGIES:
        _, step, state = _step(kind, strategy, copy.deepcopy(pristine), mesh)
        for i in range(STEPS):
            state, _ = step(state, _batch(i, rank, world))
        results[strategy] = consolidate(step, state).params
    return results, _ddp_params(kind, pristine)


@pytest.mark.parametrize("kind", KINDS)
def test_every_strategy_equals_torch_ddp_bit_for_bit(kind):
    for results, ddp in run_spmd(_every_strategy_and_ddp, 2, kind, timeout=TIMEOUT):
        for strategy, params in results.items():
            assert_trees_equal(params, {name: ddp[name] for name in params}, msg=strategy)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_kv_cache_under_remat_is_refused_with_the_fix(kind):
    # One process is enough: the checkpoint refuses in forward, before any collective.
    model = _model(kind)
    blocks = _blocks(kind, model)
    for i, block in enumerate(blocks):
        blocks[i] = fs.checkpoint(block)
    apply, params, buffers = fs.functionalize(model)
    loss_fn = _loss_fn(kind, apply, use_cache=True)
    ids = _batch(0, 0, 1)
    with pytest.raises(MutatedArgumentError, match=r"DynamicCache.*\n.*`use_cache=False`"):
        fs.value_and_grad(loss_fn, params, buffers, ids, fs.random.key(0))


def _fully_shard_remat_with_cache(kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(kind)
    apply, params, buffers = fs.functionalize(model)
    step = fully_shard(
        fs.train_step(_loss_fn(kind, apply, use_cache=True), OPTIMIZER.fscale()),
        fs.Mesh(dp=world),
        reshard_after_forward="remat",
    )
    state = step.init(params, buffers)
    try:
        step(state, _batch(0, rank, world))
    except MutatedArgumentError as error:
        return str(error)
    return None


def test_the_kv_cache_under_fully_shard_remat_is_refused_on_every_rank():
    for message in run_spmd(_fully_shard_remat_with_cache, 2, "gpt2", timeout=TIMEOUT):
        assert message is not None and "use_cache=False" in message


def _consolidated_state_dict(kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(kind)
    apply, step, state = _step(kind, "fully_shard", model, fs.Mesh(dp=world))
    state, _ = step(state, _batch(0, rank, world))
    full = consolidate(step, state)
    return apply.state_dict(full.params, full.buffers)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_consolidated_state_loads_strictly_and_round_trips_save_pretrained(kind, tmp_path):
    state_dict = run_spmd(_consolidated_state_dict, 2, kind, timeout=TIMEOUT)[0]
    model = _model(kind)
    tied = {"gpt2": "lm_head.weight", "bert": "cls.predictions.decoder.weight"}[kind]
    assert tied in state_dict
    assert not torch.equal(model.state_dict()[tied], state_dict[tied])  # one step trained it
    model.load_state_dict(state_dict, strict=True)
    assert_trees_equal(dict(model.state_dict()), state_dict)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert_trees_equal(dict(loaded.state_dict()), state_dict)
    ids = _batch(0, 0, 1)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
