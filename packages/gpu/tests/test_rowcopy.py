"""The native copy (kvdepot.gpu._rowcopy) against a numpy reference, and its argument checks."""

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

from kvdepot.gpu import _copier

rowcopy = _copier._rowcopy  # None when the install could not build it: every test here then fails


def test_the_extension_is_built() -> None:
    """The install builds it (setup.py makes it required); without it a CPU copier refuses to open."""
    assert rowcopy is not None


def test_built_with_openmp_and_sharing_torchs_runtime() -> None:
    """On this project's machines the copy is built with OpenMP and runs on the libgomp torch loaded
    (no second runtime is mapped for it), so copies use torch's threads."""
    assert rowcopy.OPENMP == 1
    library = rowcopy.openmp_library()
    assert library is not None
    assert os.path.realpath(library).startswith(os.path.dirname(os.path.realpath(torch.__file__)))
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if os.path.basename(line.split()[-1]) == "libgomp.so.1"}
    assert runtimes == {library}
    assert _copier._shares_torch_openmp()
    assert _copier.native_threads() == torch.get_num_threads()


class Geometry:
    """A KV buffer of `planes` layers of `blocks` blocks of `segments` segments of `length` bytes,
    layer-major or interleaved (block-major), and its copy table for chunks of `chunk` blocks."""

    def __init__(
        self, planes: int, blocks: int, segments: int, length: int, chunk: int, *, interleaved: bool, gap: int = 0
    ) -> None:
        self.blocks, self.chunk = blocks, chunk
        block = segments * length
        self.kv = np.random.default_rng(planes * 7 + length).integers(0, 256, planes * blocks * block, dtype=np.uint8)
        rows = []
        for p in range(planes):
            for s in range(segments):
                kv = (p * block if interleaved else p * blocks * block) + s * length
                step = planes * block if interleaved else block
                rows.append((kv, step, p * (chunk * block + gap) + s * length, block, length))
        self.offsets = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self.slot_bytes = planes * (chunk * block + gap)

    def table(self) -> np.ndarray:
        table = self.offsets.copy()
        table[:, 0] += self.kv.ctypes.data
        return table

    def reference(self, slot: np.ndarray, ids: list[int], skip: int, *, to_slot: bool) -> None:
        for kv, step, at, slot_step, length in self.offsets.tolist():
            for j in range(skip, len(ids)):
                k, s = kv + ids[j] * step, at + j * slot_step
                if to_slot:
                    slot[s : s + length] = self.kv[k : k + length]
                else:
                    self.kv[k : k + length] = slot[s : s + length]


