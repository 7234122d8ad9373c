"""Text and token corpora: WikiText files, a small bundled corpus, and a learnable synthetic one.

`wikitext` reads the three splits of a WikiText-style corpus (``wiki.train.tokens``,
``wiki.valid.tokens``, ``wiki.test.tokens``, as unpacked from the WikiText-2 / WikiText-103
archives) without downloading anything. `bundled_corpus` is about 33 KB of plain encyclopedic
English shipped with fscale in the same format, written for the project and free to use, so
demos and tests run offline. `synthetic_corpus` is a token stream made of phrases repeated from
a fixed random phrase book: a small model's loss visibly drops on it within a few steps, which
is what tests and benchmarks of the training machinery need.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import NamedTuple

import torch

from fscale import random as fs_random

__all__ = [
    "Splits",
    "bundled_corpus",
    "load_text",
    "split_text",
    "synthetic_corpus",
    "wikitext",
]

_SPLIT_NAMES = ("train", "valid", "test")
_WIKITEXT_SUFFIXES = (".tokens", ".raw")  # the tokenized and the raw WikiText releases
_BUNDLED_FILE = "tiny_wiki.tokens"


class Splits(NamedTuple):
    """The train / validation / test texts of a corpus."""

    train: str
    valid: str
    test: str


def _check_path(path: str | os.PathLike[str], name: str, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{where}: `{name}` must be a str or os.PathLike, got {type(path).__name__}"
        )
    return os.fspath(path)


def load_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    """The whole content of the text file at `path`.

    Raises:
        TypeError: `path` is not a path.
        FileNotFoundError: nothing exists at `path`, or it is a directory.
    """
    path = _check_path(path, "path", "load_text")
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"load_text: {path!r} {what}; pass the path of a text file")
    with open(path, encoding=encoding) as file:
        return file.read()


def _split_files(directory: str, suffix: str | None) -> dict[str, str] | None:
    """The split files of `directory` for the first suffix that has all three, or None."""
    for candidate in (suffix,) if suffix else _WIKITEXT_SUFFIXES:
        files = {s: os.path.join(directory, f"wiki.{s}{candidate}") for s in _SPLIT_NAMES}
        if all(os.path.isfile(f) for f in files.values()):
            return files
    return None


def wikitext(path_or_dir: str | os.PathLike[str], encoding: str = "utf-8") -> Splits:
    """The train, valid and test texts of a WikiText-style corpus.

    Args:
        path_or_dir: the directory holding ``wiki.{train,valid,test}.tokens`` (or the raw
            release's ``wiki.{train,valid,test}.raw``), or the path of one of those files, in
            which case the other two are read from beside it with the same suffix.
        encoding: the files' text encoding.

    Returns:
        `Splits` of the three texts, unchanged (tokenize them with `WordVocab`, built from
        ``splits.train`` only, or with `ByteTokenizer`).

    Raises:
        FileNotFoundError: `path_or_dir` does not exist or lacks one of the three files; the
            message lists the files that were found.
    """
    path = _check_path(path_or_dir, "path_or_dir", "wikitext")
    if os.path.isdir(path):
        directory, suffix = path, None
    elif os.path.isfile(path):
        directory, name = os.path.split(path)
        suffix = next((s for s in _WIKITEXT_SUFFIXES if name.endswith(s)), None)
        if suffix is None or name not in {f"wiki.{s}{suffix}" for s in _SPLIT_NAMES}:
            raise FileNotFoundError(
                f"wikitext: {path!r} is not a WikiText split file; expected a directory or a "
                "file named wiki.train.tokens, wiki.valid.tokens or wiki.test.tokens "
                "(or .raw)"
            )
    else:
        raise FileNotFoundError(f"wikitext: {path!r} does not exist")
    files = _split_files(directory or ".", suffix)
    if files is None:
        wanted = ", ".join(f"wiki.{s}{suffix or '.tokens'}" for s in _SPLIT_NAMES)
        present = sorted(os.listdir(directory or "."))
        raise FileNotFoundError(
            f"wikitext: {directory!r} must contain {wanted} (or the .raw files); found "
            f"{present[:10]}{' ...' if len(present) > 10 else ''}. Point it at the folder the "
            "WikiText archive unpacks to (e.g. wikitext-2/)"
        )
    return Splits(*(load_text(files[s], encoding) for s in _SPLIT_NAMES))


def bundled_corpus() -> str:
    """The small English corpus shipped with fscale, in WikiText format.

    About 33 KB (about 6,600 words and punctuation tokens) of short encyclopedic articles on
    everyday subjects (the water cycle, bees, bread, clocks, bridges, ...), written for this
    project and free of copyright restrictions. Headings are `` = Title = `` lines, words and
    punctuation are separated by spaces, and hyphens and number separators are written
    ``@-@``, ``@,@`` and ``@.@`` as in WikiText. Use `split_text` for train / valid / test.
    """
    return (
        resources.files(__name__.rpartition(".")[0])
        .joinpath(_BUNDLED_FILE)
        .read_text(encoding="utf-8")
    )


def split_text(text: str, valid_fraction: float = 0.1, test_fraction: float = 0.1) -> Splits:
    """Cut `text` at line boundaries into contiguous train, valid and test parts, in that order.

    Args:
        text: the text to split.
        valid_fraction: the share of lines (rounded down) that goes to the valid split.
        test_fraction: the share of lines (rounded down) that goes to the test split, the last.

    Returns:
        `Splits` whose concatenation ``train + valid + test`` is `text` exactly.

    Raises:
        ValueError: a fraction outside ``[0, 1)`` or fractions summing to 1 or more.
    """
    if not isinstance(text, str):
        raise TypeError(f"split_text: `text` must be a str, got {type(text).__name__}")
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise ValueError(f"split_text: `{name}` must be a number in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1:
        raise ValueError(
            f"split_text: valid_fraction + test_fraction must be < 1 to leave a training split, "
            f"got {valid_fraction} + {test_fraction}"
        )
    lines = text.splitlines(keepends=True)
    num_valid = int(len(lines) * valid_fraction)
    num_test = int(len(lines) * test_fraction)
    first_valid = len(lines) - num_valid - num_test
    first_test = len(lines) - num_test
    return Splits(
        "".join(lines[:first_valid]),
        "".join(lines[first_valid:first_test]),
        "".join(lines[first_test:]),
    )


def _check_positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"synthetic_corpus: `{name}` must be an int >= {minimum}, got {value!r}")
    return value


def synthetic_corpus(
    num_tokens: int,
    vocab_size: int,
    seed: int | torch.Tensor = 0,
    *,
    num_phrases: int = 64,
    phrase_length: tuple[int, int] = (4, 12),
) -> torch.Tensor:
    """A learnable token stream: phrases drawn at random from a fixed random phrase book.

    The phrase book holds `num_phrases` phrases of uniform random tokens, each of a length
    drawn uniformly from ``phrase_length`` (inclusive); the stream concatenates phrases picked
    uniformly at random and is cut to `num_tokens`. Inside a phrase the next token follows from
    the ones before it, so a model that learns the phrases predicts most tokens: the ideal loss
    is about ``log(num_phrases) / mean phrase length`` nats per token (0.52 with the defaults),
    far below the ``log(vocab_size)`` of guessing. The same arguments give the same stream on
    every platform.

    Args:
        num_tokens: length of the stream.
        vocab_size: ids are in ``[0, vocab_size)``.
        seed: an int, or an `fscale.random` key.
        num_phrases: size of the phrase book; more phrases make the stream harder.
        phrase_length: ``(shortest, longest)`` phrase length, both >= 1.

    Returns:
        A 1-D int64 CPU tensor of `num_tokens` ids (host memory; move it with ``.to(device)``).

    Raises:
        ValueError: a size < 1 or a bad `phrase_length`.
        TypeError: `seed` is neither an int nor a key.
    """
    _check_positive_int(num_tokens, "num_tokens")
    _check_positive_int(vocab_size, "vocab_size")
    _check_positive_int(num_phrases, "num_phrases")
    if (
        not isinstance(phrase_length, tuple)
        or len(phrase_length) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in phrase_length)
        or not 1 <= phrase_length[0] <= phrase_length[1]
    ):
        raise ValueError(
            "synthetic_corpus: `phrase_length` must be a (shortest, longest) tuple of ints with "
            f"1 <= shortest <= longest, got {phrase_length!r}"
        )
    if isinstance(seed, torch.Tensor) and fs_random.is_key(seed):
        seed = fs_random.seed(seed)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"synthetic_corpus: `seed` must be an int or an fscale.random key, got {seed!r}"
        )
    generator = torch.Generator().manual_seed(seed)
    shortest, longest = phrase_length
    lengths = torch.randint(shortest, longest + 1, (num_phrases,), generator=generator)
    book = torch.randint(0, vocab_size, (num_phrases, longest), generator=generator)
    # Enough phrases to cover num_tokens even if every pick is a shortest phrase.
    picks = torch.randint(0, num_phrases, (num_tokens // shortest + 1,), generator=generator)
    # Row-major flattening of the picked rows, keeping only each phrase's first `length` tokens.
    keep = torch.arange(longest) < lengths[picks].unsqueeze(1)
    return book[picks][keep][:num_tokens].clone()
