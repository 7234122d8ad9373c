"""Tokenizers for language-model corpora: UTF-8 bytes, and a word vocabulary built from text.

`ByteTokenizer` maps text to its UTF-8 bytes (256 ids, nothing to build, exact round trip).
`WordVocab` is the word-level vocabulary of the WikiText language-model benchmarks: tokens are
whitespace-separated words, every newline becomes the end-of-sentence token ``<eos>``, words
the vocabulary does not know become ``<unk>``. Build it from the *training* split only, so that
validation and test words never seen in training count as unknown, as the benchmark does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

__all__ = ["ByteTokenizer", "WordVocab"]

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _as_id_list(ids: torch.Tensor | Sequence[int], where: str) -> list[int]:
    """`ids` (a 1-D integer tensor or a sequence of ints) as a Python list of ints."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in _INTEGER_DTYPES or ids.dim() != 1:
            raise TypeError(
                f"{where}: `ids` must be a 1-D integer tensor, got dtype {ids.dtype} and "
                f"shape {tuple(ids.shape)}; decode one sequence at a time (e.g. a row of a batch)"
            )
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TypeError(f"{where}: `ids` must be a 1-D integer tensor or a sequence of ints")
    return list(ids)


def _check_range(id_list: list[int], vocab_size: int, where: str) -> None:
    bad = [i for i in id_list if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{where}: ids must lie in [0, {vocab_size}), got {bad[:5]}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + "; were they produced by a different tokenizer?"
        )


