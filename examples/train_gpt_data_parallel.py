"""The README example: a GPT-style model trained data-parallel on 2 local processes."""

import os

import fscale as fs
from fscale import models


def main():
    mesh = fs.Mesh(dp=2)  # one named axis over the 2 processes
    model = models.GPT(models.GPTConfig(vocab_size=256, seq_len=64))
    apply, params, buffers = fs.functionalize(model)  # flat dicts of tensors

    def loss_fn(params, buffers, batch, key):  # pure; the key drives dropout
        logits, buffers = apply(params, buffers, batch.inputs, key=key)
        return models.lm_loss(logits, batch.targets), buffers

    step = fs.train_step(loss_fn, fs.optim.adamw(3e-3))  # the single-process step
    step = fs.data_parallel(step, mesh)  # DDP, as a transformation
    state = step.init(params, buffers)  # TrainState(params, buffers, opt_state, step, key)
    tokens = fs.data.ByteTokenizer().encode(fs.data.bundled_corpus())
    batches = fs.data.LMBatches(
        fs.data.batchify(tokens, 16),
        seq_len=64,
        rank=mesh.rank("dp"),
        world_size=2,
        batch_major=True,
    )
    for batch in batches:
        state, metrics = step(state, batch)  # metrics["loss"]: global mean
    return float(metrics["loss"])


if __name__ == "__main__":  # ranks re-import this module
    if "RANK" in os.environ:  # under torchrun: join its group, leave it cleanly at the end
        with fs.init():
            print(main())
    else:
        print(fs.launch(main, world_size=2))
