"""Checkpoint files under faults: killed ranks, failing disks, and bad input."""

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import fscale as fs
import fscale.testing.strategies as fst
from fscale.ckpt import directory
from fscale.ckpt.manifest import FORMAT_VERSION
from fscale.testing import assert_trees_equal, run_spmd


def _build(width=8, world=None):
    case = fst.ModelCase("gpt", width=width, depth=2, seed=4)
    apply, params, buffers = fs.functionalize(case.module())
    world = dist.get_world_size() if dist.is_initialized() else 1
    step = fs.train_step(case.loss_fn(apply), fs.optim.adam(1e-2))
    if world > 1:
        step = fs.shard_optimizer(step, fs.Mesh(dp=world))
    return case, step, step.init(params, buffers)


def _train(case, step, state, count):
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    for _ in range(count):
        batch = fs.data.split_batch(case.batch(8, seed=int(state.step)), rank, world)
        state, _ = step(state, batch)
    return state


# ---- a rank killed mid-save ---------------------------------------------------------------


def _save_then_die_while_saving_again(root, where):
    case, step, state = _build()
    state = _train(case, step, state, 2)
    fs.save(root, state, step=step)
    state = _train(case, step, state, 2)
    if where == "write" and dist.get_rank() == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()  # this rank's file is on disk, no metadata
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    if where == "commit" and dist.get_rank() == 0:

        def die_before_rename(tmp, final):  # every file and the manifest are written
            os.kill(os.getpid(), signal.SIGKILL)

        directory.commit = die_before_rename
    fs.save(root, state, step=step)


def _resume(root):
    case, step, like = _build()
    latest = fs.latest(root)
    state = fs.load(root, like, step=step)
    resumed_at = int(state.step)
    state = _train(case, step, state, 2)
    fs.save(root, state, step=step)  # removes what the killed save left
    uninterrupted = _train(case, step, like, 4)
    return (
        str(latest),
        resumed_at,
        fs.consolidate(step, state),
        fs.consolidate(step, uninterrupted),
        sorted(p.name for p in Path(root).iterdir()),
    )


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_a_fresh_launch_resumes(where):
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(fs.distributed.RankError):
            fs.launch(_save_then_die_while_saving_again, 2, root, where, timeout=120, pg_timeout=30)
        partial = Path(root) / f".tmp-step_{4:010d}"
        assert partial.is_dir() and list(partial.glob("*.distcp"))
        assert (partial / "fscale.json").exists() == (where == "commit")
        assert fs.latest(root) == Path(root) / f"step_{2:010d}"
        for latest, resumed_at, state, uninterrupted, entries in fs.launch(_resume, 2, root):
            assert latest.endswith(f"step_{2:010d}")
            assert resumed_at == 2
            assert_trees_equal(state, uninterrupted)
            assert entries == [f"step_{2:010d}", f"step_{4:010d}"]


# ---- one rank's disk error ----------------------------------------------------------------


def _save_with_a_failing_disk_on_rank(root, failing_rank):
    case, step, state = _build()
    state = _train(case, step, state, 1)
    fs.save(root, state, step=step)
    state = _train(case, step, state, 1)
    write_data = FileSystemWriter.write_data
    if dist.get_rank() == failing_rank:

        def fail(self, plan, planner):
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = fail
    try:
        fs.save(root, state, step=step)
    except fs.CheckpointError as error:
        message = str(error)
    else:
        message = None
    finally:
        FileSystemWriter.write_data = write_data
    # Every rank raised; the group still works and the previous checkpoint is the latest.
    dist.barrier()
    return message, str(fs.latest(root))


def test_one_ranks_disk_error_makes_every_rank_raise():
    with tempfile.TemporaryDirectory() as root:
        for message, latest in run_spmd(_save_with_a_failing_disk_on_rank, 2, root, 1):
            assert message is not None and "No space left on device" in message
            assert latest.endswith(f"step_{1:010d}")


# ---- bad input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    case, step, state = _build()
    fs.save(root, _train(case, step, state, 1), step=step)
    return root, root / f"step_{1:010d}"


def test_loading_another_model_lists_the_differences(saved):
    root, _ = saved
    _, step, like = _build(width=16)
    with pytest.raises(fs.CheckpointError, match="another model") as caught:
        fs.load(root, like, step=step)
    message = str(caught.value)
    assert "differences; - missing, + extra, ~ shape or dtype" in message
    first = message.splitlines()[1]
    assert first.startswith("  ~ params/") and "checkpoint [" in first and "state [" in first