def slot_buffer(nbytes: int, seed: int, *, misalign: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the whole buffer, `nbytes` of it starting `misalign` bytes in) of random bytes."""
    whole = np.random.default_rng(seed).integers(0, 256, nbytes + 64, dtype=np.uint8)
    return whole, whole[misalign : misalign + nbytes]


def copy(g: Geometry, slot: np.ndarray, ids: list[int], skip: int = 0, **kwargs: Any) -> None:
    rowcopy.copy_chunk(g.table(), ids, skip, slot.ctypes.data, slot.size, g.blocks, **kwargs)


def round_trip(g: Geometry, ids: list[int], targets: list[int], skip: int, misalign: int, **kwargs: Any) -> None:
    """Gather `ids` into a slot, then scatter it into `targets` past `skip`; both equal the reference."""
    _, slot = slot_buffer(max(g.slot_bytes, 1), 2, misalign=misalign)
    expected = slot.copy()
    g.reference(expected, ids, 0, to_slot=True)
    copy(g, slot, ids, to_slot=True, **kwargs)
    assert np.array_equal(slot, expected)
    kv_before = g.kv.copy()
    g.reference(expected, targets, skip, to_slot=False)  # the reference writes g.kv: compare against a copy
    kv_expected, g.kv[:] = g.kv.copy(), kv_before
    copy(g, slot, targets, skip, to_slot=False, **kwargs)
    assert np.array_equal(g.kv, kv_expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "plain"])
@pytest.mark.parametrize("length", [1, 3, 16, 17, 63, 64, 65, 4096 + 24])
@pytest.mark.parametrize("misalign", [0, 1, 13])
@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "interleaved"])
def test_gather_and_scatter_match_the_reference(
    length: int, misalign: int, stream: bool, threads: int, interleaved: bool
) -> None:
    """Blocks into a slot (gather) and from a slot into other blocks past a skip (scatter), with a gap
    between the slot's layers: the bytes equal the reference for pieces of any length at any alignment,
    and bytes not named (other blocks, skipped blocks, the gaps) keep theirs."""
    g = Geometry(3, 10, 2, length, 4, interleaved=interleaved, gap=5)
    round_trip(g, [7, 0, 9, 3], [2, 8, 5, 1], 1, misalign, stream=stream, threads=threads)


@settings(max_examples=60, deadline=None)
@given(
    planes=st.integers(1, 4),
    segments=st.integers(1, 3),
    length=st.integers(1, 200),
    ids=st.lists(st.integers(0, 11), min_size=1, max_size=12, unique=True),
    skip=st.integers(0, 12),
    gap=st.integers(0, 9),
    interleaved=st.booleans(),
    stream=st.booleans(),
)
def test_any_geometry(
    planes: int, segments: int, length: int, ids: list[int], skip: int, gap: int, interleaved: bool, stream: bool
) -> None:
    """Any number of layers, segments, lengths, ids and skips copies what the reference copies."""
    g = Geometry(planes, 12, segments, length, len(ids), interleaved=interleaved, gap=gap)
    round_trip(g, ids, ids[::-1], skip, 0, stream=stream)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("length", [24, 4096, 70_000])
def test_pieces_shared_among_threads(length: int, threads: int) -> None:
    """Copies of several 64 KiB batches and a short one, shared among OpenMP threads, equal the reference."""
    blocks = max(4, (200 * 1024) // (2 * length) + 1)
    g = Geometry(2, 2 * blocks, 1, length, blocks, interleaved=False)
    ids = np.random.default_rng(5).permutation(2 * blocks)[:blocks].tolist()
    targets = np.random.default_rng(8).permutation(2 * blocks)[:blocks].tolist()
    round_trip(g, ids, targets, 0, 0, stream=False, threads=threads)


@pytest.mark.parametrize(
    ("ids", "message"), [([0, 1, 10], r"ids\[2\] = 10 is outside \[0, 10\)"), ([0, -1], r"ids\[1\] = -1")]
)
def test_blocks_out_of_range_move_nothing(ids: list[int], message: str) -> None:
    """Every copied block is checked before any byte moves: a bad id late in the list leaves both sides as they
    were; a bad id among the skipped leading blocks is never read, so it is not checked."""
    g = Geometry(2, 10, 1, 64, len(ids), interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 9)
    kv_before, slot_before = g.kv.copy(), slot.copy()
    for to_slot in (True, False):
        with pytest.raises(IndexError, match=message):
            copy(g, slot, ids, to_slot=to_slot)
    assert np.array_equal(g.kv, kv_before)
    assert np.array_equal(slot, slot_before)
    copy(g, slot, [-1, 3], 1, to_slot=True)


def test_rows_outside_the_slot_move_nothing() -> None:
    """A table row that would run past the slot's end, or whose addresses overflow, is refused before any copy."""
    g = Geometry(2, 10, 1, 64, 2, interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 10)
    before = slot.copy()
    with pytest.raises(IndexError, match="table row 1 does not fit a slot of 255 bytes"):
        rowcopy.copy_chunk(g.table(), [1, 2], 0, slot.ctypes.data, g.slot_bytes - 1, 10, True)
    huge = g.table()
    huge[0, 1] = 2**62
    with pytest.raises(IndexError, match="table row 0"):
        rowcopy.copy_chunk(huge, [1, 2], 0, slot.ctypes.data, g.slot_bytes, 10, True)
    assert np.array_equal(slot, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ids": [1, 2.0]}, TypeError, r"ids\[1\] must be an int"),
        ({"ids": [1, "2"]}, TypeError, r"ids\[1\] must be an int"),
        ({"ids": 5}, TypeError, "ids must be a sequence"),
        ({"table": np.zeros(5, dtype=np.int32)}, TypeError, "table must be C-contiguous int64 rows of 5 columns"),
        ({"table": np.zeros(5, dtype=np.uint64)}, TypeError, "int64 rows"),
        ({"table": np.zeros(6, dtype=np.int64)}, TypeError, "int64 rows"),
        ({"table": np.zeros(10, dtype=np.int64)[::2]}, (TypeError, ValueError, BufferError), None),
        ({"table": np.array([[0, 64, 0, 64, 64]], dtype=np.int64)}, IndexError, "table row 0"),
        ({"table": np.array([[1, 64, -1, 64, 64]], dtype=np.int64)}, IndexError, "table row 0"),
        ({"skip": -1}, ValueError, "must be >= 0"),
        ({"threads": 0}, ValueError, "threads must be > 0"),
        ({"num_blocks": -1}, ValueError, "must be >= 0"),
        ({"slot": 0}, ValueError, "non-null pointer"),
        ({"slot": -1}, (OverflowError, ValueError), None),
        ({"slot": 1.5}, TypeError, "an address must be an int"),
    ],
)
def test_bad_arguments_are_typed_errors(kwargs: dict[str, object], error: type[Exception], message: str | None) -> None:
    """Malformed arguments raise TypeError, ValueError or IndexError, and move nothing."""
    g = Geometry(2, 10, 1, 64, 2, interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 11)
    kv_before, slot_before = g.kv.copy(), slot.copy()
    args: dict[str, object] = {
        "table": g.table(), "ids": [1, 2], "skip": 0, "slot": slot.ctypes.data, "slot_bytes": g.slot_bytes,
        "num_blocks": 10, "to_slot": True,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=message):
        rowcopy.copy_chunk(**args)
    assert np.array_equal(g.kv, kv_before)
    assert np.array_equal(slot, slot_before)


