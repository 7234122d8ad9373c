"""Assertions that compare two pytrees leaf by leaf and say exactly where they differ.

A failing comparison of a sharded run against its single-process reference is only useful if
it tells you which parameter is off and by how much. Both assertions here check the tree
structure first (showing both structures when they differ), then every leaf, and report all
mismatching leaves at once by dotted path (`fscale.tree.paths`): a shape or dtype mismatch
names the two shapes or dtypes; a value mismatch gives the number of differing elements, the
largest absolute and relative errors, and the index and values of the worst element.

Leaves are compared on the CPU, so a CUDA tensor compares with a CPU tensor by value (the
device is not part of the comparison); shapes and dtypes must match exactly. Leaves that are
not tensors (Python numbers, strings, ...) are compared with ``==`` (numbers with the same
tolerance rule as tensors in `assert_trees_close`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fscale import tree

__all__ = ["assert_trees_close", "assert_trees_equal"]

# Same per-dtype defaults as torch.testing.assert_close: loose enough for a different
# reduction order at that precision, tight enough to catch a wrong result.
_DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # dtype -> (rtol, atol)
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
_MAX_REPORTED_LEAVES = 10


def assert_trees_equal(actual: Any, expected: Any, *, msg: str = "") -> None:
    """Assert that two pytrees have the same structure and bit-identical leaves.

    Values compare like `torch.equal`, except that NaNs in the same places count as equal
    (a reference and a result that both overflowed are not a mismatch); ``-0.0 == 0.0``.

    Args:
        actual: the tree under test.
        expected: the reference tree.
        msg: context prepended to the failure message (e.g. "params after step 3").

    Raises:
        AssertionError: the structures differ, or some leaves differ in shape, dtype or value;
            the message names every such leaf by its dotted path.
    """
    _assert_trees(actual, expected, tolerances=None, msg=msg)


def assert_trees_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert that two pytrees have the same structure and leaves equal within tolerance.

    An element passes when ``|actual - expected| <= atol + rtol * |expected|``, when both are
    NaN, or when both are the same infinity. Integer and bool leaves must be equal.

    Args:
        actual: the tree under test.
        expected: the reference tree.
        rtol: relative tolerance; None uses the dtype's default (as `torch.testing.assert_close`:
            1.3e-6 for float32, 1e-7 for float64, 1e-3 for float16, 1.6e-2 for bfloat16).
        atol: absolute tolerance; None uses the dtype's default (1e-5, or 1e-7 for float64).
        msg: context prepended to the failure message.

    Raises:
        ValueError: `rtol` or `atol` is negative, or only one of them is given.
        AssertionError: the structures differ, or some leaves differ in shape, dtype, or by
            more than the tolerance; the message names every such leaf by its dotted path.
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not value >= 0:
            raise ValueError(f"assert_trees_close: `{name}` must be >= 0, got {value!r}.")
    if (rtol is None) != (atol is None):
        raise ValueError(
            "assert_trees_close: give both `rtol` and `atol`, or neither (per-dtype defaults); "
            f"got rtol={rtol!r}, atol={atol!r}."
        )
    _assert_trees(actual, expected, tolerances=(rtol, atol), msg=msg)


# --------------------------------------------------------------------------------------------
# Internals

Tolerances = tuple[float | None, float | None]


def _assert_trees(actual: Any, expected: Any, *, tolerances: Tolerances | None, msg: str) -> None:
    prefix = f"{msg}: " if msg else ""
    actual_paths, actual_leaves, actual_structure = tree.flatten_with_paths(actual)
    expected_paths, expected_leaves, expected_structure = tree.flatten_with_paths(expected)
    if actual_structure != expected_structure:
        mismatch = _structure_mismatch(
            actual_paths, expected_paths, actual_structure, expected_structure
        )
        raise AssertionError(prefix + mismatch)
    problems = []
    for path, actual_leaf, expected_leaf in zip(actual_paths, actual_leaves, expected_leaves):
        problem = _compare_leaf(actual_leaf, expected_leaf, tolerances)
        if problem is not None:
            problems.append(f"  - {path}: {problem}")
    if problems:
        kind = "equal" if tolerances is None else "close"
        shown = problems[:_MAX_REPORTED_LEAVES]
        if len(problems) > len(shown):
            shown.append(f"  ... and {len(problems) - len(shown)} more")
        raise AssertionError(
            f"{prefix}trees are not {kind}: {len(problems)} of {len(actual_leaves)} leaves "
            "differ:\n" + "\n".join(shown)
        )


def _structure_mismatch(
    actual_paths: Sequence[str],
    expected_paths: Sequence[str],
    actual_structure: Any,
    expected_structure: Any,
) -> str:
    lines = [
        "tree structures differ:",
        f"  actual:   {actual_structure}",
        f"  expected: {expected_structure}",
    ]
    actual_set, expected_set = set(actual_paths), set(expected_paths)
    only_actual = [path for path in actual_paths if path not in expected_set]
    only_expected = [path for path in expected_paths if path not in actual_set]
    if only_actual:
        lines.append(f"  leaves only in actual:   {only_actual}")
    if only_expected:
        lines.append(f"  leaves only in expected: {only_expected}")
    return "\n".join(lines)


def _compare_leaf(actual: Any, expected: Any, tolerances: Tolerances | None) -> str | None:
    """What is wrong with this pair of leaves, or None when they match."""
    actual_is_tensor = isinstance(actual, torch.Tensor)
    if actual_is_tensor != isinstance(expected, torch.Tensor):
        return f"type {type(actual).__name__} != {type(expected).__name__}"
    if actual_is_tensor:
        return _compare_tensors(actual, expected, tolerances)
    return _compare_objects(actual, expected, tolerances)


def _compare_objects(actual: Any, expected: Any, tolerances: Tolerances | None) -> str | None:
    numbers = (int, float, complex)
    if isinstance(actual, numbers) and isinstance(expected, numbers):
        # Python numbers have no dtype: compare them as 0-d tensors of the widest kind present,
        # so 1 and 1.0 are equal as they are in Python.
        kinds = {type(actual), type(expected)}
        if complex in kinds:
            dtype = torch.complex128
        else:
            dtype = torch.float64 if float in kinds else torch.int64
        return _compare_tensors(
            torch.tensor(actual, dtype=dtype), torch.tensor(expected, dtype=dtype), tolerances
        )
    if type(actual) is not type(expected):
        return f"type {type(actual).__name__} != {type(expected).__name__}"
    return None if bool(actual == expected) else f"{actual!r} != {expected!r}"


def _compare_tensors(
    actual: torch.Tensor, expected: torch.Tensor, tolerances: Tolerances | None
) -> str | None:
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.is_floating_point() or actual.is_complex():
        bounds = None if tolerances is None else _resolve_tolerances(tolerances, actual.dtype)
        # Differences are computed in double precision so that they are exact for every
        # narrower dtype (the difference of two float32 numbers can round in float32).
        wide = torch.complex128 if actual.is_complex() else torch.float64
        actual, expected = actual.to(wide), expected.to(wide)
        mismatch = ~_agree(actual, expected, bounds)
    else:
        # Integers and bools are exact under any tolerance; compare them in int64.
        actual, expected = actual.to(torch.int64), expected.to(torch.int64)
        mismatch = actual != expected
    if not bool(mismatch.any()):
        return None
    return _describe_mismatch(actual, expected, mismatch)


def _agree(
    actual: torch.Tensor, expected: torch.Tensor, bounds: tuple[float, float] | None
) -> torch.Tensor:
    """Elementwise: equal (bounds None) or within ``(rtol, atol)``; NaN matches NaN."""
    agree = (actual == expected) | (actual.isnan() & expected.isnan())
    if bounds is not None:
        rtol, atol = bounds
        # Infinities must match exactly (the `==` above): the bound is itself infinite where
        # `expected` is, and would let any value pass there.
        finite = actual.isfinite() & expected.isfinite()
        agree |= finite & ((actual - expected).abs() <= atol + rtol * expected.abs())
    return agree


def _resolve_tolerances(tolerances: Tolerances, dtype: torch.dtype) -> tuple[float, float]:
    rtol, atol = tolerances
    if rtol is not None and atol is not None:
        return rtol, atol
    if dtype not in _DEFAULT_TOLERANCES:
        raise ValueError(
            f"assert_trees_close: there is no default tolerance for {dtype}; pass `rtol` and "
            "`atol`."
        )
    return _DEFAULT_TOLERANCES[dtype]


def _describe_mismatch(actual: torch.Tensor, expected: torch.Tensor, mismatch: torch.Tensor) -> str:
    count, total = int(mismatch.sum()), mismatch.numel()
    error = (actual - expected).abs().to(torch.float64)
    error = _nan_to(error, mismatch)
    relative = _nan_to(error / expected.abs().to(torch.float64), mismatch)
    worst_flat = int(torch.where(mismatch, error, -1.0).reshape(-1).argmax())
    return (
        f"{count} of {total} elements differ; max abs error {_fmt(error.max())}, "
        f"max rel error {_fmt(relative.max())}; worst at index "
        f"{_unravel(worst_flat, tuple(actual.shape))}: "
        f"actual {_fmt(actual.reshape(-1)[worst_flat])}, "
        f"expected {_fmt(expected.reshape(-1)[worst_flat])}"
    )


def _nan_to(error: torch.Tensor, mismatch: torch.Tensor) -> torch.Tensor:
    """Replace NaN errors: inf where the elements mismatch, 0 where they agree.

    NaN errors come from NaN on one side (a mismatch, ranked above every finite error) or
    from agreeing pairs such as NaN and NaN or inf and inf (no error at all).
    """
    return torch.where(error.isnan(), torch.where(mismatch, math.inf, 0.0).double(), error)


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, position = divmod(flat_index, size)
        index.append(position)
    return tuple(reversed(index))


def _fmt(value: torch.Tensor) -> str:
    number = value.item()
    if isinstance(number, complex):
        return f"({number:.6g})"
    return str(number) if isinstance(number, int) else f"{number:.6g}"
