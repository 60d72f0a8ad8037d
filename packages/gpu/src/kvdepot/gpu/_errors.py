"""The errors kvdepot.gpu raises on purpose, rooted at `kvdepot.core.KVDepotError`."""

from __future__ import annotations

from kvdepot.core import InvalidArgumentError, KVDepotError


class GpuError(KVDepotError):
    """Root of the errors of kvdepot.gpu."""


class UnsupportedLayoutError(GpuError, InvalidArgumentError):
    """The engine's KV-cache tensors have a shape, stride or dtype kvdepot does not recognise.

    Fields: `layer` (the first offending layer name or None), `shapes` and `strides`
    (per layer), `hint` (the backend hint given, if any).
    """


class CopyArgumentError(GpuError, InvalidArgumentError):
    """A gather or scatter was called with arguments that cannot be right; nothing was copied."""


class SlotSizeError(CopyArgumentError):
    """A chunk's bytes do not match the pool's slot size (fields `chunk`, `expected`, `got`)."""


class BlockIdError(CopyArgumentError):
    """A block id is out of range, not an integer, or written twice (fields `chunk`, `block_id`, `num_blocks`)."""


class PoolDtypeError(CopyArgumentError):
    """The pool view is not a 1-D contiguous uint8 CPU tensor (fields `expected`, `got`)."""


class PoolReadOnlyError(CopyArgumentError):
    """A gather was asked to write into a pool mapped read-only (fields `address`, `permissions`)."""


class PoolBoundsError(CopyArgumentError):
    """A slot lies outside the pool or overlaps another slot (fields `chunk`, `offset`, `size`, `pool_bytes`)."""


class CopierClosedError(GpuError):
    """The copier was closed; open a new one with `open_copier`."""


class NativeCopyError(GpuError):
    """The native CPU copy (`kvdepot.gpu._rowcopy`) is not built or does not load (field `cause`)."""
