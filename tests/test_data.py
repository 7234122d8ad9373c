"""fscale.data: tokenizers, corpora, [T, B] batching with the seq_len + 1 trick, per-rank views."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fscale import random as fs_random
from fscale.data import (
    ByteTokenizer,
    LMBatch,
    LMBatches,
    Splits,
    WordVocab,
    batchify,
    bundled_corpus,
    load_text,
    shard_batch,
    split_batch,
    split_text,
    synthetic_corpus,
    wikitext,
)

# --------------------------------------------------------------------------- ByteTokenizer


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert bytes(ids.tolist()) == text.encode("utf-8")
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_exact_bytes_and_edges():
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 256
    assert tokenizer.encode("aé✓").tolist() == [0x61, 0xC3, 0xA9, 0xE2, 0x9C, 0x93]
    assert tokenizer.encode("").shape == (0,)
    assert tokenizer.decode([]) == ""
    assert tokenizer.decode([104, 105]) == "hi"
    # Half of a two-byte character: strict refuses, "replace" (for model samples) substitutes.
    with pytest.raises(UnicodeDecodeError):
        tokenizer.decode([0xC3])
    assert tokenizer.decode([0x61, 0xC3], errors="replace") == "a\ufffd"


def test_byte_tokenizer_errors():
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 256\), got \[256, -1\]"):
        tokenizer.decode([65, 256, -1])
    with pytest.raises(TypeError, match="`text` must be a str"):
        tokenizer.encode(b"bytes")
    with pytest.raises(TypeError, match="1-D integer tensor"):
        tokenizer.decode(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        tokenizer.decode(torch.tensor([65.0]))


# --------------------------------------------------------------------------- WordVocab


def test_word_vocab_ids_by_count_then_token_after_specials():
    vocab = WordVocab.build("b a c\na b\nb\n")
    # b: 3, a: 2, c: 1, <eos>: 3 (a special, kept in its place).
    assert vocab.tokens == ("<unk>", "<eos>", "b", "a", "c")
    assert (vocab.unk_id, vocab.eos_id, len(vocab), vocab.vocab_size) == (0, 1, 5, 5)
    tied = WordVocab.build("z y x y z x")
    assert tied.tokens == ("<unk>", "<eos>", "x", "y", "z")


def test_word_vocab_newline_is_eos_and_round_trip():
    text = "the cat sat\n\non the mat\n"
    vocab = WordVocab.build(text)
    assert WordVocab.tokenize(text) == [
        "the",
        "cat",
        "sat",
        "<eos>",
        "<eos>",
        "on",
        "the",
        "mat",
        "<eos>",
    ]
    ids = vocab.encode(text)
    assert ids.dtype == torch.int64
    assert vocab.decode(ids) == text
    assert vocab.decode(vocab.encode("the mat")) == "the mat"  # no newline, no <eos>
    # Irregular spacing decodes to the normal form.
    assert vocab.decode(vocab.encode("  the\tcat  \n")) == "the cat\n"


def test_word_vocab_from_train_only_maps_unseen_valid_words_to_unk():
    splits = Splits(train="a b a\nc\n", valid="a d\ne c\n", test="")
    vocab = WordVocab.build(splits.train)
    assert "d" not in vocab and "e" not in vocab
    ids = vocab.encode(splits.valid)
    assert ids.tolist() == [
        vocab.id("a"),
        vocab.unk_id,
        vocab.eos_id,
        vocab.unk_id,
        vocab.id("c"),
        vocab.eos_id,
    ]
    assert vocab.decode(ids) == "a <unk>\n<unk> c\n"


def test_word_vocab_min_count_specials_and_literal_unk():
    text = "<unk> x x y\n"
    vocab = WordVocab.build(text, min_count=2, specials=("<unk>", "<eos>", "<pad>"))
    assert vocab.tokens == ("<unk>", "<eos>", "<pad>", "x")
    assert vocab.encode("y <unk> x").tolist() == [0, 0, 3]
    assert vocab.id("y") == vocab.unk_id and vocab.token(3) == "x"


def test_word_vocab_save_and_restore_through_tokens():
    vocab = WordVocab.build(bundled_corpus())
    restored = WordVocab(list(vocab.tokens))
    assert restored == vocab and hash(restored) == hash(vocab)
    sample = "The honey bee makes honey .\n"
    assert torch.equal(restored.encode(sample), vocab.encode(sample))


def test_word_vocab_errors():
    with pytest.raises(ValueError, match=r"must contain '<eos>'.*`specials`"):
        WordVocab.build("a b", specials=("<unk>",))
    with pytest.raises(ValueError, match="`min_count` must be an int >= 1, got 0"):
        WordVocab.build("a", min_count=0)
    with pytest.raises(ValueError, match=r"`tokens` must be unique, repeated: \['a'\]"):
        WordVocab(["<unk>", "<eos>", "a", "a"])
    with pytest.raises(ValueError, match="without whitespace"):
        WordVocab(["<unk>", "<eos>", "a b"])
    with pytest.raises(TypeError, match="`text` must be a str"):
        WordVocab.build(["a", "b"])
    vocab = WordVocab.build("a b")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\), got \[4\]"):
        vocab.decode([0, 4])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        vocab.token(-1)


# --------------------------------------------------------------------------- corpora


def _write_wikitext(directory, suffix=".tokens"):
    texts = Splits(" = A = \n a b c \n", " a d \n", " e a \n")
    for name, text in zip(Splits._fields, texts):
        (directory / f"wiki.{name}{suffix}").write_text(text, encoding="utf-8")
    return texts


def test_load_text_and_errors(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo\nworld\n", encoding="utf-8")
    assert load_text(path) == "héllo\nworld\n"
    assert load_text(str(path)) == "héllo\nworld\n"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_text(tmp_path)
    with pytest.raises(TypeError, match=r"`path` must be a str or os\.PathLike"):
        load_text(3)


def test_wikitext_reads_directory_or_split_file(tmp_path):
    texts = _write_wikitext(tmp_path)
    splits = wikitext(tmp_path)
    assert isinstance(splits, Splits) and splits == texts
    assert wikitext(tmp_path / "wiki.valid.tokens") == texts
    # The vocabulary of the benchmark comes from the train split only.
    vocab = WordVocab.build(splits.train)
    assert vocab.encode(splits.test).tolist()[:2] == [vocab.unk_id, vocab.id("a")]


def test_wikitext_reads_raw_release(tmp_path):
    texts = _write_wikitext(tmp_path, suffix=".raw")
    assert wikitext(tmp_path) == texts
    assert wikitext(tmp_path / "wiki.train.raw") == texts


def test_wikitext_errors(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text("a\n")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(
        FileNotFoundError,
        match=r"must contain wiki\.train\.tokens, wiki\.valid\.tokens, wiki\.test\.tokens.*"
        r"found \['notes\.txt', 'wiki\.train\.tokens'\]",
    ):
        wikitext(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a WikiText split file"):
        wikitext(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        wikitext(tmp_path / "nowhere")


def test_bundled_corpus_is_wikitext_formatted_english():
    text = bundled_corpus()
    assert 25_000 < len(text.encode("utf-8")) < 60_000
    assert text.startswith(" \n = The water cycle = \n")
    assert text.count("\n = = ") > 20  # section headings
    assert " @-@ " in text and text.isascii()
    words = WordVocab.tokenize(text)
    assert len(words) > 5_000
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text


def test_split_text_cuts_at_lines_and_reassembles_exactly():
    text = "".join(f"line {i}\n" for i in range(10))
    splits = split_text(text, valid_fraction=0.2, test_fraction=0.1)
    assert splits.train == "".join(f"line {i}\n" for i in range(7))
    assert splits.valid == "line 7\nline 8\n" and splits.test == "line 9\n"
    assert "".join(split_text(bundled_corpus())) == bundled_corpus()
    with pytest.raises(ValueError, match="`valid_fraction` must be a number in"):
        split_text(text, valid_fraction=1.5)
    with pytest.raises(ValueError, match="must be < 1 to leave a training split"):
        split_text(text, valid_fraction=0.5, test_fraction=0.5)


def test_synthetic_corpus_is_deterministic_and_in_range():
    first = synthetic_corpus(1000, 50, seed=3)
    assert first.shape == (1000,) and first.dtype == torch.int64
    assert int(first.min()) >= 0 and int(first.max()) < 50
    assert torch.equal(first, synthetic_corpus(1000, 50, seed=3))
    assert not torch.equal(first, synthetic_corpus(1000, 50, seed=4))
    # A longer stream with the same seed starts with the same tokens.
    assert torch.equal(first[:500], synthetic_corpus(500, 50, seed=3))
    key = fs_random.key(7)
    assert torch.equal(synthetic_corpus(64, 50, key), synthetic_corpus(64, 50, key))
    assert synthetic_corpus(3, 2, phrase_length=(1, 1), num_phrases=1).shape == (3,)


def _bigram_heldout_loss(stream, vocab_size, steps=150):
    """Held-out next-token loss of a bigram model (a table of logits) trained on `stream`."""
    torch.manual_seed(0)
    split = len(stream) * 4 // 5
    train, heldout = stream[:split], stream[split:]
    logits = torch.zeros(vocab_size, vocab_size, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.3)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(logits[train[:-1]], train[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(logits[heldout[:-1]], heldout[1:]))


def test_synthetic_corpus_is_learnable_and_random_tokens_are_not():
    vocab_size = 64
    learnable = _bigram_heldout_loss(synthetic_corpus(20_000, vocab_size, seed=0), vocab_size)
    noise = torch.randint(0, vocab_size, (20_000,), generator=torch.Generator().manual_seed(0))
    unlearnable = _bigram_heldout_loss(noise, vocab_size)
    assert unlearnable > math.log(vocab_size) - 0.05  # nothing to learn from noise
    # Even a bigram model, which sees only the previous token, learns much of the phrase book.
    assert learnable < math.log(vocab_size) - 1.0


def test_synthetic_corpus_errors():
    with pytest.raises(ValueError, match="`num_tokens` must be an int >= 1, got 0"):
        synthetic_corpus(0, 10)
    with pytest.raises(ValueError, match="`vocab_size` must be an int >= 1"):
        synthetic_corpus(10, 2.5)
    with pytest.raises(ValueError, match="`phrase_length` must be a"):
        synthetic_corpus(10, 10, phrase_length=(5, 2))
    with pytest.raises(TypeError, match=r"`seed` must be an int or an fscale\.random key"):
        synthetic_corpus(10, 10, seed="0")


# --------------------------------------------------------------------------- batchify


def test_batchify_layout_matches_hand_example():
    ids = torch.arange(13)  # a..m; m is the remainder of 13 = 3 * 4 + 1
    data = batchify(ids, 3)
    expected = torch.tensor([[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]])
    assert torch.equal(data, expected) and data.is_contiguous()
    assert batchify(ids.to(torch.int32), 3).dtype == torch.int32
    assert torch.equal(batchify(ids, 1), ids.unsqueeze(1))


def test_batchify_errors():
    with pytest.raises(ValueError, match="`batch_size`=5 streams need at least 5 tokens, but"):
        batchify(torch.arange(4), 5)
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1, got 0"):
        batchify(torch.arange(4), 0)
    with pytest.raises(TypeError, match="1-D integer tensor of token ids, got a tensor of dtype"):
        batchify(torch.zeros(4), 2)
    with pytest.raises(TypeError, match="got a list"):
        batchify([1, 2, 3], 1)


# --------------------------------------------------------------------------- LMBatches


def test_lm_batches_seq_len_plus_one_trick_hand_example():
    data = batchify(torch.arange(21), 3)  # [7, 3], streams 0..6, 7..13, 14..20
    batches = LMBatches(data, seq_len=2)
    assert len(batches) == 3  # (7 - 1) // 2
    first, second, third = list(batches)
    assert torch.equal(first.inputs, torch.tensor([[0, 7, 14], [1, 8, 15]]))
    assert torch.equal(first.targets, torch.tensor([[1, 8, 15], [2, 9, 16]]))
    assert torch.equal(second.inputs, torch.tensor([[2, 9, 16], [3, 10, 17]]))
    assert torch.equal(third.targets, torch.tensor([[5, 12, 19], [6, 13, 20]]))
    assert isinstance(first, LMBatch) and torch.equal(batches[-1].inputs, third.inputs)
    assert repr(batches) == "LMBatches(3 batches, seq_len=2, data=[7, 3], rank=0/1, time-major)"
    assert LMBatches(batchify(torch.arange(24), 4), 2, rank=1, world_size=2).streams_per_rank == 2


def test_lm_batches_drop_last_false_covers_every_target():
    data = batchify(torch.arange(24), 2)  # [12, 2]: 11 target rows
    assert len(LMBatches(data, seq_len=4)) == 2
    batches = list(LMBatches(data, seq_len=4, drop_last=False))
    assert [b.inputs.shape[0] for b in batches] == [4, 4, 3]
    targets = torch.cat([b.targets for b in batches])
    assert torch.equal(targets, data[1:])


@given(
    num_tokens=st.integers(20, 300),
    batch_size=st.integers(1, 6),
    seq_len=st.integers(1, 9),
)
def test_lm_batches_streams_stay_contiguous(num_tokens, batch_size, seq_len):
    ids = torch.randperm(num_tokens)
    data = batchify(ids, batch_size)
    if data.shape[0] < seq_len + 1:
        return
    batches = list(LMBatches(data, seq_len, drop_last=False))
    for b in batches:
        assert torch.equal(b.inputs[1:], b.targets[:-1])  # targets are inputs shifted by one
    for before, after in itertools.pairwise(batches):
        assert torch.equal(before.targets[-1], after.inputs[0])  # next batch continues stream
    # Reading every stream back gives the token sequence in its original order.
    streams = torch.cat([batches[0].inputs[:1]] + [b.targets for b in batches])
    assert torch.equal(streams.t().reshape(-1), ids[: data.numel()])


def test_lm_batches_batch_major_layout():
    data = batchify(torch.arange(40), 4)
    time_major = LMBatches(data, seq_len=3)[1]
    batch_major = LMBatches(data, seq_len=3, batch_major=True)[1]
    assert time_major.inputs.shape == (3, 4) and batch_major.inputs.shape == (4, 3)
    assert torch.equal(batch_major.inputs, time_major.inputs.t())
    assert torch.equal(time_major.batch_major().targets, batch_major.targets)
    assert batch_major.inputs.is_contiguous()
    # Row b of a batch-major batch is stream b: consecutive tokens of the corpus.
    assert batch_major.inputs[2].tolist() == [23, 24, 25]


def test_lm_batches_errors():
    data = batchify(torch.arange(30), 6)  # [5, 6]
    with pytest.raises(
        ValueError,
        match=r"`seq_len`=5 needs seq_len \+ 1 = 6 rows .* only 5 rows of 6 streams; "
        r"use seq_len <= 4, fewer streams in batchify",
    ):
        LMBatches(data, seq_len=5)
    with pytest.raises(
        ValueError,
        match=r"the 6 streams of `data` do not divide among `world_size`=4 ranks; .*multiple of 4",
    ):
        LMBatches(data, seq_len=2, world_size=4)
    with pytest.raises(ValueError, match=r"`rank` must be an int in \[0, world_size=2\), got 2"):
        LMBatches(data, seq_len=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="`seq_len` must be an int >= 1"):
        LMBatches(data, seq_len=0)
    with pytest.raises(TypeError, match=r"2-D \[T, B\] integer tensor from batchify"):
        LMBatches(torch.arange(10), seq_len=2)
    with pytest.raises(IndexError, match="batch 2 out of range for 2 batches"):
        LMBatches(data, seq_len=2)[2]


# --------------------------------------------------------------------------- per-rank views


@given(world_size=st.sampled_from([1, 2, 3, 4, 6]), seq_len=st.integers(1, 5))
def test_rank_views_are_disjoint_and_their_union_is_the_global_batch(world_size, seq_len):
    data = batchify(torch.randperm(360), 12)  # [30, 12]
    global_batches = list(LMBatches(data, seq_len))
    per_rank = [
        list(LMBatches(data, seq_len, rank=r, world_size=world_size)) for r in range(world_size)
    ]
    for step, global_batch in enumerate(global_batches):
        rank_batches = [batches[step] for batches in per_rank]
        for rank, batch in enumerate(rank_batches):
            assert batch.inputs.shape == (seq_len, 12 // world_size)
            sharded = shard_batch(global_batch, rank, world_size, dim=1)
            assert torch.equal(sharded.inputs, batch.inputs)
            assert torch.equal(sharded.targets, batch.targets)
        # Tokens are unique, so disjoint slices cover the batch iff their union equals it.
        union = LMBatch(*(torch.cat(parts, dim=1) for parts in zip(*rank_batches)))
        assert torch.equal(union.inputs, global_batch.inputs)
        assert torch.equal(union.targets, global_batch.targets)


def test_rank_views_in_batch_major_layout():
    data = batchify(torch.arange(80), 4)
    global_batch = LMBatches(data, 5, batch_major=True)[0]
    local = LMBatches(data, 5, rank=1, world_size=2, batch_major=True)[0]
    assert torch.equal(local.inputs, global_batch.inputs[2:4])
    assert torch.equal(shard_batch(global_batch, 1, 2, dim=0).targets, local.targets)


def test_shard_batch_errors():
    batch = LMBatches(batchify(torch.arange(60), 6), 3)[0]
    with pytest.raises(TypeError, match="dim"):
        shard_batch(batch, 0, 2)  # the stream dimension must be stated
    with pytest.raises(
        ValueError,
        match=r"the 6 streams \(dim 1\) of `batch` do not divide "
        r"among `world_size`=4 ranks",
    ):
        shard_batch(batch, 0, 4, dim=1)
    with pytest.raises(ValueError, match=r"`dim` must be 1 \(time-major \[T, B\]\) or 0"):
        shard_batch(batch, 0, 2, dim=2)
    with pytest.raises(TypeError, match=r"must be an LMBatch of tensors.*use split_batch"):
        shard_batch((batch.inputs, batch.targets), 0, 2, dim=1)
    with pytest.raises(ValueError, match="inputs and targets must be 2-D and of one shape"):
        shard_batch(LMBatch(batch.inputs, batch.targets[:1]), 0, 2, dim=1)


def test_split_batch_on_a_pytree_of_images():
    images = torch.randn(8, 3, 4, 4)
    batch = {"images": images, "labels": torch.arange(8), "extra": [torch.ones(8, 2)]}
    parts = [split_batch(batch, r, 4) for r in range(4)]
    assert torch.equal(parts[1]["labels"], torch.tensor([2, 3]))
    assert parts[1]["images"].data_ptr() == images[2:4].data_ptr()  # a view, not a copy
    assert torch.equal(torch.cat([p["images"] for p in parts]), images)
    assert torch.equal(torch.cat([p["extra"][0] for p in parts]), batch["extra"][0])
    # Along another dimension, negative dims included.
    halves = [split_batch((images,), r, 2, dim=-1)[0] for r in range(2)]
    assert halves[0].shape == (8, 3, 4, 2) and torch.equal(torch.cat(halves, dim=-1), images)


def test_split_batch_errors():
    batch = {"images": torch.zeros(6, 2), "labels": torch.zeros(6)}
    with pytest.raises(
        ValueError,
        match=r"the batch size 6 \(dim 0 of images, labels\) does "
        "not divide among `world_size`=4 ranks",
    ):
        split_batch(batch, 0, 4)
    with pytest.raises(ValueError, match="same size along dim 0"):
        split_batch({"a": torch.zeros(4), "b": torch.zeros(2)}, 0, 2)
    with pytest.raises(TypeError, match="but meta is a str; keep non-tensor values out"):
        split_batch({"x": torch.zeros(4), "meta": "tag"}, 0, 2)
    with pytest.raises(ValueError, match=r"`dim`=1 does not exist in labels of shape \(6,\)"):
        split_batch(batch, 0, 2, dim=1)
    with pytest.raises(ValueError, match=r"`rank` must be an int in \[0, world_size=2\), got -1"):
        split_batch(batch, -1, 2)
    with pytest.raises(ValueError, match="`world_size` must be an int >= 1, got 0"):
        split_batch(batch, 0, 0)
