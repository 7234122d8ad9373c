"""bench/_util.py: statistics, interleaved timing, tables, result files, memory and profiling."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import mmap
import random
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

_PATH = Path(__file__).resolve().parents[1] / "bench" / "_util.py"
_spec = importlib.util.spec_from_file_location("bench_util", _PATH)
util = importlib.util.module_from_spec(_spec)
sys.modules["bench_util"] = util  # dataclasses resolve their module by name
_spec.loader.exec_module(util)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


# ---------------------------------------------------------------------------------- statistics


@given(values=st.lists(finite, min_size=1, max_size=30), q=st.floats(0.0, 1.0))
def test_quantile_equals_the_linear_quantile(values, q):
    # torch.quantile's default "linear" interpolation is numpy's default definition.
    expected = float(torch.tensor(values, dtype=torch.float64).quantile(q))
    assert util.quantile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-9)


def test_quantile_interpolates_between_order_statistics():
    assert util.quantile([4.0, 1.0, 3.0, 2.0], 0.25) == 1.75
    assert util.quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert util.quantile([7.0], 0.9) == 7.0
    assert util.quantile([1, 2, 3], 1.0) == 3.0


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="`values` is empty"):
        util.quantile([], 0.5)
    with pytest.raises(ValueError, match=r"`q` must be in \[0, 1\], got 1.5"):
        util.quantile([1.0], 1.5)


def test_summarize_gives_quartiles_extremes_and_count():
    summary = util.summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (summary.median, summary.q1, summary.q3) == (3.0, 2.0, 4.0)
    assert (summary.minimum, summary.maximum, summary.n) == (1.0, 5.0, 5)
    assert summary.iqr == 2.0
    assert summary.as_dict() == {
        "median": 3.0,
        "q1": 2.0,
        "q3": 4.0,
        "iqr": 2.0,
        "min": 1.0,
        "max": 5.0,
        "n": 5,
    }
    with pytest.raises(ValueError, match="`samples` is empty"):
        util.summarize([])


def test_summary_scaled_multiplies_every_statistic_but_the_count():
    scaled = util.summarize([0.001, 0.002, 0.004]).scaled(1e3)
    assert scaled.as_dict() == pytest.approx(
        {"median": 2.0, "q1": 1.5, "q3": 3.0, "iqr": 1.5, "min": 1.0, "max": 4.0, "n": 3}
    )
    with pytest.raises(ValueError, match="`factor` must be positive"):
        scaled.scaled(0.0)


def test_paired_ratios_divide_round_by_round():
    assert util.paired_ratios([2.0, 3.0, 1.0], [1.0, 2.0, 4.0]) == [2.0, 1.5, 0.25]
    with pytest.raises(ValueError, match="2 numerators and 1 denominators"):
        util.paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no samples"):
        util.paired_ratios([], [])
    with pytest.raises(ValueError, match="denominator must be positive"):
        util.paired_ratios([1.0], [0.0])


def test_median_interval_takes_the_binomial_order_statistics():
    # The textbook 95% interval for 20 samples is the 6th to the 15th of them.
    samples = [float(v) for v in reversed(range(1, 21))]
    interval = util.median_interval(samples)
    below = sum(math.comb(20, i) for i in range(6)) / 2**20
    assert (interval.low, interval.high) == (6.0, 15.0)
    assert interval.coverage == pytest.approx(1 - 2 * below) and interval.coverage >= 0.95
    # 12 samples: the 3rd to the 10th; a looser confidence narrows it.
    twelve = util.median_interval(list(range(12)))
    assert (twelve.low, twelve.high) == (2.0, 9.0)
    assert (
        util.median_interval(list(range(12)), 0.5).high
        - util.median_interval(list(range(12)), 0.5).low
        < twelve.high - twelve.low
    )
    # Too few samples for the confidence: the whole range, with the coverage it does have.
    few = util.median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (few.low, few.high, few.coverage) == (1.0, 5.0, 1 - 2 / 32)


def test_median_interval_holds_the_median_as_often_as_it_says():
    rng = random.Random(0)
    n, trials = 12, 3000
    expected = util.median_interval(range(n)).coverage  # 0.961
    hits = 0
    for _ in range(trials):
        interval = util.median_interval([rng.expovariate(1.0) for _ in range(n)])
        hits += interval.low <= math.log(2) <= interval.high  # the exponential's median
    assert abs(hits / trials - expected) < 0.015


def test_median_interval_verdicts_and_bad_input():
    interval = util.MedianInterval(0.97, 1.02, 0.95)
    assert [interval.verdict(goal) for goal in (1.02, 1.00, 0.96)] == [
        "met",
        "undecided",
        "missed",
    ]
    assert [interval.verdict_at_least(goal) for goal in (0.97, 1.00, 1.03)] == [
        "met",
        "undecided",
        "missed",
    ]
    with pytest.raises(ValueError, match="`samples` is empty"):
        util.median_interval([])
    with pytest.raises(ValueError, match=r"`confidence` must be in \(0, 1\)"):
        util.median_interval([1.0], 1.0)


# ---------------------------------------------------------------------------------- timing


class FakeClock:
    """A clock that only moves when a variant (or the barrier) says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_interleave_times_each_variant_per_round_and_drops_warmup():
    clock = FakeClock()
    calls: list[str] = []
    counters = {"a": itertools.count(), "b": itertools.count()}

    def variant(name: str, base: float):
        def run() -> None:
            calls.append(name)
            clock.advance(base + next(counters[name]))  # the i-th call takes base + i seconds

        return run

    times = util.interleave(
        {"a": variant("a", 10.0), "b": variant("b", 100.0)},
        rounds=3,
        warmup=2,
        before_each=lambda: clock.advance(1000.0),  # outside the timed interval
        clock=clock,
    )
    assert times == {"a": [12.0, 13.0, 14.0], "b": [102.0, 103.0, 104.0]}
    # The order rotates each round: a first in even rounds, b first in odd ones.
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]


