"""fscale.testing.assertions: pytree comparisons and what their failures say."""

import re

import pytest
import torch

from fscale.testing import assert_trees_close, assert_trees_equal

NAN, INF = float("nan"), float("inf")


def _params():
    return {
        "blocks": [{"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}],
        "head": torch.tensor([1, 2, 3]),
        "step": 3,
    }


def _failure(assertion, actual, expected, **kwargs):
    with pytest.raises(AssertionError) as caught:
        assertion(actual, expected, **kwargs)
    return str(caught.value)


# assert_trees_equal


def test_equal_trees_pass():
    assert_trees_equal(_params(), _params())
    assert_trees_equal([], [])
    assert_trees_equal({"a": None}, {"a": None})


def test_value_mismatch_names_the_leaf_the_errors_and_the_worst_element():
    actual = _params()
    actual["blocks"][0]["w"] = actual["blocks"][0]["w"].clone()
    actual["blocks"][0]["w"][1, 2] = 9.0  # expected 5: abs error 4, rel error 0.8
    actual["blocks"][0]["w"][0, 1] = 1.5  # expected 1: abs error 0.5, rel error 0.5
    message = _failure(assert_trees_equal, actual, _params(), msg="params after step 3")

    assert message.startswith("params after step 3: trees are not equal: 1 of 4 leaves differ")
    assert (
        "- blocks.0.w: 2 of 6 elements differ; max abs error 4, max rel error 0.8; "
        "worst at index (1, 2): actual 9, expected 5"
    ) in message
    assert "head" not in message and "blocks.0.b" not in message


def test_every_mismatching_leaf_is_reported():
    actual = {"a": torch.ones(2), "b": torch.ones(2), "c": torch.tensor([1, 2])}
    expected = {"a": torch.zeros(2), "b": torch.ones(2), "c": torch.tensor([1, 5])}
    message = _failure(assert_trees_equal, actual, expected)
    assert "2 of 3 leaves differ" in message
    assert re.search(r"- a: 2 of 2 elements differ; max abs error 1, max rel error inf", message)
    assert "- c: 1 of 2 elements differ; max abs error 3," in message
    assert "worst at index (1,): actual 2, expected 5" in message


def test_nans_in_the_same_places_are_equal_and_elsewhere_are_not():
    assert_trees_equal(torch.tensor([1.0, NAN, INF]), torch.tensor([1.0, NAN, INF]))
    assert_trees_equal(torch.tensor([-0.0]), torch.tensor([0.0]))  # as torch.equal
    message = _failure(assert_trees_equal, torch.tensor([NAN, 2.0]), torch.tensor([1.0, 2.0]))
    assert "1 of 2 elements differ; max abs error inf, max rel error inf" in message
    assert "worst at index (0,): actual nan, expected 1" in message


def test_one_ulp_is_a_mismatch_for_equal():
    one = torch.tensor([1.0], dtype=torch.float32)
    next_up = torch.nextafter(one, torch.tensor([2.0]))
    message = _failure(assert_trees_equal, next_up, one)
    assert "max abs error 1.19209e-07" in message


def test_structure_mismatch_shows_both_structures_and_the_odd_leaves():
    both, one = {"w": torch.ones(1), "b": torch.ones(1)}, {"w": torch.ones(1)}
    message = _failure(assert_trees_equal, both, one)
    assert "tree structures differ" in message
    assert "actual:   PyTreeSpec({'b': *, 'w': *})" in message
    assert "expected: PyTreeSpec({'w': *})" in message
    assert "leaves only in actual:   ['b']" in message
    message = _failure(assert_trees_equal, [torch.ones(1)], (torch.ones(1),), msg="grads")
    assert message.startswith("grads: tree structures differ")


def test_shape_and_dtype_mismatches_name_the_leaf():
    message = _failure(assert_trees_equal, {"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)})
    assert "- w: shape (2, 3) != (3, 2)" in message
    message = _failure(
        assert_trees_close, {"w": torch.zeros(2)}, {"w": torch.zeros(2, dtype=torch.float64)}
    )
    assert "- w: dtype torch.float32 != torch.float64" in message


def test_non_tensor_leaves_compare_by_value():
    assert_trees_equal({"step": 3, "name": "adam"}, {"step": 3.0, "name": "adam"})
    message = _failure(assert_trees_equal, {"name": "sgd"}, {"name": "adam"})
    assert "- name: 'sgd' != 'adam'" in message
    assert "- lr: 1 of 1 elements differ" in _failure(assert_trees_equal, {"lr": 0.1}, {"lr": 0.2})
    message = _failure(assert_trees_equal, {"x": torch.tensor(1)}, {"x": 1})
    assert "- x: type Tensor != int" in message


def test_integer_and_bool_leaves():
    assert_trees_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    message = _failure(assert_trees_equal, torch.tensor([True]), torch.tensor([False]))
    assert "max abs error 1, max rel error inf; worst at index (0,): actual 1, expected 0" in (
        message
    )


def test_complex_leaves():
    assert_trees_equal(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))
    message = _failure(assert_trees_equal, torch.tensor([1 + 1j]), torch.tensor([1 + 2j]))
    assert "max abs error 1," in message and "actual (1+1j), expected (1+2j)" in message


# assert_trees_close


def test_close_uses_per_dtype_default_tolerances():
    base = torch.tensor([1.0, 100.0])
    assert_trees_close(base * (1 + 1e-6), base)  # float32: rtol 1.3e-6
    message = _failure(assert_trees_close, base * (1 + 1e-5), base)
    assert "trees are not close" in message
    assert_trees_close(base.half() * (1 + 5e-4), base.half())  # float16: rtol 1e-3
    double = base.double()
    assert_trees_close(double * (1 + 5e-8), double)  # float64: rtol 1e-7
    assert "trees are not close" in _failure(assert_trees_close, double * (1 + 5e-7), double)


def test_close_with_explicit_tolerances_reports_the_worst_failing_element():
    expected = torch.tensor([[1.0, 10.0], [100.0, 1000.0]], dtype=torch.float64)
    actual = expected + torch.tensor([[0.05, 0.5], [0.5, 5.0]], dtype=torch.float64)
    assert_trees_close(actual, expected, rtol=0.06, atol=0.1)
    # |a - e| <= 0.1 + 0.01 |e| holds everywhere but at [0, 1] (0.5 > 0.2); the largest errors
    # (abs 5 at [1, 1], rel 0.05 at [0, 0]) are within tolerance and are reported as statistics.
    message = _failure(assert_trees_close, {"w": actual}, {"w": expected}, rtol=0.01, atol=0.1)
    assert (
        "- w: 1 of 4 elements differ; max abs error 5, max rel error 0.05; "
        "worst at index (0, 1): actual 10.5, expected 10"
    ) in message


def test_close_matches_nans_and_infinities_in_the_same_places():
    value = torch.tensor([NAN, INF, -INF, 1.0])
    assert_trees_close(value, value.clone(), rtol=0.0, atol=0.0)
    message = _failure(assert_trees_close, torch.tensor([INF]), torch.tensor([-INF]))
    assert "max abs error inf" in message
    message = _failure(
        assert_trees_close, torch.tensor([1.0]), torch.tensor([INF]), rtol=0.1, atol=0
    )
    assert "worst at index (0,): actual 1, expected inf" in message
    message = _failure(assert_trees_close, torch.tensor([1.0, 2.0]), torch.tensor([1.0, NAN]))
    assert "worst at index (1,): actual 2, expected nan" in message


def test_close_is_exact_for_integers():
    assert_trees_close(torch.tensor([5]), torch.tensor([5]), rtol=0.5, atol=10.0)
    message = _failure(
        assert_trees_close, torch.tensor([5]), torch.tensor([6]), rtol=0.5, atol=10.0
    )
    assert "1 of 1 elements differ" in message


def test_close_rejects_bad_tolerances():
    with pytest.raises(ValueError, match=r"`rtol` must be >= 0, got -1"):
        assert_trees_close(torch.ones(1), torch.ones(1), rtol=-1, atol=0)
    with pytest.raises(ValueError, match=r"`atol` must be >= 0, got nan"):
        assert_trees_close(torch.ones(1), torch.ones(1), rtol=0, atol=NAN)
    with pytest.raises(ValueError, match=r"give both `rtol` and `atol`, or neither"):
        assert_trees_close(torch.ones(1), torch.ones(1), rtol=1e-3)
    float8 = torch.ones(1).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"no default tolerance for torch.float8_e4m3fn"):
        assert_trees_close(float8, float8)
    assert_trees_close(float8, float8, rtol=0.1, atol=0.0)


def test_long_reports_are_truncated():
    actual = {f"p{i:02d}": torch.ones(1) for i in range(15)}
    expected = {f"p{i:02d}": torch.zeros(1) for i in range(15)}
    message = _failure(assert_trees_equal, actual, expected)
    assert "15 of 15 leaves differ" in message
    assert "- p09:" in message and "- p10:" not in message
    assert "... and 5 more" in message
