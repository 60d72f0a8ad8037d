"""Gather and scatter arguments: every one is checked, once, before any byte moves.

`plan_copy` turns the caller's slot offsets, block ids and skips into a `CopyPlan`, or
raises the typed error that says what is wrong. The copy paths (`_copier`, `_cuda`,
`_reference`) only read plans.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeAlias

import attrs
import torch

from kvdepot.gpu._errors import (
    BlockIdError,
    CopyArgumentError,
    PoolBoundsError,
    PoolDtypeError,
    PoolReadOnlyError,
    SlotSizeError,
)
from kvdepot.gpu._layout import KVLayout

BlockIds: TypeAlias = "Sequence[int] | torch.Tensor"


@attrs.frozen
class CopyPlan:
    """A validated gather or scatter: per chunk, its slot offset, block ids and skipped leading blocks."""

    offsets: tuple[int, ...]
    block_lists: tuple[list[int], ...]  # every block of each chunk, in slot order
    skips: tuple[int, ...]  # leading blocks of each chunk that are not copied

    def chunks(self) -> Iterator[tuple[int, list[int], int]]:
        """(slot offset, block ids, skip) of each chunk with something to copy."""
        for offset, ids, skip in zip(self.offsets, self.block_lists, self.skips, strict=True):
            if skip < len(ids):
                yield offset, ids, skip


class CopyHandle(Protocol):
    """Completion of one gather or scatter."""

    def done(self) -> bool:
        """True once every byte of the copy has landed; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy is complete."""
        ...


@attrs.frozen
class CompletedCopy:
    """The handle of a copy that ran synchronously (the CPU path)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def check_pool(pool: Any) -> torch.Tensor:
    """The pool must be a 1-D contiguous uint8 tensor in host memory."""
    if not isinstance(pool, torch.Tensor):
        raise PoolDtypeError(
            f"pool must be a torch.Tensor view of the pool mapping, got {type(pool).__name__}; "
            "use torch.frombuffer(mmap_obj, dtype=torch.uint8).",
            expected="torch.uint8 tensor",
            got=type(pool).__name__,
        )
    if pool.dtype != torch.uint8 or pool.device.type != "cpu" or pool.dim() != 1 or pool.stride(0) != 1:
        raise PoolDtypeError(
            f"pool must be a 1-D contiguous torch.uint8 CPU tensor, got {pool.dtype} on {pool.device} with shape "
            f"{tuple(pool.shape)}; view the whole mapping with torch.frombuffer(mmap_obj, dtype=torch.uint8).",
            expected="1-D contiguous torch.uint8 on cpu",
            got=f"{pool.dtype} {tuple(pool.shape)} on {pool.device}",
        )
    return pool


def require_writable(pool: torch.Tensor, maps: str = "/proc/self/maps") -> None:
    """Raise `PoolReadOnlyError` unless every page of ``pool`` is mapped writable.

    A reader's view of the server's pool may be mapped read-only (``PROT_READ``); a gather's
    store into it kills the process with SIGSEGV, not an error. The process's memory map says
    which it is (Linux; elsewhere nothing is checked). Copiers ask once, at their first gather.
    """
    start = pool.data_ptr()
    end = start + pool.numel()
    if end == start:
        return
    try:
        with open(maps) as lines:
            covered = start
            for line in lines:
                span, permissions = line.split(maxsplit=2)[:2]
                low, high = (int(x, 16) for x in span.split("-"))
                if high <= covered:
                    continue
                if low > covered:  # a hole: not a mapping this process knows of
                    return
                if "w" not in permissions:
                    raise PoolReadOnlyError(
                        f"the pool is mapped without write permission ({permissions} at {covered:#x}); a gather "
                        "writes into it. Map the pool read-write (PROT_READ | PROT_WRITE, MAP_SHARED).",
                        address=covered,
                        permissions=permissions,
                    )
                covered = high
                if covered >= end:
                    return
    except OSError:
        return


def _bad_ids(chunk: int, ids: Any) -> BlockIdError:
    return BlockIdError(
        f"chunk {chunk}: block ids must be a list of ints or a 1-D integer tensor, got {ids!r}.",
        chunk=chunk,
        block_id=None,
        num_blocks=None,
    )


