"""Shared helpers for the scripts in bench/: interleaved timing, robust statistics, memory, output.

A benchmark script uses it in four steps::

    import _util  # bench/ is sys.path[0] when a script in it runs

    times = _util.interleave({"eager": eager_step, "fscale": fscale_step}, rounds=30, warmup=3)
    stats = {name: _util.summarize(samples) for name, samples in times.items()}
    print(
        _util.format_table(
            ["variant", "median ms", "IQR ms"],
            [[n, s.median * 1e3, s.iqr * 1e3] for n, s in stats.items()],
        )
    )
    _util.write_results("step", {"rows": [...]})  # bench/results/step.json, with `environment()`

Why interleave: on a shared machine the load changes over seconds. Timing all rounds of one
variant and then all of the next lets a slow spell land on one variant only; running every
variant once per round (in an order that rotates, so none always goes first) exposes them all to
the same conditions. Medians and the interquartile range describe the result without being
dragged by the outliers a noisy machine produces, and `paired_ratios` compares two variants
round by round, which cancels most of the drift between rounds.

Memory: `peak_rss_bytes` is the process's high-water mark of resident memory (``VmHWM``), which
`reset_peak_rss` lowers to the current RSS, so the peak of one phase can be read on its own.
`MachineLoad` measures how busy the machine was with other processes while a benchmark ran.

Profiling: `profile_against` explains where variants spend time a reference does not (per
torch op and per Python function, medians over alternating profiled calls).

Workload: `gpt_config` and `lm_batch` give the GPT benchmarks one model shape and one stream of
batches, so their figures can be read side by side.
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import json
import math
import os
import platform
import pstats
import resource
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "MachineLoad",
    "Summary",
    "environment",
    "format_profile",
    "format_table",
    "gpt_config",
    "interleave",
    "keep_heap",
    "live_tensor_bytes",
    "lm_batch",
    "paired_ratios",
    "peak_rss_bytes",
    "profile_against",
    "quantile",
    "reset_peak_rss",
    "rss_bytes",
    "summarize",
    "write_results",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where `write_results` puts ``<name>.json`` by default."""


# --------------------------------------------------------------------------------------------
# Statistics