class ByteTokenizer:
    """Text as its UTF-8 bytes: id ``b`` is the byte ``b``, so the vocabulary has 256 ids.

    ``decode(encode(text)) == text`` for every string; no vocabulary has to be built or saved.
    """

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of `text` as a 1-D int64 tensor (on the CPU: host memory)."""
        if not isinstance(text, str):
            raise TypeError(
                f"ByteTokenizer.encode: `text` must be a str, got {type(text).__name__}"
            )
        data = bytearray(text.encode("utf-8"))
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | Sequence[int], errors: str = "strict") -> str:
        """The text whose UTF-8 bytes are `ids`.

        Args:
            ids: a 1-D integer tensor or sequence of ints in ``[0, 256)``.
            errors: how to treat byte sequences that are not valid UTF-8, as in
                `bytes.decode`; pass ``"replace"`` for text sampled from a model, which may
                cut a multi-byte character in half.

        Raises:
            ValueError: an id outside ``[0, 256)``, or invalid UTF-8 with ``errors="strict"``.
        """
        id_list = _as_id_list(ids, "ByteTokenizer.decode")
        _check_range(id_list, self.vocab_size, "ByteTokenizer.decode")
        return bytes(id_list).decode("utf-8", errors=errors)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class WordVocab:
    """A word vocabulary: whitespace tokens, ``<eos>`` for each newline, ``<unk>`` for unknowns.

    Ids are assigned deterministically: the special tokens first, in the order given, then the
    words by decreasing count, ties broken by the word itself, so the same text always yields
    the same ids.

    Args:
        tokens: the vocabulary, id ``i`` being ``tokens[i]``; must be unique and contain
            ``"<unk>"`` and ``"<eos>"``. Use `WordVocab.build` to make one from text, and
            `tokens` to save one (``WordVocab(vocab.tokens)`` restores it exactly).

    Raises:
        ValueError: duplicate tokens, or a missing ``<unk>`` / ``<eos>``.
    """

    UNK = "<unk>"
    EOS = "<eos>"

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = tuple(tokens)
        if not all(isinstance(t, str) and t and t.split() == [t] for t in self._tokens):
            raise ValueError("WordVocab: every token must be a non-empty str without whitespace")
        self._ids = {token: i for i, token in enumerate(self._tokens)}
        if len(self._ids) != len(self._tokens):
            repeated = sorted(t for t, n in Counter(self._tokens).items() if n > 1)
            raise ValueError(f"WordVocab: `tokens` must be unique, repeated: {repeated[:5]}")
        for special in (self.UNK, self.EOS):
            if special not in self._ids:
                raise ValueError(
                    f"WordVocab: `tokens` must contain {special!r} (unknown words and newlines "
                    "map to it); include it in `specials` when building"
                )
        self.unk_id = self._ids[self.UNK]
        self.eos_id = self._ids[self.EOS]

    @classmethod
    def build(
        cls,
        text: str,
        min_count: int = 1,
        specials: Sequence[str] = ("<unk>", "<eos>"),
    ) -> WordVocab:
        """The vocabulary of `text` (pass the training split only).

        Args:
            text: the training text.
            min_count: words seen fewer times than this are left out and encode as ``<unk>``.
            specials: tokens placed first, in this order, whether or not they occur in
                `text`; must include ``"<unk>"`` and ``"<eos>"``.

        Returns:
            The vocabulary: `specials`, then the words of `text` counted at least `min_count`
            times, by decreasing count and then alphabetically.

        Raises:
            TypeError: `text` is not a str.
            ValueError: `min_count` < 1, or `specials` lacks ``<unk>`` / ``<eos>``.
        """
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"WordVocab.build: `min_count` must be an int >= 1, got {min_count!r}")
        counts = Counter(cls.tokenize(text))
        specials = tuple(specials)
        words = [w for w, n in counts.items() if n >= min_count and w not in specials]
        words.sort(key=lambda w: (-counts[w], w))
        return cls(specials + tuple(words))

    @classmethod
    def tokenize(cls, text: str) -> list[str]:
        """The tokens of `text`: its whitespace-separated words, ``<eos>`` for every newline.

        A last line without a trailing newline gets no ``<eos>``, so ``"a\\nb"`` and
        ``"a\\nb\\n"`` differ by exactly one token.
        """
        if not isinstance(text, str):
            raise TypeError(f"WordVocab: `text` must be a str, got {type(text).__name__}")
        lines = text.split("\n")
        tokens: list[str] = []
        for line in lines[:-1]:
            tokens.extend(line.split())
            tokens.append(cls.EOS)
        tokens.extend(lines[-1].split())
        return tokens

    def encode(self, text: str) -> torch.Tensor:
        """The ids of `text`'s tokens as a 1-D int64 tensor; unknown words become ``<unk>``."""
        ids, unk = self._ids, self.unk_id
        token_ids = [ids.get(token, unk) for token in self.tokenize(text)]
        return torch.tensor(token_ids, dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of `ids`: words joined by single spaces, a newline for each ``<eos>``.

        ``decode(encode(text)) == text`` when every word of `text` is in the vocabulary and
        its lines are single-space separated with no leading or trailing spaces; otherwise the
        result is that normal form (with ``<unk>`` for unknown words).

        Raises:
            ValueError: an id outside ``[0, len(self))``.
        """
        id_list = _as_id_list(ids, "WordVocab.decode")
        _check_range(id_list, len(self._tokens), "WordVocab.decode")
        lines: list[str] = []
        words: list[str] = []
        for i in id_list:
            if i == self.eos_id:
                lines.append(" ".join(words) + "\n")
                words = []
            else:
                words.append(self._tokens[i])
        return "".join(lines) + " ".join(words)

    @property
    def tokens(self) -> tuple[str, ...]:
        """All tokens, id order."""
        return self._tokens

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def id(self, token: str) -> int:
        """The id of `token`, or the ``<unk>`` id if it is not in the vocabulary."""
        return self._ids.get(token, self.unk_id)

    def token(self, token_id: int) -> str:
        """The token with id `token_id`."""
        _check_range([token_id], len(self._tokens), "WordVocab.token")
        return self._tokens[token_id]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordVocab) and self._tokens == other._tokens

    def __hash__(self) -> int:
        return hash(self._tokens)

    def __repr__(self) -> str:
        preview = ", ".join(repr(t) for t in self._tokens[:6])
        more = ", ..." if len(self._tokens) > 6 else ""
        return f"WordVocab({len(self._tokens)} tokens: {preview}{more})"