def _as_ids(chunk: int, ids: Any) -> list[int]:
    """Block ids as a list of Python ints (bools, floats and strings are refused)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise _bad_ids(chunk, ids)
        return list(ids.tolist())
    values = ids if isinstance(ids, list) else list(ids)
    if set(map(type, values)) <= {int}:  # the common case, checked in C
        return values
    try:
        if any(isinstance(v, bool) for v in values):
            raise TypeError("bool")
        return [operator.index(v) for v in values]  # numpy integers and other int-likes
    except TypeError as exc:
        raise _bad_ids(chunk, ids) from exc


def plan_copy(
    layout: KVLayout,
    pool: torch.Tensor,
    slot_offsets: Sequence[int],
    block_ids_per_chunk: Sequence[BlockIds],
    *,
    skip_blocks: int | Sequence[int] = 0,
    slot_size: int | None = None,
    writes_kv: bool,
    check: bool = True,
) -> CopyPlan:
    """Check every argument of a gather (`writes_kv=False`) or scatter and normalise it.

    `skip_blocks` is either one count of leading blocks over the chunks taken in order
    (one request's consecutive chunks) or one count per chunk. Skipped blocks are never
    read or written, and their ids are not checked. `check=False` skips the pool checks
    (for copiers, which check their pool once).
    """
    if check:
        check_pool(pool)
    if len(slot_offsets) != len(block_ids_per_chunk):
        raise CopyArgumentError(
            f"{len(slot_offsets)} slot offsets for {len(block_ids_per_chunk)} chunks; pass one slot per chunk.",
            expected=len(block_ids_per_chunk),
            got=len(slot_offsets),
        )
    ids = [_as_ids(i, chunk) for i, chunk in enumerate(block_ids_per_chunk)]
    skips = _skips(skip_blocks, [len(t) for t in ids])
    spans = [
        _check_chunk(layout, pool.numel(), chunk, offset, chunk_ids, skip, slot_size)
        for chunk, (offset, chunk_ids, skip) in enumerate(zip(slot_offsets, ids, skips, strict=True))
    ]
    _check_disjoint(spans, pool.numel())
    if writes_kv:
        _check_written_once(ids, skips, layout.num_blocks)
    return CopyPlan(offsets=tuple(start for start, _, _ in spans), block_lists=tuple(ids), skips=tuple(skips))


def _check_chunk(  # noqa: PLR0917 - one chunk's fields
    layout: KVLayout, pool_bytes: int, chunk: int, offset: Any, ids: list[int], skip: int, slot_size: int | None
) -> tuple[int, int, int]:
    """(slot start, slot size, chunk) of one chunk, whose slot and copied ids are checked."""
    if not ids:
        raise SlotSizeError(f"chunk {chunk} has no blocks; drop it from the call.", chunk=chunk, expected=None, got=0)
    size = len(ids) * layout.bytes_per_block
    if slot_size is not None and size != slot_size:
        raise SlotSizeError(
            f"chunk {chunk} holds {len(ids)} blocks = {size} bytes but slots are {slot_size} bytes; "
            f"a slot holds exactly {slot_size // max(layout.bytes_per_block, 1)} blocks of this layout "
            "(check the chunk size the server was registered with).",
            chunk=chunk,
            expected=slot_size,
            got=size,
        )
    try:
        start = operator.index(offset)
    except TypeError as exc:
        raise PoolBoundsError(
            f"slot offset of chunk {chunk} must be an int, got {offset!r}.",
            chunk=chunk, offset=offset, size=size, pool_bytes=pool_bytes,
        ) from exc  # fmt: skip
    if start < 0 or start + size > pool_bytes:
        raise PoolBoundsError(
            f"chunk {chunk}: slot [{start}, {start + size}) is outside the pool of {pool_bytes} bytes; "
            "the pool view must cover the whole mapping and the offset must come from the server.",
            chunk=chunk, offset=start, size=size, pool_bytes=pool_bytes,
        )  # fmt: skip
    used = ids[skip:] if skip else ids
    if used and (min(used) < 0 or max(used) >= layout.num_blocks):
        bad = min(used) if min(used) < 0 else max(used)
        raise BlockIdError(
            f"chunk {chunk}: block id {bad} is out of range [0, {layout.num_blocks}).",
            chunk=chunk, block_id=bad, num_blocks=layout.num_blocks,
        )  # fmt: skip
    return start, size, chunk


def _check_disjoint(spans: list[tuple[int, int, int]], pool_bytes: int) -> None:
    for (start_a, size_a, chunk_a), (start_b, _, chunk_b) in itertools.pairwise(sorted(spans)):
        if start_b < start_a + size_a:
            raise PoolBoundsError(
                f"slots of chunks {chunk_a} and {chunk_b} overlap at offset {start_b}; every chunk needs its own slot.",
                chunk=chunk_b, offset=start_b, size=size_a, pool_bytes=pool_bytes,
            )  # fmt: skip


def _check_written_once(ids: list[list[int]], skips: list[int], num_blocks: int) -> None:
    if not ids:  # no chunks: nothing is written
        return
    written = [b for t, s in zip(ids, skips, strict=True) for b in t[s:]] if len(ids) > 1 else ids[0][skips[0] :]
    if len(set(written)) != len(written):
        seen: set[int] = set()
        bad = next(b for b in written if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise BlockIdError(
            f"block id {bad} would be written twice in one scatter; each engine block takes one chunk's bytes.",
            chunk=None, block_id=bad, num_blocks=num_blocks,
        )  # fmt: skip


def _skips(skip_blocks: int | Sequence[int], lengths: list[int]) -> list[int]:
    if isinstance(skip_blocks, bool):
        raise CopyArgumentError("skip_blocks must be an int or a list of ints, got a bool.", got=skip_blocks)
    if isinstance(skip_blocks, int):
        if skip_blocks < 0:
            raise CopyArgumentError(f"skip_blocks must be >= 0, got {skip_blocks}.", got=skip_blocks)
        skips, left = [], skip_blocks
        for n in lengths:
            skips.append(min(left, n))
            left -= skips[-1]
        return skips
    skips = list(skip_blocks)
    if len(skips) != len(lengths) or any(
        isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= n for s, n in zip(skips, lengths, strict=True)
    ):
        raise CopyArgumentError(
            f"skip_blocks per chunk must be {len(lengths)} ints, each between 0 and its chunk's block count; "
            f"got {skip_blocks!r}.",
            got=skip_blocks,
        )
    return skips