def quantile(values: Sequence[float], q: float) -> float:
    """The `q`-quantile of `values`, interpolating linearly between order statistics.

    The same definition as ``numpy.quantile``'s default ("linear"): position ``q * (n - 1)`` in
    the sorted values.

    Args:
        values: at least one number, in any order.
        q: the quantile, in [0, 1].

    Returns:
        The quantile as a float.

    Raises:
        ValueError: `values` is empty or `q` is outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: `q` must be in [0, 1], got {q!r}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("quantile: `values` is empty; time at least one round")
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


@dataclass(frozen=True)
class Summary:
    """Order statistics of a set of samples (seconds, ratios, bytes: any one unit).

    Attributes:
        median: the 0.5-quantile.
        q1: the 0.25-quantile.
        q3: the 0.75-quantile.
        minimum: the smallest sample.
        maximum: the largest sample.
        n: the number of samples.
    """

    median: float
    q1: float
    q3: float
    minimum: float
    maximum: float
    n: int

    @property
    def iqr(self) -> float:
        """The interquartile range ``q3 - q1``: the spread of the middle half of the samples."""
        return self.q3 - self.q1

    def scaled(self, factor: float) -> Summary:
        """The same statistics multiplied by a positive `factor` (e.g. 1e3 for s -> ms)."""
        if not factor > 0:
            raise ValueError(f"Summary.scaled: `factor` must be positive, got {factor!r}")
        return Summary(
            self.median * factor,
            self.q1 * factor,
            self.q3 * factor,
            self.minimum * factor,
            self.maximum * factor,
            self.n,
        )

    def as_dict(self) -> dict[str, float]:
        """A JSON-ready dict of the statistics, the IQR included."""
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "iqr": self.iqr,
            "min": self.minimum,
            "max": self.maximum,
            "n": self.n,
        }


def summarize(samples: Sequence[float]) -> Summary:
    """Median, quartiles, extremes and count of `samples`.

    Raises:
        ValueError: `samples` is empty.
    """
    values = [float(s) for s in samples]
    if not values:
        raise ValueError("summarize: `samples` is empty; time at least one round")
    return Summary(
        median=quantile(values, 0.5),
        q1=quantile(values, 0.25),
        q3=quantile(values, 0.75),
        minimum=min(values),
        maximum=max(values),
        n=len(values),
    )


@dataclass(frozen=True)
class MedianInterval:
    """A confidence interval for the median of the distribution some samples were drawn from.

    Attributes:
        low: the lower end, an order statistic of the samples.
        high: the upper end, an order statistic of the samples.
        coverage: the probability that such an interval holds the median (at least the
            confidence asked for, when the samples are enough to reach it).
    """

    low: float
    high: float
    coverage: float

    def verdict(self, goal: float) -> str:
        """``"met"`` when the whole interval is at or below `goal`, ``"missed"`` when it is all
        above, else ``"undecided"``: the samples cannot tell which side the median is on."""
        if self.high <= goal:
            return "met"
        if self.low > goal:
            return "missed"
        return "undecided"

    def verdict_at_least(self, goal: float) -> str:
        """As `verdict`, for a goal the median must reach or exceed (a speed-up)."""
        if self.low >= goal:
            return "met"
        if self.high < goal:
            return "missed"
        return "undecided"


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> MedianInterval:
    """The distribution-free interval for the median: order statistics chosen by the binomial.

    With the samples sorted, ``[x_k, x_(n+1-k)]`` (1-based) holds the median with probability
    ``1 - 2 P(B < k)`` for B ~ Binomial(n, 1/2), whatever the distribution, as long as the
    samples are independent draws from it. The largest k whose coverage is still at least
    `confidence` is taken; too few samples to reach it give the full range and its coverage.
    Independence is an assumption: interleaved rounds on a shared machine are close to it for
    paired ratios, which cancel the drift the rounds share.

    Raises:
        ValueError: no samples, or `confidence` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"median_interval: `confidence` must be in (0, 1), got {confidence!r}")
    ordered = sorted(float(v) for v in samples)
    n = len(ordered)
    if not n:
        raise ValueError("median_interval: `samples` is empty; time at least one round")
    below = 0.0  # P(B < k), for k = 1 first
    k, coverage = 1, 1.0 - 2.0 * 0.5**n
    for candidate in range(1, (n + 1) // 2 + 1):
        below += math.comb(n, candidate - 1) * 0.5**n  # now P(B < candidate)
        if 1.0 - 2.0 * below < confidence:
            break
        k, coverage = candidate, 1.0 - 2.0 * below
    return MedianInterval(ordered[k - 1], ordered[n - k], coverage)


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round ratios ``numerators[i] / denominators[i]`` of two interleaved variants.

    Both variants ran in the same round under the same load, so the ratio of a pair cancels
    most of the machine's drift; summarize the list for a ratio with its spread.

    Raises:
        ValueError: the sequences differ in length or are empty, or a denominator is not
            positive.
    """
    if len(numerators) != len(denominators):
        raise ValueError(
            f"paired_ratios: got {len(numerators)} numerators and {len(denominators)} "
            "denominators; pass the samples of two variants timed in the same rounds"
        )
    if not numerators:
        raise ValueError("paired_ratios: no samples; time at least one round")
    if any(not d > 0 for d in denominators):
        raise ValueError("paired_ratios: every denominator must be positive (a duration)")
    return [float(a) / float(b) for a, b in zip(numerators, denominators)]


# --------------------------------------------------------------------------------------------
# Timing


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """`names` rotated left by `round_index`: the order of round `round_index`, so that each
    name runs first, second, ... equally often."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def minor_faults() -> int:
    """This process's minor page faults so far: first touches of memory the allocator got
    fresh from the system."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleave(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int = 1,
    *,
    rotate: bool = True,
    before_each: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time every variant once per round, round after round; drop the warm-up rounds.

    Round ``r`` runs the variants in their given order rotated left by ``r`` (when `rotate`),
    so each variant is first, second, ... equally often. The order depends only on ``r``, so
    several processes calling this with the same variants (the ranks of a data-parallel
    benchmark) run the same variant at the same time.

    Args:
        variants: name -> a callable running one unit of work (one training step).
        rounds: timed rounds, at least 1.
        warmup: rounds run first and not recorded (caches, allocator, lazy initialisation).
        rotate: rotate the order each round (True) or keep the given order.
        before_each: called before each timed call, outside the timed interval (e.g.
            ``torch.distributed.barrier``, so that all ranks start a step together).
        clock: the time source, in seconds.

    Returns:
        name -> the `rounds` durations in seconds, in round order.

    Raises:
        ValueError: no variants, or `rounds` < 1 or `warmup` < 0.
    """
    if not variants:
        raise ValueError("interleave: `variants` is empty; pass name -> callable")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"interleave: `rounds` must be an int >= 1, got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"interleave: `warmup` must be an int >= 0, got {warmup!r}")
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        for name in rotation(names, round_index) if rotate else names:
            if before_each is not None:
                before_each()
            start = clock()
            variants[name]()
            elapsed = clock() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


# --------------------------------------------------------------------------------------------
# Memory


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    raise RuntimeError(
        f"cannot read {field} from /proc/self/status; resident-memory figures need Linux"
    )


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes (``VmHWM``), since start or the last reset.

    Raises:
        RuntimeError: not on Linux (no ``/proc/self/status``).
    """
    return _status_kib("VmHWM") * 1024


def rss_bytes() -> int:
    """This process's resident memory now, in bytes (``VmRSS``).

    Raises:
        RuntimeError: not on Linux (no ``/proc/self/status``).
    """
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Lower this process's peak-RSS mark to its current RSS; True if the kernel allowed it.

    Writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) resets ``VmHWM``, so the peak of
    one phase can be read after it. Memory the allocator kept from earlier phases still counts
    as resident, so compare against `rss_bytes` taken right after the reset.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# The machine


def live_tensor_bytes(device: str = "cpu") -> int:
    """Bytes of every storage that a live tensor on `device` views, each storage counted once.

    Found by walking the garbage collector's objects after a collection: what the process
    holds in tensors, whatever the allocator keeps besides (resident memory includes freed
    blocks that the heap retains).
    """
    import torch

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # some objects warn when their class is looked at
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if obj.device.type != device:
            continue
        try:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue  # a wrapper subclass (DTensor, whose local tensor counts itself) or a
            # tensor without valid storage of its own
    return sum(storages.values())


# mallopt's parameter numbers in glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap() -> bool:
    """Make glibc keep freed memory for reuse in this process; whether it could.

    By default glibc serves blocks above its mmap threshold with fresh mappings and gives the
    top of its heap back to the system when more than twice that is free; a training step that
    frees its activations then takes new zero-filled pages (page faults) for them in the next
    step, and how many depends on the order of the frees, not on the work. With the mmap
    threshold at glibc's maximum (32 MiB on 64-bit) and the trim threshold at 1 GiB, each process
    reuses its freed memory, as a caching allocator (CUDA's, jemalloc's) would. Call it first
    thing in each rank, before any tensor is made.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return bool(mapped) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user).
    counted = fields[:8]
    idle = counted[3] + (counted[4] if len(counted) > 4 else 0)
    return sum(counted) - idle, sum(counted)