def test_a_path_that_is_a_file_is_refused(tmp_path, saved):
    _, step, like = _build()
    file = tmp_path / "model.pt"
    file.write_text("not a checkpoint")
    with pytest.raises(fs.CheckpointError, match="is a file"):
        fs.load(file, like, step=step)
    with pytest.raises(fs.CheckpointError, match="is a file"):
        fs.save(file, like, step=step)
    with pytest.raises(fs.CheckpointError, match="is a file"):
        fs.latest(file)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fs.load(tmp_path / "nowhere", like, step=step)


def _copy(source, target):
    import shutil

    shutil.copytree(source, target)
    return target


def test_a_partial_or_truncated_checkpoint_is_refused(tmp_path, saved):
    _, checkpoint = saved
    _, step, like = _build()
    partial = _copy(checkpoint, tmp_path / f"step_{7:010d}")
    (partial / "fscale.json").unlink()
    with pytest.raises(fs.CheckpointError, match="partial checkpoint"):
        fs.load(partial, like, step=step)
    assert fs.latest(tmp_path) is None  # ignored as the latest
    with pytest.raises(fs.CheckpointError, match="no complete checkpoint"):
        fs.load(tmp_path, like, step=step)

    truncated = _copy(checkpoint, tmp_path / "truncated" / f"step_{1:010d}")
    for data in truncated.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(fs.CheckpointError, match="could not be read"):
        fs.load(truncated, like, step=step)

    garbled = _copy(checkpoint, tmp_path / "garbled" / f"step_{1:010d}")
    (garbled / "fscale.json").write_text('{"format": "fscale-checkpoint", "vers')
    with pytest.raises(fs.CheckpointError, match="not valid JSON"):
        fs.load(garbled, like, step=step)


def test_a_newer_format_version_is_refused(tmp_path, saved):
    _, checkpoint = saved
    _, step, like = _build()
    newer = _copy(checkpoint, tmp_path / f"step_{1:010d}")
    manifest = json.loads((newer / "fscale.json").read_text())
    manifest["version"] = FORMAT_VERSION + 1
    (newer / "fscale.json").write_text(json.dumps(manifest))
    with pytest.raises(fs.CheckpointError, match=f"newer than the version {FORMAT_VERSION}"):
        fs.load(newer, like, step=step)


def test_bad_arguments_are_named(tmp_path, saved):
    root, _ = saved
    _, step, like = _build()
    with pytest.raises(ValueError, match="`keep_last`"):
        fs.save(tmp_path, like, step=step, keep_last=0)
    with pytest.raises(TypeError, match="`step`"):
        fs.save(tmp_path, like, step=None)
    with pytest.raises(TypeError, match="`like`"):
        fs.load(root, like.params, step=step)
    with pytest.raises(TypeError, match="`model`"):
        fs.save(tmp_path, like, step=step, model="gpt")


def _save_a_tensor_parallel_state(root):
    from fscale.models import GPT, GPTConfig, lm_loss

    mesh = fs.Mesh(tp=2)
    dense = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2, n_layers=1))
    model = fs.tensor_parallel(dense, mesh, "tp", fs.parallel.gpt_plan())
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, tokens, key):
        logits, buffers = apply(params, buffers, tokens[:, :-1], key=key)
        return lm_loss(logits, tokens[:, 1:]), buffers

    step = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    try:
        fs.save(root, step.init(params, buffers), step=step)  # not told of the model
    except fs.CheckpointError as error:
        return str(error), fs.latest(root)
    return None, fs.latest(root)


def test_per_rank_shards_the_save_is_not_told_of_are_refused_not_saved_as_one_ranks(tmp_path):
    # DCP writes a box that several ranks hold once: tensor-parallel shards under the dense
    # names, saved without `model=`, would be stored as rank 0's, silently. The ranks compare
    # what they hold and refuse together.
    for message, latest in run_spmd(_save_a_tensor_parallel_state, 2, str(tmp_path)):
        assert message is not None and "different values for the box at [0, 0]" in message
        assert "tensor-parallel model: pass model=" in message
        assert latest is None