def test_nothing_to_copy_is_a_no_op() -> None:
    """No ids, every id skipped, or an empty table: nothing moves."""
    g = Geometry(2, 4, 1, 32, 1, interleaved=True)
    _, slot = slot_buffer(g.slot_bytes, 13)
    before = slot.copy()
    copy(g, slot, [], to_slot=True)
    copy(g, slot, [1], 1, to_slot=True)
    rowcopy.copy_chunk(np.zeros((0, 5), dtype=np.int64), [1], 0, slot.ctypes.data, slot.size, 4, True)
    assert np.array_equal(slot, before)


def test_more_threads_than_work_or_cores() -> None:
    """Thread counts far above the batches or the cores are capped (libgomp would otherwise exit the
    process when it cannot create them)."""
    g = Geometry(1, 8, 1, 70_000, 3, interleaved=False)
    round_trip(g, [5, 0, 7], [1, 2, 3], 0, 0, threads=100_000)


def test_a_table_changed_by_another_thread_during_a_copy() -> None:
    """The copy works on its own copy of the table: another thread writing it once the GIL is released
    cannot send bytes outside the slot or change which bytes move."""
    g = Geometry(2, 512, 1, 4096, 256, interleaved=False)
    ids = list(range(0, 512, 2))
    _, slot = slot_buffer(g.slot_bytes, 21)
    expected = slot.copy()
    g.reference(expected, ids, 0, to_slot=True)
    table, original = g.table(), g.table()
    stop = threading.Event()

    def scribble() -> None:
        while not stop.is_set():
            table[0, 2] = 1 << 40
            table[0, 2] = original[0, 2]

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        for _ in range(20):
            slot[...] = 0
            try:
                rowcopy.copy_chunk(table, ids, 0, slot.ctypes.data, slot.size, g.blocks, True, False, 2)
            except IndexError:  # its copy held the scribbled value: refused before any byte moved
                assert not slot.any()
                continue
            assert np.array_equal(slot, expected)
    finally:
        stop.set()
        writer.join()


def _copy_in_child(queue: Any) -> None:
    g = Geometry(2, 64, 1, 4096, 32, interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 23)
    expected = slot.copy()
    g.reference(expected, list(range(32)), 0, to_slot=True)
    threads = _copier.native_threads()
    copy(g, slot, list(range(32)), to_slot=True, threads=threads)
    queue.put((threads, bool(np.array_equal(slot, expected))))