def test_rotation_puts_each_name_first_once_per_cycle():
    names = ["a", "b", "c"]
    orders = [util.rotation(names, r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert names == ["a", "b", "c"]  # not modified


def test_minor_faults_count_the_first_touch_of_fresh_memory():
    size = 16 << 20
    with mmap.mmap(-1, size) as fresh:  # a new mapping, whatever malloc keeps
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            fresh.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages, one fault each
        before = util.minor_faults()
        for offset in range(0, size, 4096):
            fresh[offset] = 1  # first touch of each page
        grown = util.minor_faults() - before
    assert grown >= size // 4096 // 2  # at least half its pages faulted in


def test_interleave_keeps_the_order_without_rotation():
    calls: list[str] = []
    util.interleave(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        rounds=2,
        warmup=0,
        rotate=False,
    )
    assert calls == ["a", "b", "a", "b"]


def test_interleave_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`variants` is empty"):
        util.interleave({}, rounds=1)
    with pytest.raises(ValueError, match="`rounds` must be an int >= 1, got 0"):
        util.interleave({"a": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="`warmup` must be an int >= 0, got -1"):
        util.interleave({"a": lambda: None}, rounds=1, warmup=-1)


# ---------------------------------------------------------------------------------- output


def test_format_table_aligns_numbers_right_and_text_left():
    table = util.format_table(
        ["variant", "ms", "ok", "extra"],
        [["eager", 1.5, True, None], ["fscale long", 12.25, False, 3]],
        float_format="{:.2f}",
    )
    assert table == (
        "variant         ms  ok   extra\n"
        "------------------------------\n"
        "eager         1.50  yes  -\n"
        "fscale long  12.25  no   3"
    )


def test_format_table_of_no_rows_is_the_header():
    assert util.format_table(["a", "bb"], []) == "a  bb\n-----"


def test_format_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="row 1 has 1 cells but the header has 2 columns"):
        util.format_table(["a", "b"], [[1, 2], [3]])


def test_write_results_adds_the_environment(tmp_path):
    summary = util.summarize([1.0, 2.0, 3.0])
    path = util.write_results("demo-1", {"rows": [{"s": summary}]}, directory=tmp_path)
    assert path == tmp_path / "demo-1.json"
    document = json.loads(path.read_text())
    assert document["rows"] == [{"s": summary.as_dict()}]
    assert document["environment"]["torch"] == torch.__version__
    assert document["environment"]["threads"] == torch.get_num_threads()


def test_write_results_rejects_a_name_that_is_not_a_file_name(tmp_path):
    with pytest.raises(ValueError, match="`name` must be letters, digits"):
        util.write_results("../escape", {}, directory=tmp_path)
    with pytest.raises(TypeError, match="cannot store a object"):
        util.write_results("bad", {"x": object()}, directory=tmp_path)


# ---------------------------------------------------------------------------------- machine


linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")


@linux_only
def test_peak_rss_follows_an_allocation_and_resets():
    if not util.reset_peak_rss():
        pytest.skip("the kernel does not allow resetting the peak RSS")
    before = util.rss_bytes()
    assert 0 < before <= util.peak_rss_bytes()
    block = torch.ones(16 * 2**20, dtype=torch.uint8)  # 16 MiB, every page touched
    assert util.peak_rss_bytes() >= before + 15 * 2**20
    del block
    assert util.reset_peak_rss()
    assert util.peak_rss_bytes() <= util.rss_bytes() + 2**20


@linux_only
def test_machine_load_reports_this_process_and_the_others():
    load = util.MachineLoad()
    with pytest.raises(RuntimeError, match="after the `with` block"):
        load.as_dict()
    with load:
        # 50 ms of CPU time of our own: os.times counts in clock ticks (10 ms), so a shorter
        # burst on a busy machine can read as none.
        start = time.process_time()
        while time.process_time() - start < 0.05:
            sum(i * i for i in range(10_000))
    result = load.as_dict()
    assert result["own_cores"] > 0
    assert result["other_cores"] >= 0
    assert result["cpus"] >= 1 and result["seconds"] > 0
    assert "CPUs" in load.describe()


def test_environment_names_versions_and_threads():
    env = util.environment()
    assert env["torch"] == torch.__version__
    assert env["threads"] == torch.get_num_threads()
    assert len(env["loadavg"]) == 3


# ---------------------------------------------------------------------------------- workload


def test_lm_batch_is_reproducible_and_shifted():
    cfg = util.gpt_config(quick=True)
    batch = util.lm_batch(cfg, 3, index=5)
    assert batch.inputs.shape == batch.targets.shape == (3, cfg.seq_len)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert torch.equal(util.lm_batch(cfg, 3, index=5).inputs, batch.inputs)
    assert not torch.equal(util.lm_batch(cfg, 3, index=6).inputs, batch.inputs)
    assert int(batch.inputs.max()) < cfg.vocab_size
    full = util.gpt_config()
    assert (full.vocab_size, full.d_model, full.n_layers, full.seq_len) == (8192, 256, 4, 128)


# ---------------------------------------------------------------------------------- profiling


def test_profile_against_names_the_extra_op():
    x = torch.ones(64, 64)
    calls = {"plain": 0, "more": 0}

    def plain() -> None:
        calls["plain"] += 1
        torch.add(x, x)

    def more() -> None:
        calls["more"] += 1
        torch.mul(torch.add(x, x), x)

    variants = {"plain": plain, "more": more}
    report = util.profile_against(variants, "plain", ["more"], rounds=2)
    extra = {row["name"]: row for row in report["more"]["ops_with_most_extra_time"]}
    assert extra["aten::mul"]["calls"] == 1 and extra["aten::mul"]["reference_calls"] == 0
    assert calls == {"plain": 4, "more": 4}  # two profilers x two rounds
    assert "profile of 'more' against 'plain'" in util.format_profile(report)

    assert util.profile_against(variants, "plain", ["more"], rounds=2, record=False) is None
    assert calls == {"plain": 8, "more": 8}  # the same calls, unprofiled
    with pytest.raises(ValueError, match=r"no variants named \['missing'\]"):
        util.profile_against(variants, "plain", ["missing"], rounds=1)


_KEEP_HEAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bench_util", sys.argv[1])
util = importlib.util.module_from_spec(spec)
sys.modules["bench_util"] = util
spec.loader.exec_module(util)

def kept_after_free(size):
    block = bytearray(size)  # zero-filled: every page touched
    held = util.rss_bytes()
    del block
    return (util.rss_bytes() - held + size) / size  # 1.0: all of it is still resident

before = kept_after_free(8 << 20)  # glibc's default: a fresh mapping, unmapped when freed
ok = util.keep_heap()
after = kept_after_free(16 << 20)  # from the heap, which keeps it
print(before, ok, after)
"""


def test_keep_heap_keeps_freed_memory_resident():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt: Linux only")
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _KEEP_HEAP, str(_PATH)], capture_output=True, text=True, check=True
    )
    before, ok, after = out.stdout.split()
    assert float(before) < 0.2 and ok == "True" and float(after) > 0.8, out.stdout


def test_live_tensor_bytes_counts_each_storage_once():
    before = util.live_tensor_bytes()
    block = torch.zeros(1 << 20)  # 4 MiB
    views = [block[:10], block.view(1024, 1024)]  # no storage of their own
    assert util.live_tensor_bytes() - before == 4 << 20
    del block, views
    # Earlier tests' small tensors may be freed meanwhile (in any order of the suite): what
    # matters is that the block's storage is no longer counted.
    assert abs(util.live_tensor_bytes() - before) < 1 << 20


def test_strategies_compare_gives_the_interval_verdict(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    strategies = importlib.import_module("strategies")
    rounds = 20
    peer = [1.0] * rounds
    per_round = {
        "torch DDP": peer,
        "fscale DDP": [0.97 + 0.001 * i for i in range(rounds)],  # all below 1.00x
        "fscale ZeRO-2": [0.945 + 0.01 * i for i in range(rounds)],  # straddles 1.00x
        "torch FSDP2": peer,
        "fscale ZeRO-3": [1.01] * rounds,  # all above 0.95x
    }
    rows = {row["strategy"]: row for row in strategies.compare(per_round)}
    assert [rows[s]["verdict"] for s in ("DDP", "ZeRO-2", "ZeRO-3")] == [
        "met",
        "undecided",
        "missed",
    ]
    interval = rows["ZeRO-2"]["paired_interval"]
    assert (interval["low"], interval["high"]) == pytest.approx((0.995, 1.085))
    assert "remat" not in rows  # neither of its variants was timed


def test_pipeline_goals_name_cells_whose_ceiling_is_below_the_goal(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    pipeline = importlib.import_module("pipeline")

    def row(ranks, schedule, torch_over_floor, torch_over_chain=None):
        return {
            "ranks": ranks,
            "micro_batches": 8,
            "schedule": schedule,
            "torch_over_floor": torch_over_floor,
            "torch_over_chain": torch_over_chain,
            "activation_peak_mib": [1.0],
            "measured_bubble": 0.1,
        }

    text = pipeline._goals(
        [
            row(2, "1f1b", 1.30, 1.05),  # torch within 1.1x of the chain: out of reach
            row(2, "gpipe", 1.30, 1.20),  # room above the goal
            row(2, "interleaved", 1.05),  # no chain: the floor decides
            row(4, "1f1b", 1.02, 1.01),  # 4 ranks on 2 cores: neither bounds
            row(2, "zero_bubble", 1.01),  # torch runs another table
        ]
    )
    ceilings = [line for line in text.splitlines() if "no runtime" in line]
    chain_line = (
        "P=2 M=8 1f1b: torch took 1.050x the chain of fscale's actions that runs in turn, so no "
        "runtime with fscale's action costs reaches 1.1x torch here"
    )
    floor_line = (
        "P=2 M=8 interleaved: torch took 1.050x fscale's floor, so no runtime with fscale's "
        "action costs reaches 1.1x torch here"
    )
    assert ceilings == [chain_line, floor_line]


def test_pipeline_chain_is_the_first_forward_the_last_stage_and_the_last_backward(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    pipeline = importlib.import_module("pipeline")

    def measured(first, busy, last, after=(0.0, 0.0, 0.0)):
        return {
            "measured": {
                "step_first_s": first,
                "step_busy_s": busy,
                "step_last_s": last,
                "step_after_send_s": list(after),
            }
        }

    results = [
        measured([1.0, 2.0, 1.0], [50.0, 50.0, 50.0], [3.0, 3.0, 9.0]),  # the first stage
        measured([0.0, 0.0, 0.0], [10.0, 20.0, 30.0], [0.0, 0.0, 0.0]),  # the last stage
    ]
    # Per step: 1 + 10 + 3, 2 + 20 + 3, 1 + 30 + 9; the median of 14, 25 and 40.
    assert pipeline._chain("1f1b", results) == 25.0
    assert pipeline._chain("gpipe", results) == 25.0
    assert pipeline._chain("interleaved", results) is None
    assert pipeline._chain("zero_bubble", results) is None
    # The weight gradients the last stage computes after its last send are off the chain:
    # 14 - 2, 25 - 6, 40 - 1; the median of 12, 19 and 39.
    results[1] = measured([0.0] * 3, [10.0, 20.0, 30.0], [0.0] * 3, after=(2.0, 6.0, 1.0))
    assert pipeline._chain("1f1b", results) == 19.0


def test_pipeline_after_send_is_what_a_backward_computed_after_its_early_send(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    pipeline = importlib.import_module("pipeline")
    from fscale.parallel.pipeline import ActionTime

    early = ActionTime("B", 3, 1, start=10.0, end=19.0, waited=1.0, sent=5.0)
    assert pipeline._after_send(early) == 3.0  # busy 8, of which 5 before the send
    assert pipeline._after_send(ActionTime("B", 3, 1, 10.0, 19.0, 1.0)) == 0.0


def test_pipeline_verdict_over_launches_is_decided_on_the_launches_medians(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    pipeline = importlib.import_module("pipeline")

    def launch(median, low, high, fscale_s):
        return {
            "paired_median": median,
            "throughput_interval": {"low": low, "high": high, "coverage": 0.95},
            "throughput_verdict": "met" if low >= 1.1 else "missed" if high < 1.1 else "undecided",
            "throughput_ratio": median,
            "fscale_s": fscale_s,
            "torch_s": fscale_s * median,
            "floor_s": fscale_s / 2,
            "activation_peak_mib": [round((fscale_s - 0.1) * 100)],
        }

    # Each launch alone looks decided, but they disagree: over the launches it is undecided.
    medians = [1.01, 1.12, 1.05, 1.11, 1.07, 1.03]
    rows = [launch(m, m - 0.01, m + 0.01, 0.1 + i / 100) for i, m in enumerate(medians)]
    row = pipeline._over_launches(rows)
    assert row["throughput_verdict"] == "undecided"
    assert row["throughput_interval"]["low"] == 1.01  # six launches: min and max, 96.9%
    assert row["throughput_interval"]["high"] == 1.12
    assert row["throughput_interval"]["coverage"] == pytest.approx(1 - 2 * 0.5**6)
    assert row["throughput_ratio"] == pytest.approx(1.06)  # the median of the six
    assert row["fscale_s"] == pytest.approx(0.125)  # the median over the launches
    assert row["floor_s"] == pytest.approx(0.0625)
    assert row["activation_peak_mib"] == [2]  # the lists: the lower middle launch's (1.05)
    assert [summary["paired_median"] for summary in row["launches"]] == medians
    # Every launch above the goal: met; one launch is its own row.
    high = pipeline._over_launches([launch(m + 0.1, m + 0.09, m + 0.11, 0.1) for m in medians])
    assert high["throughput_verdict"] == "met"
    assert pipeline._over_launches(rows[:1]) is rows[0]
    # Five launches all above the goal cover the median with 93.75% only: undecided.
    five = pipeline._over_launches([launch(m + 0.1, m + 0.09, m + 0.11, 0.1) for m in medians[:5]])
    assert five["throughput_interval"]["coverage"] == pytest.approx(0.9375)
    assert five["throughput_verdict"] == "undecided"
    # A schedule torch did not run has no verdict to decide.
    none = {**rows[0], "throughput_interval": None, "throughput_verdict": None}
    assert pipeline._over_launches([none, none])["throughput_verdict"] is None


def test_pipeline_bubble_goal_is_decided_on_round_by_round_differences(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent))
    pipeline = importlib.import_module("pipeline")
    zero = [0.10 + i / 1000 for i in range(12)]

    def paired(shift):
        one = [z + s for z, s in zip(zero, shift)]
        # Two ranks; per round the slower one's times: zero-bubble 0.09 s, 1F1B 0.1 s.
        times = {"zero_bubble s": [0.09] * 12, "1f1b s": [0.1] * 12}
        faster = {"zero_bubble s": [0.05] * 12, "1f1b s": [0.05] * 12}
        return pipeline._paired_bubble(
            [
                {"zero_bubble": zero, "1f1b": one, **times},
                {"zero_bubble": zero, "1f1b": one, **faster},
            ]
        )

    below = paired([0.02] * 12)  # 1F1B's bubble above zero-bubble's in every round
    assert below["difference"] == pytest.approx(-0.02)
    assert below["zero_bubble"] == pytest.approx(0.1055) and below["1f1b"] == pytest.approx(0.1255)
    assert below["verdict"] == "met"
    assert paired([-0.01] * 12)["verdict"] == "missed"
    assert paired([0.02, -0.02] * 6)["verdict"] == "undecided"
    assert below["step_ratio"] == pytest.approx(0.9)
    assert pipeline._paired_bubble([None, None]) is None
    # Over launches: decided on the launches' medians of the differences, at 95%.
    launches = [{"paired_bubble": paired([0.01 * (k + 1)] * 12)} for k in range(6)]
    over = pipeline._paired_bubble_over_launches(launches)
    assert over["verdict"] == "met" and over["difference"] == pytest.approx(-0.035)
    assert over["step_ratio"] == pytest.approx(0.9)
    assert pipeline._paired_bubble_over_launches(launches[:5])["verdict"] == "undecided"
    launches[0] = {"paired_bubble": paired([-0.01] * 12)}
    assert pipeline._paired_bubble_over_launches(launches)["verdict"] == "undecided"
    assert pipeline._paired_bubble_over_launches([{"paired_bubble": None}]) is None
    # The goal line reads the paired figures, not the two rows' separate bubbles.
    row = {"ranks": 2, "micro_batches": 4, "activation_peak_mib": [1.0], "measured_bubble": 0.3}
    text = pipeline._goals(
        [
            {**row, "schedule": "1f1b", "torch_over_floor": 1.3, "torch_over_chain": 1.3},
            {
                **row,
                "schedule": "zero_bubble",
                "torch_over_floor": 1.3,
                "torch_over_chain": None,
                "paired_bubble": below,
            },
        ]
    )
    assert "zero-bubble measured bubble 0.106 vs 1F1B 0.126" in text
    assert "difference -0.020 (-0.020 to -0.020, " in text
    assert text.endswith("met; its step 0.900x 1F1B's")