def _own_cpu_seconds() -> float:
    """CPU seconds used by this process and by its children that have been waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class MachineLoad:
    """How busy the machine was while a block ran, and how much of that was this program.

    ``with MachineLoad() as load: ...`` then `as_dict` gives the load averages at both ends, the
    number of CPUs, the cores the whole machine kept busy on average during the block, the cores
    this process and its finished children used, and the difference: the cores *other*
    programs took. Child processes count as this program's only once they have exited and been
    waited for (as the ranks of ``fscale.launch`` are when it returns).
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, tuple[int, int] | None] | None = None
        self._result: dict[str, Any] | None = None
        self._loadavg_start: tuple[float, float, float] | None = None

    def __enter__(self) -> MachineLoad:
        self._loadavg_start = _loadavg()
        self._start = (time.monotonic(), _own_cpu_seconds(), _cpu_jiffies())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._start is None:
            raise RuntimeError("MachineLoad: the block was left without being entered")
        wall_start, own_start, jiffies_start = self._start
        wall = max(time.monotonic() - wall_start, 1e-9)
        own_cores = (_own_cpu_seconds() - own_start) / wall
        result: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "loadavg_start": self._loadavg_start,
            "loadavg_end": _loadavg(),
            "seconds": wall,
            "own_cores": own_cores,
            "busy_cores": None,
            "other_cores": None,
        }
        jiffies_end = _cpu_jiffies()
        if jiffies_start is not None and jiffies_end is not None:
            ticks_per_second = os.sysconf("SC_CLK_TCK")
            busy_cores = (jiffies_end[0] - jiffies_start[0]) / ticks_per_second / wall
            result["busy_cores"] = busy_cores
            result["other_cores"] = max(0.0, busy_cores - own_cores)
        self._result = result

    def as_dict(self) -> dict[str, Any]:
        """The measurements (see the class docstring); ``None`` where /proc/stat is missing.

        Raises:
            RuntimeError: the block has not finished yet.
        """
        if self._result is None:
            raise RuntimeError("MachineLoad.as_dict: use it after the `with` block has ended")
        return dict(self._result)

    def describe(self) -> str:
        """One line for a report, e.g. ``load 4.1 -> 5.3 on 2 CPUs; others used 1.2 cores``."""
        result = self.as_dict()
        text = (
            f"load average {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f} "
            f"on {result['cpus']} CPUs"
        )
        if result["other_cores"] is not None:
            text += (
                f"; during the run other processes used {result['other_cores']:.2f} cores, "
                f"this one {result['own_cores']:.2f}"
            )
        return text


