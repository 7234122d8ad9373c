"""`fscale consolidate` and `fscale inspect`: a sharded checkpoint as one plain state_dict."""

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fscale as fs
import fscale.testing.strategies as fst
from fscale.cli import main
from fscale.testing import assert_trees_equal, run_spmd

safetensors = pytest.importorskip("safetensors.torch", reason="the export writes safetensors")


def _case():
    return fst.ModelCase("gpt", width=8, depth=2, seed=5)


def _train_fsdp_and_save(root):
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    world = dist.get_world_size()
    step = fs.fully_shard(
        fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2)), fs.Mesh(dp=world)
    )
    state = step.init(params, buffers)
    for i in range(2):
        batch = fs.data.split_batch(case.batch(8, seed=i), dist.get_rank(), world)
        state, _ = step(state, batch)
    fs.save(root, state, step=step, model=apply)
    return fs.consolidate(step, state).params


def test_consolidate_writes_a_state_dict_the_original_module_loads_strictly(capsys):
    with tempfile.TemporaryDirectory() as root:
        trained = run_spmd(_train_fsdp_and_save, 2, root)[0]
        out = Path(root) / "export" / "model.safetensors"
        assert main(["consolidate", root, str(out)]) == 0
        tensors = safetensors.load_file(str(out))
        module = fst.ModelCase("gpt", width=8, depth=2, seed=99).module()  # other init
        module.load_state_dict(tensors, strict=True)
        apply, params, _ = fs.functionalize(module)
        assert_trees_equal(params, trained)
        # Tied weights: both names are in the file, and the module still ties them.
        assert apply.aliases, "the reference GPT ties its embedding and output layer"
        for names in apply.aliases.values():
            assert all(name in tensors for name in names)
        assert "wrote" in capsys.readouterr().out

        assert main(["inspect", root]) == 0
        printed = capsys.readouterr().out
        assert "step        2" in printed
        assert "fully_shard" in printed and "world size  2" in printed
        assert "rank 0:" in printed and "rank 1:" in printed
        assert "opt_state/" in printed and "params/" in printed


def test_consolidate_refuses_a_checkpoint_saved_without_model_names(tmp_path):
    case = _case()
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.1))
    fs.save(tmp_path, step.init(params, buffers), step=step)
    with pytest.raises(SystemExit, match="saved without `model=`"):
        main(["consolidate", str(tmp_path), str(tmp_path / "out.safetensors")])
    with pytest.raises(SystemExit, match="is a file"):
        main(["inspect", __file__])


def test_a_hugging_face_model_reloads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers", reason="checks from_pretrained")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        output, _ = apply(params, buffers, batch, key=key)
        logits = output.logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2))
    state = step.init(params, buffers)
    state, _ = step(
        state, torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    )
    fs.save(tmp_path / "ckpt", state, step=step, model=apply)
    export = tmp_path / "hf"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(export / "model.safetensors")]) == 0
    config.save_pretrained(export)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(export)
    _, reloaded_params, _ = fs.functionalize(reloaded)
    assert_trees_equal(reloaded_params, state.params)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()


# ---- tensor-parallel shards ---------------------------------------------------------------


def _dense_sequential():
    from fscale.models import GPT, GPTConfig

    cfg = GPTConfig(32, 8, d_model=16, n_heads=4, n_layers=2, tie_embeddings=False)
    gpt = GPT(cfg, seed=7)
    return torch.nn.Sequential(
        gpt.embed, *gpt.blocks, torch.nn.Sequential(gpt.final_norm, gpt.lm_head)
    )


def _save_tensor_parallel(root, pipelined):
    from fscale.parallel import tensor as tpl
    from fscale.parallel.pipeline import pipeline

    plan = {
        "0.token": "vocab",
        "*.attn": (tpl.Heads("n_heads"), tpl.Input("replicated")),
        "*.attn.qkv": tpl.Colwise(parts=3),
        "*.attn.proj": "rowwise",
        "*.mlp": tpl.Input("replicated"),
        "*.mlp.fc_in": "colwise",
        "*.mlp.fc_out": "rowwise",
        "3.1": tpl.Colwise(gather_output=True),
    }
    mesh = fs.Mesh(pp=2, tp=2) if pipelined else fs.Mesh(dp=2, tp=2)
    model = tpl.tensor_parallel(_dense_sequential(), mesh, "tp", plan)
    _, params, buffers = fs.functionalize(model)
    if pipelined:
        step = pipeline(
            model, lambda y, t: y.sum(), fs.optim.adam(1e-2), mesh, micro_batches=1, balance=[2, 2]
        )
    else:
        step = fs.fully_shard(fs.train_step(lambda *a: None, fs.optim.adam(1e-2)), mesh, "dp")
    fs.save(root, step.init(params, buffers), step=step, model=model)


@pytest.mark.parametrize("pipelined", [False, True], ids=["tp_fsdp", "pp_tp"])
def test_consolidate_gathers_tensor_parallel_shards_and_inspect_shows_them(
    tmp_path, capsys, pipelined
):
    run_spmd(_save_tensor_parallel, 4, str(tmp_path), pipelined)
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path), str(out)]) == 0
    dense = _dense_sequential()
    tensors = safetensors.load_file(str(out))
    # Saved at initialisation: every shard back in its place gives the dense model exactly.
    assert_trees_equal(tensors, {k: v.detach() for k, v in dense.state_dict().items()})
    dense.load_state_dict(tensors, strict=True)
    # Every leaf is stored with its full shape, so plain DCP reads one as a full tensor too.
    qkv = {"params/1.attn.qkv.weight": torch.zeros(48, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in one process
        dcp.load(qkv, checkpoint_id=str(fs.latest(tmp_path)))  # one process, no group
    assert torch.equal(qkv["params/1.attn.qkv.weight"], dense.state_dict()["1.attn.qkv.weight"])

    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "placement   tensor_parallel over 'tp': 2 shards" in printed
    assert ("placement   pipeline over 'pp': 2 stages on 2 ranks" in printed) == pipelined
    if pipelined:  # each rank writes its stage's tp shard: a q/k/v weight in 3 x 2 boxes
        assert "params/1.attn.qkv.weight  [48, 16]  float32  6 x 1" in printed
        assert "params/1.attn.proj.weight  [16, 16]  float32  1 x 2" in printed
    assert "params/3.0.weight  [16]  float32  whole" in printed
    assert all(f"rank {rank}:" in printed for rank in range(4))
