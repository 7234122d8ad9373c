"""Randomness as a value: explicit keys folded with (step, micro-batch, layer, rank), and replay.

A key is a CPU int64 tensor of shape ``(2,)`` (so it lives in a TrainState pytree and is saved
with a checkpoint). Keys never advance hidden state: `fold_in` derives a new key from a key and
an integer, `split` derives several. `seed` turns a key into a torch seed, which is how a key
drives torch's own samplers (dropout) for the duration of one call (see `fscale.functionalize`).
Deriving keys by folding, not by drawing from a global generator, is what makes dropout masks
identical under any split of the batch, any number of ranks, and under rematerialisation.

The mixing function is SplitMix64's finaliser, a bijection on 64-bit integers with good
avalanche, applied to (key word, data); it is cheap, deterministic and identical on every
platform.

Code that runs a function twice (rematerialisation, offloaded stages recomputed in backward)
replays torch's own generators instead: `RngState.capture` records the CPU generator and the
CUDA generators of the devices involved before the first run, and `RngState.restored` sets them
back for the second, so the same dropout masks are drawn, then returns the generators to where
the caller left them (the replay does not advance the caller's random stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from fscale.readback import to_list

__all__ = ["RngState", "fold_in", "fold_in_all", "fold_in_seeds", "is_key", "key", "seed", "split"]

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def _words(k: torch.Tensor) -> tuple[int, int]:
    if not is_key(k):
        raise TypeError(
            "expected a key: an int64 tensor of shape (2,) made by `fscale.random.key(seed)`, "
            f"got {type(k).__name__}"
            + (
                f" of dtype {k.dtype} and shape {tuple(k.shape)}"
                if isinstance(k, torch.Tensor)
                else ""
            )
        )
    hi, lo = (int(v) & _MASK64 for v in to_list(k))
    return hi, lo


def _make(hi: int, lo: int) -> torch.Tensor:
    return torch.tensor([_to_signed(hi), _to_signed(lo)], dtype=torch.int64)


def is_key(value: object) -> bool:
    """Whether `value` is a key (an int64 tensor of shape (2,))."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.shape == (2,)


def key(seed_value: int) -> torch.Tensor:
    """A key from an integer seed."""
    if isinstance(seed_value, bool) or not isinstance(seed_value, int):
        raise TypeError(f"key: `seed_value` must be an int, got {type(seed_value).__name__}")
    s = seed_value & _MASK64
    return _make(_mix64(s), _mix64(s ^ 0xD1B54A32D192ED03))


def fold_in(k: torch.Tensor, data: int) -> torch.Tensor:
    """A new key derived from `k` and the integer `data` (a step, micro-batch, layer or rank)."""
    if isinstance(data, torch.Tensor):
        data = int(data.item())
    if isinstance(data, bool) or not isinstance(data, int):
        raise TypeError(f"fold_in: `data` must be an int, got {type(data).__name__}")
    return _make(*_fold_words(_words(k), data))


def fold_in_all(k: torch.Tensor, data: Iterable[int]) -> torch.Tensor:
    """``fold_in(fold_in(k, d0), d1) ...`` over `data`, in order, building one key tensor.

    A step's key is its state's key folded with the step count and then with the rank: one
    read of `k` and one new tensor instead of one per fold."""
    words = _words(k)
    for d in data:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"fold_in_all: `data` must hold ints, got {type(d).__name__}")
        words = _fold_words(words, d)
    return _make(*words)


def _fold_words(words: tuple[int, int], data: int) -> tuple[int, int]:
    hi, lo = words
    d = data & _MASK64
    new_hi = _mix64(hi ^ _mix64(d))
    return new_hi, _mix64(lo ^ _mix64(d ^ new_hi))


def split(k: torch.Tensor, num: int = 2) -> list[torch.Tensor]:
    """`num` independent keys derived from `k`."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"split: `num` must be a positive int, got {num!r}")
    return [fold_in(k, (1 << 62) + i) for i in range(num)]


def seed(k: torch.Tensor) -> int:
    """A non-negative 63-bit torch seed determined by `k` (for `torch.manual_seed`)."""
    hi, lo = _words(k)
    return _seed_of_words(hi, lo)


def fold_in_seeds(k: torch.Tensor, data: Iterable[int]) -> list[int]:
    """``[seed(fold_in(k, d)) for d in data]``, without building the keys.

    The seeds of many layers under one micro-batch's key, for a loop that reseeds torch's
    generator before each layer: building a key tensor per layer costs more than the mixing."""
    hi, lo = _words(k)
    seeds = []
    for d in data:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"fold_in_seeds: `data` must hold ints, got {type(d).__name__}")
        d &= _MASK64
        new_hi = _mix64(hi ^ _mix64(d))
        seeds.append(_seed_of_words(new_hi, _mix64(lo ^ _mix64(d ^ new_hi))))
    return seeds


def _seed_of_words(hi: int, lo: int) -> int:
    return _mix64(hi ^ ((lo << 1) & _MASK64)) & ((1 << 63) - 1)


class RngState:
    """The CPU generator's state and those of some CUDA generators, captured for a replay.

    Attributes:
        cpu: the CPU generator's state.
        cuda: per CUDA device, its generator's state.
    """

    __slots__ = ("cpu", "cuda")

    def __init__(self, cpu: torch.Tensor, cuda: dict[torch.device, torch.Tensor]) -> None:
        self.cpu = cpu
        self.cuda = cuda

    @classmethod
    def capture(cls, where: Iterable[torch.Tensor | torch.device | str] = ()) -> RngState:
        """The current states of the CPU generator and of the CUDA devices among `where`.

        Args:
            where: tensors and devices whose generators a replay must restore; the CUDA devices
                among them (a tensor stands for its device) are captured, others need nothing
                beyond the CPU generator, which is always captured.

        Returns:
            An `RngState`.

        Raises:
            TypeError: if an item of `where` is not a tensor, a torch.device or a device string.
        """
        devices: set[torch.device] = set()
        for item in where:
            if isinstance(item, torch.Tensor):
                device = item.device
            elif isinstance(item, (torch.device, str)):
                device = torch.device(item)
            else:
                raise TypeError(
                    "RngState.capture: `where` must hold tensors or devices, "
                    f"got a {type(item).__name__}"
                )
            if device.type == "cuda":
                devices.add(device)
        cuda = {d: torch.cuda.get_rng_state(d) for d in sorted(devices, key=str)}
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Inside the block the generators hold the captured states; on exit, the caller's."""
        # fork_rng puts the caller's generators back on exit; with no devices it forks the CPU.
        with torch.random.fork_rng(devices=list(self.cuda)):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda.items():
                torch.cuda.set_rng_state(state, device)
            yield

    def __repr__(self) -> str:
        return f"RngState(cpu, cuda={[str(d) for d in self.cuda]})"
