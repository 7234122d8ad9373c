"""Checkpoint files under faults: killed ranks, failing disks, and bad input."""

import importlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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


# ---- a rank killed at each phase of a save ------------------------------------------------

# Where a rank is SIGKILLed, which rank, and what the killed save leaves under its .tmp- name.
KILL_POINTS = {
    "write": 1,  # while writing its data: its file torn, no DCP metadata
    "metadata": 0,  # after every rank's data, before DCP's metadata
    "manifest": 0,  # after DCP's metadata, before fscale's manifest
    "rename": 0,  # after the manifest, before the directory is renamed into place
    "prune": 0,  # during retention cleanup, after the new checkpoint is committed
    "async": 1,  # while an asynchronous save writes and training continues
}
KEEP_LAST = {"prune": 1}
# The module, which `fscale.ckpt.save` (the function) hides.
save_module = importlib.import_module("fscale.ckpt.save")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(where, root):
    """Make this rank die at `where` (only in this process: patched here, after the first save)."""
    if where == "write":
        write_data = FileSystemWriter.write_data

        def write_torn_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            for data in Path(self.path).glob("__1_*.distcp"):  # half of it reached the disk
                data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
            _die()

        FileSystemWriter.write_data = write_torn_then_die
    elif where == "metadata":
        FileSystemWriter.finish = lambda self, metadata, results: _die()
    elif where == "manifest":
        save_module.write_manifest = lambda tmp, manifest: _die()
    elif where == "rename":
        directory.commit = lambda tmp, final: _die()
    elif where == "prune":
        rmtree = shutil.rmtree

        def die_while_deleting(path, ignore_errors=False):
            if Path(path).name.startswith(".tmp-pruned-"):
                next(p for p in Path(path).iterdir() if p.is_file()).unlink()
                _die()
            rmtree(path, ignore_errors=ignore_errors)

        directory.shutil = SimpleNamespace(rmtree=die_while_deleting)
    elif where == "async":
        trained = Path(root, "trained-on-rank-1")

        def write_while_training_then_die(self, plan, planner):
            deadline = time.monotonic() + 60
            while not trained.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the training steps after the save run meanwhile
            _die()

        FileSystemWriter.write_data = write_while_training_then_die


def _save_then_die_while_saving_again(root, where):
    case, step, state = _build()
    state = _train(case, step, state, 2)
    keep_last = KEEP_LAST.get(where)
    fs.save(root, state, step=step, keep_last=keep_last)
    state = _train(case, step, state, 2)
    if dist.get_rank() == KILL_POINTS[where]:
        _arm(where, root)
    if where == "async":
        fs.save(root, state, step=step, async_=True)
        state = _train(case, step, state, 2)
        Path(root, f"trained-on-rank-{dist.get_rank()}").touch()
        fs.wait_saves()
    else:
        fs.save(root, state, step=step, keep_last=keep_last)


def _resume_all(roots):
    """Resume each root from its latest checkpoint, train 2 steps and save again."""
    out = []
    for root in roots:
        case, step, like = _build()
        latest = fs.latest(root)
        state = fs.load(root, like, step=step)
        resumed_at = int(state.step)
        state = _train(case, step, state, 2)
        fs.save(root, state, step=step)  # removes what the killed save left
        uninterrupted = _train(case, step, like, resumed_at + 2)
        entries = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        out.append(
            (
                str(latest),
                resumed_at,
                fs.consolidate(step, state),
                fs.consolidate(step, uninterrupted),
                entries,
            )
        )
    return out


def _what_the_killed_save_left(root, where):
    partial = Path(root) / f".tmp-step_{4:010d}"
    if where == "prune":
        # The new checkpoint was committed; the pruned one was renamed aside, half deleted.
        assert not partial.exists()
        assert (Path(root) / f".tmp-pruned-step_{2:010d}").is_dir()
        assert fs.latest(root) == Path(root) / f"step_{4:010d}"
        return 4
    assert partial.is_dir()
    assert (partial / ".metadata").exists() == (where in ("manifest", "rename"))
    assert (partial / "fscale.json").exists() == (where == "rename")
    if where in ("write", "metadata"):
        assert list(partial.glob("*.distcp"))
    if where == "async":
        assert Path(root, "trained-on-rank-1").exists()  # training went on during the write
    assert fs.latest(root) == Path(root) / f"step_{2:010d}"
    return 2


