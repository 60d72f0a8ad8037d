"""The native row copy (kvdepot.gpu._rowcopy) against numpy indexing, and its argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.gpu import _flat

rowcopy = _flat._rowcopy  # None when the install could not compile it: every test here then fails


def test_the_extension_is_built() -> None:
    """The install builds it wherever a C compiler exists, as on every machine the tests run on;
    without it the CPU path silently loses its fast scatter."""
    assert rowcopy is not None
    assert _flat.FLAT_NATIVE


def matrix(rows: int, row_bytes: int, seed: int, *, misalign: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the whole buffer, a [rows, row_bytes] view starting `misalign` bytes into it) of random bytes."""
    whole = np.random.default_rng(seed).integers(0, 256, rows * row_bytes + 64, dtype=np.uint8)
    view = whole[misalign : misalign + rows * row_bytes].reshape(rows, row_bytes)
    return whole, view


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "plain"])
@pytest.mark.parametrize("row_bytes", [1, 3, 15, 16, 17, 63, 64, 65, 200, 4096, 4096 + 24])
@pytest.mark.parametrize("misalign", [0, 1, 8, 13])
def test_gather_and_scatter_match_numpy(row_bytes: int, misalign: int, stream: bool) -> None:
    """Listed rows into consecutive ones (gather) and back into other listed rows (scatter): the
    bytes equal numpy's indexing, for rows of any length at any alignment; unnamed rows keep theirs."""
    _, src = matrix(40, row_bytes, 1)
    dst_whole, dst = matrix(12, row_bytes, 2, misalign=misalign)
    before = dst_whole.copy()
    rows = np.array([39, 0, 7, 7, 21, 3, 38, 12, 5], dtype=np.int64)  # a row may be read twice
    rowcopy.copy_rows(dst.ctypes.data, None, 12, src.ctypes.data, rows, 40, rows.size, row_bytes, stream)
    assert np.array_equal(dst[: rows.size], src[rows])
    assert np.array_equal(dst[rows.size :], before[misalign:][: 12 * row_bytes].reshape(12, row_bytes)[rows.size :])
    assert np.array_equal(dst_whole[:misalign], before[:misalign])
    assert np.array_equal(dst_whole[misalign + 12 * row_bytes :], before[misalign + 12 * row_bytes :])

    _, back = matrix(30, row_bytes, 3, misalign=misalign)
    expected = back.copy()
    targets = np.array([29, 4, 17, 0, 11, 2, 28, 9, 6], dtype=np.int64)
    expected[targets] = dst[: rows.size]
    rowcopy.copy_rows(back.ctypes.data, targets, 30, dst.ctypes.data, None, 12, targets.size, row_bytes, stream)
    assert np.array_equal(back, expected)