def _loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # not available on this platform
        return (math.nan, math.nan, math.nan)


def environment() -> dict[str, Any]:
    """What a result depends on besides the code: versions, threads, CPUs, load, time."""
    import torch  # here, so the statistics above stay usable without torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "loadavg": _loadavg(),
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------------------------
# Workload


def gpt_config(quick: bool = False) -> Any:
    """The `fscale.models.GPTConfig` the GPT benchmarks train.

    Full: vocabulary 8192, ``d_model`` 256, 4 heads, 4 layers, 128 positions (about 5.3M
    parameters, the embedding tied to the output layer). Quick: vocabulary 2048, ``d_model``
    128, 4 heads, 2 layers, 64 positions. Dropout is 0 so that runs compare bit for bit.
    """
    from fscale.models import GPTConfig

    if quick:
        return GPTConfig(vocab_size=2048, seq_len=64, d_model=128, n_heads=4, n_layers=2)
    return GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_heads=4, n_layers=4)


def lm_batch(cfg: Any, batch_size: int, index: int, *, seed: int = 0) -> Any:
    """Batch number `index` of a reproducible stream of uniform random tokens for `cfg`.

    Args:
        cfg: a `fscale.models.GPTConfig` (its ``vocab_size`` and ``seq_len`` are used).
        batch_size: sequences in the batch.
        index: the batch's position in the stream; the same index always gives the same batch.
        seed: selects the stream.

    Returns:
        An `fscale.data.LMBatch` of batch-major ``[batch_size, seq_len]`` int64 tensors, the
        targets being the inputs shifted by one position.
    """
    import torch

    from fscale import random as fsrandom
    from fscale.data import LMBatch

    batch_key = fsrandom.fold_in(fsrandom.key(seed), index)
    generator = torch.Generator().manual_seed(fsrandom.seed(batch_key))
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=generator)
    return LMBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# --------------------------------------------------------------------------------------------
# Profiling against a reference


def _op_times(fn: Callable[[], Any]) -> dict[str, tuple[int, float]]:
    """Per torch op: (calls, self CPU µs) of one call of `fn` under torch.profiler."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key: (event.count, event.self_cpu_time_total) for event in prof.key_averages()}


def _python_times(fn: Callable[[], Any]) -> dict[str, tuple[int, float]]:
    """Per Python function: (calls, own µs) of one call of `fn` under cProfile.

    Built-ins (torch ops, the autograd engine) are left out, their time is in `_op_times`;
    what remains is the interpreter's own overhead (module calls, hooks, pytree handling,
    checks) plus the freeing of tensors whose last reference a function drops.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, own, cumulative, _)
    return {
        f"{_short_path(file)}:{line}({name})": (calls, own * 1e6)
        for (file, line, name), (_, calls, own, _, _) in stats.items()
        if file != "~"  # cProfile's file name for built-in functions
    }