def test_a_rank_killed_at_any_phase_of_a_save_leaves_a_loadable_checkpoint_and_resumes():
    with tempfile.TemporaryDirectory() as base:
        roots, expected = [], []
        for where in KILL_POINTS:
            root = os.path.join(base, where)
            # The pool's ranks: the killed one takes the group down, and the pool starts anew.
            with pytest.raises(fs.distributed.RankError):
                run_spmd(_save_then_die_while_saving_again, 2, root, where, timeout=120)
            expected.append(_what_the_killed_save_left(root, where))
            roots.append(root)
        # A fresh set of processes resumes every run from its latest complete checkpoint.
        results = run_spmd(_resume_all, 2, roots, timeout=300)
    for rank_results in results:
        for where, resumed, (latest, resumed_at, state, uninterrupted, entries) in zip(
            KILL_POINTS, expected, rank_results
        ):
            assert latest.endswith(f"step_{resumed:010d}"), where
            assert resumed_at == resumed, where
            assert_trees_equal(state, uninterrupted)
            # The next save cleaned the partial directory up.
            assert entries == sorted({f"step_{resumed:010d}", f"step_{resumed + 2:010d}"}), where


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


# ---- one rank failing on its own before the ranks exchange --------------------------------

load_module = importlib.import_module("fscale.ckpt.load")


def _one_rank_fails_before_the_exchange(root, caller):
    """Rank 1 fails where it finds its pieces (save) or reads the manifest (load); what each
    rank raised, and how long it took."""
    case, step, state = _build()
    state = _train(case, step, state, 1)
    fs.save(root, state, step=step)
    module, name = {"save": (save_module, "pieces_of"), "load": (load_module, "read_manifest")}[
        caller
    ]
    original = getattr(module, name)
    if dist.get_rank() == 1:

        def fail(*args, **kwargs):
            raise ValueError("this rank cannot go on")

        setattr(module, name, fail)
    started = time.monotonic()
    try:
        if caller == "save":
            fs.save(root, _train(case, step, state, 1), step=step)
        else:
            fs.load(root, state, step=step)
    except Exception as error:
        raised = (type(error).__name__, str(error))
    else:
        raised = None
    finally:
        setattr(module, name, original)
    took = time.monotonic() - started
    dist.barrier()  # the ranks are still in step
    return raised, took


@pytest.mark.parametrize("caller", ["save", "load"])
def test_a_rank_that_fails_before_the_ranks_exchange_is_named_on_every_rank_at_once(caller):
    # The failing rank hands its error to the exchange its peer waits in (before, the peer
    # waited out the checkpoint group's ten minutes).
    with tempfile.TemporaryDirectory() as root:
        (peer, peer_took), (failed, _) = run_spmd(
            _one_rank_fails_before_the_exchange, 2, root, caller, timeout=120.0
        )
    assert failed == ("ValueError", "this rank cannot go on")  # its own error, as it was
    assert peer is not None and peer[0] == "CheckpointError"
    assert f"{caller}: finding the pieces failed on 1 rank(s): rank 1: ValueError" in peer[1]
    assert peer_took < 30.0


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
    with pytest.raises(TypeError, match="`model`"):
        fs.load(root, like, step=step, model="gpt")


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
    state = step.init(params, buffers)
    try:
        fs.save(root, state, step=step)  # not told of the model
    except fs.CheckpointError as error:
        refused = str(error), fs.latest(root)
    fs.save(root, state, step=step, model=model)
    try:
        fs.load(root, state, step=step)  # not told of the model
    except fs.CheckpointError as error:
        return refused, str(error)
    return refused, None


def test_per_rank_shards_the_save_is_not_told_of_are_refused_not_saved_as_one_ranks(tmp_path):
    # DCP writes a box that several ranks hold once: tensor-parallel shards under the dense
    # names, saved without `model=`, would be stored as rank 0's, silently. The ranks compare
    # what they hold and refuse together.
    for (message, latest), load_error in run_spmd(_save_a_tensor_parallel_state, 2, str(tmp_path)):
        assert "different values for the box at [0, 0]" in message
        assert "tensor-parallel model: pass model=" in message
        assert latest is None
        # Told of it, the save goes through; a load that is not told of it is refused.
        assert load_error is not None and "another model" in load_error
        assert "for a tensor-parallel model, pass model=" in load_error
