"""The native block copy (kvdepot.gpu._rowcopy) against a numpy reference, and its argument checks."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.gpu import _flat

rowcopy = _flat._rowcopy  # None when the install could not compile it: every test here then fails


def test_the_extension_is_built() -> None:
    """The install builds it wherever a C compiler exists, as on every machine the tests run on;
    without it the CPU path silently falls back to slower copies."""
    assert rowcopy is not None
    assert _flat.FLAT_NATIVE


def test_built_with_openmp_and_sharing_torchs_runtime() -> None:
    """On this project's machines the row copy is built with OpenMP and runs on the libgomp torch
    loaded (no second runtime is mapped for it), so copies use torch's threads."""
    assert rowcopy.OPENMP == 1
    library = rowcopy.openmp_library()
    assert library is not None
    assert os.path.realpath(library).startswith(os.path.dirname(os.path.realpath(torch.__file__)))
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if os.path.basename(line.split()[-1]) == "libgomp.so.1"}
    assert runtimes == {library}
    assert _flat._shares_torch_openmp()
    assert _flat.native_threads() == torch.get_num_threads()


class Geometry:
    """A KV row matrix of `planes` planes of `blocks` blocks of `rpb` rows, layer-major or interleaved."""

    def __init__(self, planes: int, blocks: int, rpb: int, *, interleaved: bool) -> None:
        self.planes, self.blocks, self.rpb = planes, blocks, rpb
        p = np.arange(planes, dtype=np.int64)[:, None]
        r = np.arange(rpb, dtype=np.int64)[None, :]
        if interleaved:  # block-major: every plane's rows of block 0, then of block 1...
            self.pattern = p * rpb + r
            self.block_rows = np.full(planes, planes * rpb, dtype=np.int64)
        else:  # layer-major: all blocks of plane 0, then of plane 1...
            self.pattern = p * blocks * rpb + r
            self.block_rows = np.full(planes, rpb, dtype=np.int64)
        self.kv_rows = planes * blocks * rpb

    def kv_row(self, p: int, block: int, r: int) -> int:
        return int(self.pattern[p, r] + block * self.block_rows[p])