def _short_path(file: str) -> str:
    """A file name relative to site-packages or to the repository, for a readable table."""
    if "/site-packages/" in file:
        return file.split("/site-packages/", 1)[1]
    for folder in ("fscale", "bench"):
        if f"/{folder}/" in file:
            return folder + "/" + file.rsplit(f"/{folder}/", 1)[1]
    return file


def _median_table(tables: list[dict[str, tuple[int, float]]]) -> dict[str, tuple[float, float]]:
    """Per key, the median over calls of (count, µs); a key missing from a call counts as 0."""
    keys = set().union(*tables)
    return {
        key: (
            quantile([t.get(key, (0, 0.0))[0] for t in tables], 0.5),
            quantile([t.get(key, (0, 0.0))[1] for t in tables], 0.5),
        )
        for key in keys
    }


def _most_extra(
    ours: dict[str, tuple[float, float]], reference: dict[str, tuple[float, float]], top: int
) -> list[dict[str, Any]]:
    rows = []
    for key in set(ours) | set(reference):
        calls, us = ours.get(key, (0.0, 0.0))
        reference_calls, reference_us = reference.get(key, (0.0, 0.0))
        rows.append(
            {
                "name": key,
                "calls": calls,
                "reference_calls": reference_calls,
                "us": us,
                "reference_us": reference_us,
                "extra_us": us - reference_us,
            }
        )
    rows.sort(key=lambda row: row["extra_us"], reverse=True)
    return rows[:top]


