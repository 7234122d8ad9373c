"""Data for language-model training: tokenizers, corpora, ``[T, B]`` batching, per-rank slices.

The pipeline of the WikiText language-model benchmarks, as plain functions::

    splits = fscale.data.wikitext("wikitext-2/")  # or split_text(bundled_corpus())
    vocab = fscale.data.WordVocab.build(splits.train)  # from the training split only
    streams = fscale.data.batchify(vocab.encode(splits.train), batch_size=16)  # [T, 16]
    for batch in fscale.data.LMBatches(streams, seq_len=32, rank=r, world_size=n):
        ...  # batch.inputs, batch.targets
"""

from fscale.data.batching import LMBatch as LMBatch
from fscale.data.batching import LMBatches as LMBatches
from fscale.data.batching import batchify as batchify
from fscale.data.batching import shard_batch as shard_batch
from fscale.data.batching import split_batch as split_batch
from fscale.data.corpus import Splits as Splits
from fscale.data.corpus import bundled_corpus as bundled_corpus
from fscale.data.corpus import load_text as load_text
from fscale.data.corpus import split_text as split_text
from fscale.data.corpus import synthetic_corpus as synthetic_corpus
from fscale.data.corpus import wikitext as wikitext
from fscale.data.tokenizers import ByteTokenizer as ByteTokenizer
from fscale.data.tokenizers import WordVocab as WordVocab

__all__ = [
    "ByteTokenizer",
    "LMBatch",
    "LMBatches",
    "Splits",
    "WordVocab",
    "batchify",
    "bundled_corpus",
    "load_text",
    "shard_batch",
    "split_batch",
    "split_text",
    "synthetic_corpus",
    "wikitext",
]