def matrix(rows: int, row_bytes: int, seed: int, *, misalign: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the whole buffer, a [rows, row_bytes] view starting `misalign` bytes into it) of random bytes."""
    whole = np.random.default_rng(seed).integers(0, 256, rows * row_bytes + 64, dtype=np.uint8)
    return whole, whole[misalign : misalign + rows * row_bytes].reshape(rows, row_bytes)


def reference(g: Geometry, kv: np.ndarray, slot: np.ndarray, ids: list[int], plane_rows: int, *, to_slot: bool) -> None:
    for p in range(g.planes):
        for j, block in enumerate(ids):
            for r in range(g.rpb):
                s, k = p * plane_rows + j * g.rpb + r, g.kv_row(p, block, r)
                if to_slot:
                    slot[s] = kv[k]
                else:
                    kv[k] = slot[s]


def copy(g: Geometry, kv: np.ndarray, slot: np.ndarray, ids: list[int], plane_rows: int, **kwargs: object) -> None:
    rowcopy.copy_blocks(
        kv.ctypes.data, kv.shape[0], slot.ctypes.data, slot.shape[0], ids, g.pattern, g.block_rows, plane_rows,
        kv.shape[1], **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "plain"])
@pytest.mark.parametrize("row_bytes", [1, 3, 16, 17, 63, 64, 65, 4096 + 24])
@pytest.mark.parametrize("misalign", [0, 1, 13])
@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "interleaved"])
def test_gather_and_scatter_match_the_reference(
    row_bytes: int, misalign: int, stream: bool, threads: int, interleaved: bool
) -> None:
    """Blocks into a slot (gather) and from a slot into other blocks (scatter), with a gap between the
    slot's planes: the bytes equal the reference for rows of any length at any alignment, and rows
    not named (KV rows of other blocks, slot rows in the gaps) keep theirs."""
    g = Geometry(3, 10, 2, interleaved=interleaved)
    ids = [7, 0, 9, 3]
    plane_rows = len(ids) * g.rpb + 1  # one slot row between planes is not written
    _, kv = matrix(g.kv_rows, row_bytes, 1)
    _, slot = matrix(3 * plane_rows, row_bytes, 2, misalign=misalign)
    expected = slot.copy()
    reference(g, kv, expected, ids, plane_rows, to_slot=True)
    copy(g, kv, slot, ids, plane_rows, to_slot=True, stream=stream, threads=threads)
    assert np.array_equal(slot, expected)

    expected_kv = kv.copy()
    targets = [2, 8, 5, 1]
    reference(g, expected_kv, slot, targets, plane_rows, to_slot=False)
    copy(g, kv, slot, targets, plane_rows, to_slot=False, stream=stream, threads=threads)
    assert np.array_equal(kv, expected_kv)
    assert not np.array_equal(kv[g.kv_row(0, 2, 0)], kv[g.kv_row(0, 4, 0)])  # block 4 was not written


@settings(max_examples=60, deadline=None)
@given(
    planes=st.integers(1, 4),
    rpb=st.integers(1, 3),
    row_bytes=st.integers(1, 200),
    ids=st.lists(st.integers(0, 11), max_size=12, unique=True),
    gap=st.integers(0, 2),
    interleaved=st.booleans(),
    stream=st.booleans(),
)
def test_any_geometry(
    planes: int, rpb: int, row_bytes: int, ids: list[int], gap: int, interleaved: bool, stream: bool
) -> None:
    g = Geometry(planes, 12, rpb, interleaved=interleaved)
    plane_rows = len(ids) * rpb + gap
    _, kv = matrix(g.kv_rows, row_bytes, 3)
    _, slot = matrix(max(1, planes * plane_rows), row_bytes, 4)
    expected = slot.copy()
    reference(g, kv, expected, ids, plane_rows, to_slot=True)
    copy(g, kv, slot, ids, plane_rows, to_slot=True, stream=stream)
    assert np.array_equal(slot, expected)
    expected_kv = kv.copy()
    back = ids[::-1]
    reference(g, expected_kv, slot, back, plane_rows, to_slot=False)
    copy(g, kv, slot, back, plane_rows, to_slot=False, stream=stream)
    assert np.array_equal(kv, expected_kv)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("row_bytes", [24, 4096, 70_000])
def test_rows_shared_among_threads(row_bytes: int, threads: int) -> None:
    """Copies of several 64 KiB batches and a short one, shared among OpenMP threads, equal the reference."""
    blocks = max(4, (200 * 1024) // (2 * row_bytes) + 1)
    g = Geometry(2, 2 * blocks, 1, interleaved=False)
    ids = np.random.default_rng(5).permutation(2 * blocks)[:blocks].tolist()
    _, kv = matrix(g.kv_rows, row_bytes, 6)
    _, slot = matrix(2 * blocks, row_bytes, 7)
    expected = slot.copy()
    reference(g, kv, expected, ids, blocks, to_slot=True)
    copy(g, kv, slot, ids, blocks, to_slot=True, stream=False, threads=threads)
    assert np.array_equal(slot, expected)
    expected_kv = kv.copy()
    targets = np.random.default_rng(8).permutation(2 * blocks)[:blocks].tolist()
    reference(g, expected_kv, slot, targets, blocks, to_slot=False)
    copy(g, kv, slot, targets, blocks, to_slot=False, threads=threads)
    assert np.array_equal(kv, expected_kv)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (
            [0, 1, 10],
            r"ids\[2\] = 10: plane 1's rows of that block are outside a matrix of 40 rows",
        ),
        ([0, -1], r"ids\[1\] = -1"),
        ([2**62], "outside"),  # the row number overflows 64 bits
    ],
)
def test_blocks_out_of_range_move_nothing(ids: list[int], message: str) -> None:
    """Every block is checked before any byte moves: a bad id late in the list leaves both sides as they were."""
    g = Geometry(2, 10, 2, interleaved=False)
    _, kv = matrix(g.kv_rows, 64, 8)
    _, slot = matrix(2 * len(ids) * 2, 64, 9)
    kv_before, slot_before = kv.copy(), slot.copy()
    for to_slot in (True, False):
        with pytest.raises(IndexError, match=message):
            copy(g, kv, slot, ids, len(ids) * 2, to_slot=to_slot)
    assert np.array_equal(kv, kv_before)
    assert np.array_equal(slot, slot_before)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"slot_rows": 7}, IndexError, "2 planes of 2 blocks do not fit a slot of 7 rows"),
        ({"plane_rows": 3}, ValueError, "plane_rows 3 is under the 4 rows of one plane"),
        ({"ids": [1, 2.0]}, TypeError, r"ids\[1\] must be an int"),
        ({"ids": [1, "2"]}, TypeError, r"ids\[1\] must be an int"),
        ({"ids": 5}, TypeError, "ids must be a sequence"),
        ({"pattern": np.zeros(4, dtype=np.int32)}, TypeError, "pattern must hold 64-bit signed integers"),
        ({"pattern": np.zeros(8, dtype=np.uint64)}, TypeError, "64-bit signed"),
        ({"pattern": np.zeros(6, dtype=np.int64)[::2]}, (TypeError, ValueError, BufferError), None),
        ({"pattern": np.zeros(3, dtype=np.int64)}, ValueError, "pattern of 3 rows does not split into 2 planes"),
        ({"block_rows": np.zeros(0, dtype=np.int64)}, ValueError, "does not split into 0 planes"),
        ({"block_rows": np.array([2, -1], dtype=np.int64)}, IndexError, "plane 1"),
        ({"pattern": np.array([0, 1, -2, 3], dtype=np.int64)}, IndexError, "plane 1"),
        ({"row_bytes": 0}, ValueError, "row_bytes and threads > 0"),
        ({"threads": 0}, ValueError, "row_bytes and threads > 0"),
        ({"kv_rows": -1}, ValueError, "row counts must be >= 0"),
        ({"slot": 0}, ValueError, "non-null pointer"),
        ({"kv": -1}, (OverflowError, ValueError), None),
        ({"kv": 1.5}, TypeError, "an address must be an int"),
    ],
)
def test_bad_arguments_are_typed_errors(kwargs: dict[str, object], error: type[Exception], message: str | None) -> None:
    g = Geometry(2, 10, 2, interleaved=False)
    _, kv = matrix(g.kv_rows, 64, 10)
    _, slot = matrix(8, 64, 11)
    kv_before, slot_before = kv.copy(), slot.copy()
    args: dict[str, object] = {
        "kv": kv.ctypes.data,
        "kv_rows": g.kv_rows,
        "slot": slot.ctypes.data,
        "slot_rows": 8,
        "ids": [1, 2],
        "pattern": g.pattern,
        "block_rows": g.block_rows,
        "plane_rows": 4,
        "row_bytes": 64,
        "to_slot": True,
    }
    args.update(kwargs)
    with pytest.raises(error, match=message):
        rowcopy.copy_blocks(**args)
    assert np.array_equal(kv, kv_before)
    assert np.array_equal(slot, slot_before)


def test_no_blocks_is_a_no_op() -> None:
    g = Geometry(2, 4, 1, interleaved=True)
    _, kv = matrix(g.kv_rows, 32, 12)
    _, slot = matrix(1, 32, 13)
    before = slot.copy()
    copy(g, kv, slot, [], 0, to_slot=True)
    assert np.array_equal(slot, before)


def test_row_counts_that_overflow_are_refused() -> None:
    """A plane_rows so large that the slot's last row number wraps around 64 bits is refused, not
    turned into a write before the slot."""
    g = Geometry(2, 4, 1, interleaved=False)
    _, kv = matrix(g.kv_rows, 16, 14)
    whole, slot = matrix(1, 16, 15, misalign=32)
    before = whole.copy()
    for plane_rows in (2**63 - 1, 2**62):
        with pytest.raises((OverflowError, IndexError)):
            copy(g, kv, slot, [1], plane_rows, to_slot=True)
    assert np.array_equal(whole, before)


def test_more_threads_than_work_or_cores() -> None:
    """Thread counts far above the batches or the cores are capped (libgomp would otherwise exit the
    process when it cannot create them)."""
    g = Geometry(1, 8, 1, interleaved=False)
    _, kv = matrix(g.kv_rows, 70_000, 16)
    _, slot = matrix(3, 70_000, 17)
    expected = slot.copy()
    reference(g, kv, expected, [5, 0, 7], 3, to_slot=True)
    copy(g, kv, slot, [5, 0, 7], 3, to_slot=True, threads=100_000)
    assert np.array_equal(slot, expected)


def test_pattern_shape_must_match_the_planes() -> None:
    g = Geometry(2, 4, 3, interleaved=False)  # pattern [2, 3]
    _, kv = matrix(g.kv_rows, 8, 18)
    _, slot = matrix(9, 8, 19)
    with pytest.raises(ValueError, match="does not split into 3 planes"):
        rowcopy.copy_blocks(
            kv.ctypes.data, g.kv_rows, slot.ctypes.data, 9, [1], g.pattern, np.ones(3, dtype=np.int64), 3, 8, True
        )


def test_arrays_changed_by_another_thread_during_a_copy() -> None:
    """The copy works on its own copy of pattern and block_rows: another thread writing them once the
    GIL is released cannot send rows outside the matrix or change which rows move."""
    g = Geometry(2, 512, 1, interleaved=False)
    ids = list(range(0, 512, 2))
    _, kv = matrix(g.kv_rows, 4096, 20)
    _, slot = matrix(2 * len(ids), 4096, 21)
    expected = slot.copy()
    reference(g, kv, expected, ids, len(ids), to_slot=True)
    pattern, original = g.pattern, g.pattern.copy()
    stop = threading.Event()

    def scribble() -> None:
        while not stop.is_set():
            pattern[0, 0] = 1 << 40
            pattern[0, 0] = original[0, 0]

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        for _ in range(20):
            slot[...] = 0
            try:
                rowcopy.copy_blocks(
                    kv.ctypes.data, g.kv_rows, slot.ctypes.data, slot.shape[0], ids, pattern, g.block_rows,
                    len(ids), 4096, True, False, 2,
                )  # fmt: skip
            except IndexError:  # its snapshot held the scribbled value: refused before any byte moved
                assert not slot.any()
                continue
            assert np.array_equal(slot, expected)
    finally:
        stop.set()
        writer.join()


def _copy_in_child(queue: Any) -> None:
    g = Geometry(2, 64, 1, interleaved=False)
    _, kv = matrix(g.kv_rows, 4096, 22)
    _, slot = matrix(2 * 32, 4096, 23)
    expected = slot.copy()
    reference(g, kv, expected, list(range(32)), 32, to_slot=True)
    threads = _flat.native_threads()
    copy(g, kv, slot, list(range(32)), 32, to_slot=True, threads=threads)
    queue.put((threads, bool(np.array_equal(slot, expected))))


def test_a_child_forked_after_threaded_copies_copies_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp's threads do not survive fork(): a child of a process that ran threaded copies copies
    on one thread (a parallel region there would wait forever) and finishes."""
    g = Geometry(2, 64, 1, interleaved=False)
    _, kv = matrix(g.kv_rows, 4096, 24)
    _, slot = matrix(2 * 32, 4096, 25)
    copy(g, kv, slot, list(range(32)), 32, to_slot=True, threads=2)  # this process's team exists now
    monkeypatch.setattr(_flat, "_ran_threads", True)  # as after a copier's threaded copy
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_copy_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in its copy")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (1, True)