def profile_against(
    variants: Mapping[str, Callable[[], Any]],
    reference: str,
    names: Sequence[str],
    rounds: int,
    *,
    top: int = 12,
    record: bool = True,
    before_each: Callable[[], Any] | None = None,
) -> dict[str, Any] | None:
    """Where the variants `names` spend time that the `reference` variant does not.

    Each round profiles one call of the reference and of each named variant under
    torch.profiler (self CPU time per op), then one call of each under cProfile (own time per
    Python function); per-op and per-function medians over the rounds are compared. Profiling
    one call at a time in alternation exposes all variants to the same load, as `interleave`
    does. Profilers slow the code down, so compare the variants with each other, not with the
    timings of `interleave`.

    Args:
        variants: name -> a callable running one step (as for `interleave`).
        reference: the name of the variant to compare against.
        names: the variants to explain.
        rounds: calls of each variant under each profiler.
        top: rows kept per table.
        record: False runs exactly the same calls without profiling and returns None (the
            other ranks of a multi-process benchmark, which must take part in every step).
        before_each: called before each call, outside the profile (e.g. a barrier).

    Returns:
        ``{"rounds", "reference", reference: totals, name: totals and tables, ...}`` where the
        totals are ``op_us`` (median over rounds of the summed self CPU time of all ops) and
        ``python_us`` (the same for Python functions), and each name also has
        ``ops_with_most_extra_time`` and ``python_with_most_extra_time``: rows of ``name,
        calls, reference_calls, us, reference_us, extra_us``, most extra time first. None when
        `record` is False.

    Raises:
        ValueError: `reference` or a name is not a variant, or `rounds` < 1.
    """
    unknown = [name for name in [reference, *names] if name not in variants]
    if unknown:
        raise ValueError(f"profile_against: no variants named {unknown}; have {list(variants)}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"profile_against: `rounds` must be an int >= 1, got {rounds!r}")
    profiled = [reference, *names]
    op_tables: dict[str, list[dict[str, tuple[int, float]]]] = {name: [] for name in profiled}
    python_tables: dict[str, list[dict[str, tuple[int, float]]]] = {name: [] for name in profiled}
    for _ in range(rounds):
        for profiler, tables in ((_op_times, op_tables), (_python_times, python_tables)):
            for name in profiled:
                if before_each is not None:
                    before_each()
                if record:
                    tables[name].append(profiler(variants[name]))
                else:
                    variants[name]()
    if not record:
        return None

    def total(tables: list[dict[str, tuple[int, float]]]) -> float:
        return quantile([sum(us for _, us in table.values()) for table in tables], 0.5)

    ops = {name: _median_table(tables) for name, tables in op_tables.items()}
    python = {name: _median_table(tables) for name, tables in python_tables.items()}
    report: dict[str, Any] = {
        "rounds": rounds,
        "reference": reference,
        reference: {
            "op_us": total(op_tables[reference]),
            "python_us": total(python_tables[reference]),
        },
    }
    for name in names:
        report[name] = {
            "op_us": total(op_tables[name]),
            "python_us": total(python_tables[name]),
            "ops_with_most_extra_time": _most_extra(ops[name], ops[reference], top),
            "python_with_most_extra_time": _most_extra(python[name], python[reference], top),
        }
    return report


def format_profile(report: Mapping[str, Any]) -> str:
    """The tables of a `profile_against` report, as text."""
    reference = report["reference"]
    totals = report[reference]
    sections = []
    for name, entry in report.items():
        if name in ("rounds", "reference", reference):
            continue
        sections.append(
            f"profile of {name!r} against {reference!r}, medians of {report['rounds']} "
            f"alternating calls: torch ops {entry['op_us'] / 1e3:.2f} ms/step ("
            f"{reference}: {totals['op_us'] / 1e3:.2f}); Python own time "
            f"{entry['python_us'] / 1e3:.2f} ms/step under cProfile ({reference}: "
            f"{totals['python_us'] / 1e3:.2f})"
        )
        for title, key in (
            ("torch ops, self CPU time (torch.profiler)", "ops_with_most_extra_time"),
            ("Python functions, own time (cProfile)", "python_with_most_extra_time"),
        ):
            table = format_table(
                ["name", "calls", f"{reference} calls", "ms", f"{reference} ms", "extra ms"],
                [
                    [
                        row["name"],
                        row["calls"],
                        row["reference_calls"],
                        row["us"] / 1e3,
                        row["reference_us"] / 1e3,
                        row["extra_us"] / 1e3,
                    ]
                    for row in entry[key]
                ],
            )
            sections.append(f"{title}, most extra time first:\n{table}")
    return "\n\n".join(sections)


# --------------------------------------------------------------------------------------------
# Output


def _cell(value: Any, float_format: str) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        return float_format.format(value)
    return str(value)


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[Any]], *, float_format: str = "{:.3f}"
) -> str:
    """A plain-text table: columns padded to their widest cell, a rule under the header.

    Floats are formatted with `float_format`, booleans as yes/no, None as "-", anything else
    with ``str``. A column whose cells are all numbers (int or float) is right-aligned, others
    are left-aligned.

    Args:
        header: the column titles.
        rows: one sequence of cells per row, each as long as `header`.
        float_format: a ``str.format`` pattern for float cells.

    Returns:
        The table, lines joined by newlines, without a trailing newline.

    Raises:
        ValueError: a row has a different number of cells than `header`.
    """
    for index, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(
                f"format_table: row {index} has {len(row)} cells but the header has "
                f"{len(header)} columns"
            )
    numeric = [
        bool(rows)
        and all(
            isinstance(row[column], (int, float)) and not isinstance(row[column], bool)
            for row in rows
        )
        for column in range(len(header))
    ]
    cells = [list(header)] + [[_cell(v, float_format) for v in row] for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(len(header))]

    def render(line: list[str]) -> str:
        padded = (
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(line, widths, numeric)
        )
        return "  ".join(padded).rstrip()

    lines = [render(cells[0]), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines.extend(render(line) for line in cells[1:])
    return "\n".join(lines)


def write_results(
    name: str, payload: Mapping[str, Any], *, directory: Path | str = RESULTS_DIR
) -> Path:
    """Write `payload` plus ``"environment": environment()`` to ``<directory>/<name>.json``.

    Args:
        name: the benchmark's name, used as the file name (letters, digits, ``-``, ``_``).
        payload: JSON-serialisable results; an ``"environment"`` key of its own is kept.
        directory: where to write (created if needed); `RESULTS_DIR` by default.

    Returns:
        The path written.

    Raises:
        ValueError: `name` is empty or contains other characters.
    """
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(
            f"write_results: `name` must be letters, digits, '-' or '_' (it becomes the file "
            f"name), got {name!r}"
        )
    document = {"environment": environment(), **payload}
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Summary):
        return value.as_dict()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"write_results: cannot store a {type(value).__name__} in JSON")
