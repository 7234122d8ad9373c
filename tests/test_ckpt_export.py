"""`fscale consolidate` and `fscale inspect`: a sharded checkpoint as one plain state_dict."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

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