def test_a_child_forked_after_threaded_copies_copies_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp's threads do not survive fork(): a child of a process that ran threaded copies copies
    on one thread (a parallel region there would wait forever) and finishes."""
    g = Geometry(2, 64, 1, 4096, 32, interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 25)
    copy(g, slot, list(range(32)), to_slot=True, threads=2)  # this process's team exists now
    monkeypatch.setattr(_copier, "_ran_threads", True)  # as after a copier's threaded copy
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


@pytest.mark.parametrize("to_slot", [True, False], ids=["gather", "scatter"])
def test_copy_chunks_equals_one_copy_chunk_per_chunk(to_slot: bool) -> None:
    """One `copy_chunks` call over several chunks moves the same bytes as `copy_chunk` per chunk."""
    g = Geometry(3, 12, 2, 48, 2, interleaved=True)
    plans = [([1, 2], 0), ([5, 7], 1), ([9, 0], 0)]
    _, slots = slot_buffer(g.slot_bytes * len(plans), 21)
    parts = [slots[i * g.slot_bytes : (i + 1) * g.slot_bytes] for i in range(len(plans))]
    kv_start, slots_start = g.kv.copy(), slots.copy()
    for part, (ids, skip) in zip(parts, plans, strict=True):
        copy(g, part, ids, skip, to_slot=to_slot)
    kv_expected, slots_expected = g.kv.copy(), slots.copy()
    g.kv[:], slots[:] = kv_start, slots_start
    chunks = [(g.table(), ids, skip, p.ctypes.data, p.size) for p, (ids, skip) in zip(parts, plans, strict=True)]
    rowcopy.copy_chunks(chunks, g.blocks, to_slot)
    assert np.array_equal(g.kv, kv_expected)
    assert np.array_equal(slots, slots_expected)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("an id outside the cache", IndexError),
        ("not a tuple", TypeError),
        ("a tuple too short", TypeError),
    ],
)
def test_copy_chunks_checks_every_chunk_before_any_byte_moves(bad: str, error: type[Exception]) -> None:
    """A bad second chunk fails the call before the first chunk's bytes move."""
    g = Geometry(2, 10, 1, 64, 2, interleaved=False)
    _, slots = slot_buffer(2 * g.slot_bytes, 22)
    first, second = slots[: g.slot_bytes], slots[g.slot_bytes :]
    kv_before, slots_before = g.kv.copy(), slots.copy()
    good = (g.table(), [1, 2], 0, first.ctypes.data, first.size)
    broken: object = {
        "an id outside the cache": (g.table(), [3, 10], 0, second.ctypes.data, second.size),
        "not a tuple": [g.table(), [3, 4], 0, second.ctypes.data, second.size],
        "a tuple too short": (g.table(), [3, 4], 0),
    }[bad]
    for to_slot in (True, False):
        with pytest.raises(error):
            rowcopy.copy_chunks([good, broken], g.blocks, to_slot)
        assert np.array_equal(g.kv, kv_before)
        assert np.array_equal(slots, slots_before)
    rowcopy.copy_chunks([], g.blocks, True)  # nothing to copy
    assert np.array_equal(slots, slots_before)


def _copy_on_a_thread_of_its_own(threads: int | None) -> tuple[int, bool]:
    """(threads this process gained while a copier copied on a new thread, whether the copy was right)."""
    g = Geometry(2, 64, 1, 4096, 32, interleaved=False)
    _, slot = slot_buffer(g.slot_bytes, 29)
    expected = slot.copy()
    g.reference(expected, list(range(32)), 0, to_slot=True)
    out: list[tuple[int, bool]] = []

    def run() -> None:
        before = len(os.listdir("/proc/self/task"))
        copy(g, slot, list(range(32)), to_slot=True, threads=threads or _copier.native_threads())
        out.append((len(os.listdir("/proc/self/task")) - before, bool(np.array_equal(slot, expected))))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return out[0]


@pytest.mark.skipif(os.cpu_count() == 1 or torch.get_num_threads() < 2, reason="needs 2 cores and torch threads")
def test_a_one_thread_copy_on_a_thread_of_its_own_starts_no_second_openmp_team() -> None:
    """libgomp gives every thread that starts a parallel region a team of its own: a threaded copy
    on the worker's copy thread adds threads to the process (and, once they outnumber the cores,
    libgomp stops spinning at torch's barriers). With one thread, as the worker copies, none."""
    added, right = _copy_on_a_thread_of_its_own(1)
    assert right
    assert added == 0
    added, right = _copy_on_a_thread_of_its_own(None)  # torch's thread count: a second team
    assert right
    # The copy's 64 pieces of 4 KiB go out in 4 batches of 64 KiB, and a team has at most one
    # thread per batch and per core it may run on (16 cores ran 4 threads on the GPU machine).
    team = min(torch.get_num_threads(), len(os.sched_getaffinity(0)), 4)
    assert added == team - 1
