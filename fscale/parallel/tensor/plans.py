"""Shipped tensor-parallel plans: fscale's `GPT` and Hugging Face's Llama.

Both follow Megatron: in every block the attention's query/key/value projection and the MLP's
first layer are column-parallel (the heads and the hidden units split over the ranks), the
attention's output projection and the MLP's second layer row-parallel, and the token
embedding vocab-parallel. `Input` enters each attention and MLP region once, so one ``f`` (one
all-reduce in backward) serves all the projections that read the same input: four activation
all-reduces per block in all, two forward (``g``) and two backward (``f``).

With ``sequence_parallel=True`` the residual stream between the regions is a shard of the
sequence on each rank: the norms (and the dropouts that act on the stream) run on the shards
with ``"sequence"``, each region's input is all-gathered along the sequence and its output
reduce-scattered, so each all-reduce becomes a reduce-scatter plus an all-gather, moving the
same bytes, while the activations outside the regions take 1/N of the memory.

The output layer is column-parallel over the vocabulary. With ``vocab_parallel_loss=True`` its
logits stay split, for `vocab_parallel_cross_entropy`; otherwise they are gathered (the full
logits on every rank, for any loss). In the GPT it shares its weight with the token embedding,
which both styles split along the vocabulary alike.
"""

from __future__ import annotations

from typing import Any

from fscale.parallel.tensor.styles import Colwise, Heads, Input, Output, Rowwise

__all__ = ["gpt_plan", "llama_plan"]


def gpt_plan(
    *, sequence_parallel: bool = False, vocab_parallel_loss: bool = False
) -> dict[str, Any]:
    """The plan of `fscale.models.GPT` (its fused q/k/v projection split head by head).

    Args:
        sequence_parallel: shard the residual stream along the sequence between the regions
            (the sequence length must divide by the axis size).
        vocab_parallel_loss: leave the logits split along the vocabulary.
    """
    region_input = Input("sequence" if sequence_parallel else "replicated")
    region_output = "sequence" if sequence_parallel else "replicated"
    plan: dict[str, Any] = {
        "embed.token": "vocab",
        "blocks.*.attn": (Heads("n_heads"), region_input),
        "blocks.*.attn.qkv": Colwise(parts=3),
        "blocks.*.attn.proj": Rowwise(output=region_output),
        "blocks.*.mlp": region_input,
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": Rowwise(output=region_output),
        "lm_head": Colwise(
            input="sequence" if sequence_parallel else "replicated",
            gather_output=not vocab_parallel_loss,
        ),
    }
    if sequence_parallel:
        # The position embedding is added to the whole sequence, so the stream is split after
        # the embeddings (and their dropout, which is then the same on every rank).
        plan["embed"] = Output("split")
        for name in ("attn_norm", "mlp_norm", "attn.dropout", "mlp.dropout"):
            plan[f"blocks.*.{name}"] = "sequence"
        plan["final_norm"] = "sequence"
    return plan


def llama_plan(
    *, sequence_parallel: bool = False, vocab_parallel_loss: bool = False
) -> dict[str, Any]:
    """The plan of Hugging Face's ``LlamaForCausalLM`` (``q/k/v/gate/up`` colwise, ``o/down``
    rowwise, the token embedding vocab-parallel).

    The attention reshapes by ``head_dim`` and infers the head count, so it needs no change;
    the query and key/value head counts must divide by the axis size (a check of the column
    split of ``q_proj``, ``k_proj`` and ``v_proj``, whose rows are whole heads).

    Args:
        sequence_parallel: shard the residual stream along the sequence between the regions.
        vocab_parallel_loss: leave the logits split along the vocabulary.
    """
    how = "sequence" if sequence_parallel else "replicated"
    output = "sequence" if sequence_parallel else "replicated"
    heads = Heads(head_dim="head_dim", projections=("q_proj", "k_proj", "v_proj"))
    plan: dict[str, Any] = {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn": (heads, Input(how, name="hidden_states")),
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": Rowwise(output=output),
        "model.layers.*.mlp": Input(how),
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": Rowwise(output=output),
        "lm_head": Colwise(input=how, gather_output=not vocab_parallel_loss),
    }
    if sequence_parallel:
        # The causal mask and the rotary positions are built from the embedding's full
        # sequence, so the stream is split as it enters the first layer's norm.
        plan["model.layers.0"] = Input("split")
        plan["model.layers.*.input_layernorm"] = "sequence"
        plan["model.layers.*.post_attention_layernorm"] = "sequence"
        plan["model.norm"] = "sequence"
    return plan