@settings(max_examples=60, deadline=None)
@given(
    row_bytes=st.integers(1, 300),
    pairs=st.lists(st.tuples(st.integers(0, 49), st.integers(0, 49)), max_size=50, unique_by=lambda p: p[1]),
    stream=st.booleans(),
)
def test_listed_rows_on_both_sides(row_bytes: int, pairs: list[tuple[int, int]], stream: bool) -> None:
    """Row lists on both sides, any lengths: each destination row named once gets its source row."""
    _, src = matrix(50, row_bytes, 4)
    _, dst = matrix(50, row_bytes, 5)
    expected = dst.copy()
    src_rows = np.array([p[0] for p in pairs], dtype=np.int64)
    dst_rows = np.array([p[1] for p in pairs], dtype=np.int64)
    expected[dst_rows] = src[src_rows]
    rowcopy.copy_rows(dst.ctypes.data, dst_rows, 50, src.ctypes.data, src_rows, 50, len(pairs), row_bytes, stream)
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("row_bytes", [24, 4096, 70_000])
def test_rows_shared_among_threads(row_bytes: int, threads: int) -> None:
    """Copies of many 64 KiB batches, shared among OpenMP threads: gather, then scatter into other
    listed rows, give numpy's result (several threads take batches, the last one short)."""
    count = max(3, (200 * 1024) // row_bytes + 1)  # about 3 batches and a short one
    total = 2 * count + 5
    _, src = matrix(total, row_bytes, 14)
    _, slot = matrix(count, row_bytes, 15)
    rows = np.random.default_rng(16).permutation(total)[:count].astype(np.int64)
    rowcopy.copy_rows(slot.ctypes.data, None, count, src.ctypes.data, rows, total, count, row_bytes, False, threads)
    assert np.array_equal(slot, src[rows])
    _, back = matrix(total, row_bytes, 17)
    expected = back.copy()
    targets = np.random.default_rng(18).permutation(total)[:count].astype(np.int64)
    expected[targets] = slot
    rowcopy.copy_rows(back.ctypes.data, targets, total, slot.ctypes.data, None, count, count, row_bytes, True, threads)
    assert np.array_equal(back, expected)


def test_built_with_openmp_and_sharing_torchs_runtime() -> None:
    """On this project's machines the row copy is built with OpenMP and runs on torch's libgomp:
    the process maps exactly one OpenMP runtime, so copies use torch's threads."""
    import torch

    assert rowcopy.OPENMP == 1
    assert _flat._one_openmp_runtime()
    assert _flat.native_threads() == torch.get_num_threads()


def test_no_list_copies_consecutive_rows() -> None:
    _, src = matrix(8, 100, 6)
    _, dst = matrix(8, 100, 7)
    rowcopy.copy_rows(dst.ctypes.data, None, 8, src.ctypes.data, None, 8, 8, 100)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize(
    ("rows", "limit", "message"),
    [
        ([0, 1, 10], 10, r"src_rows\[2\] = 10 is outside a matrix of 10 rows"),
        ([0, -1], 10, r"src_rows\[1\] = -1"),
        ([2**62], 10, "outside"),
    ],
)
def test_rows_out_of_range_move_nothing(rows: list[int], limit: int, message: str) -> None:
    """Every row number is checked before any byte moves: a bad one late in the list leaves the
    destination as it was."""
    _, src = matrix(10, 64, 8)
    _, dst = matrix(10, 64, 9)
    before = dst.copy()
    index = np.array(rows, dtype=np.int64)
    with pytest.raises(IndexError, match=message):
        rowcopy.copy_rows(dst.ctypes.data, None, 10, src.ctypes.data, index, limit, index.size, 64)
    assert np.array_equal(dst, before)


def test_destination_rows_are_checked_too() -> None:
    _, src = matrix(4, 64, 10)
    _, dst = matrix(4, 64, 11)
    before = dst.copy()
    with pytest.raises(IndexError, match=r"dst_rows\[0\] = 4"):
        rowcopy.copy_rows(dst.ctypes.data, np.array([4], dtype=np.int64), 4, src.ctypes.data, None, 4, 1, 64)
    with pytest.raises(IndexError, match="5 rows do not fit a matrix of 4"):
        rowcopy.copy_rows(dst.ctypes.data, None, 4, src.ctypes.data, None, 8, 5, 64)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"src_rows": np.zeros(3, dtype=np.int32)}, TypeError, "64-bit integers"),
        ({"src_rows": np.zeros(3, dtype=np.float64)}, TypeError, "64-bit integers"),
        ({"src_rows": np.zeros(6, dtype=np.int64)[::2]}, (TypeError, ValueError, BufferError), ""),
        ({"src_rows": b"\0" * 24}, TypeError, "64-bit integers"),
        ({"src_rows": [0, 1, 2]}, TypeError, ""),
        ({"src_rows": np.zeros(2, dtype=np.int64)}, ValueError, "row lists of 3 and 2 items"),
        ({"count": -1}, ValueError, ">= 0"),
        ({"row_bytes": 0}, ValueError, "row_bytes and threads > 0"),
        ({"threads": 0}, ValueError, "row_bytes and threads > 0"),
        ({"src": 0}, ValueError, "null address"),
        ({"dst": -1}, (OverflowError, TypeError), ""),
    ],
)
def test_bad_arguments_are_typed_errors(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    _, src = matrix(4, 64, 12)
    _, dst = matrix(4, 64, 13)
    before = dst.copy()
    args: dict[str, object] = {
        "dst": dst.ctypes.data,
        "dst_rows": None,
        "dst_limit": 4,
        "src": src.ctypes.data,
        "src_rows": np.arange(3, dtype=np.int64),
        "src_limit": 4,
        "count": 3,
        "row_bytes": 64,
    }
    args.update(kwargs)
    with pytest.raises(error, match=message or None):
        rowcopy.copy_rows(**args)
    assert np.array_equal(dst, before)
