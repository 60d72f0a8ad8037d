"""kvdepot.gpu: KV-cache layouts of inference engines, and block copies to and from the pool."""

from kvdepot.gpu._copier import CpuCopier, ReferenceCopier, compute_event, gather, open_copier, scatter
from kvdepot.gpu._copy import CopyHandle
from kvdepot.gpu._cuda import CudaCopier, CudaCopyHandle
from kvdepot.gpu._errors import (
    BlockIdError,
    CopierClosedError,
    CopyArgumentError,
    GpuError,
    NativeCopyError,
    PoolBoundsError,
    PoolDtypeError,
    PoolReadOnlyError,
    SlotSizeError,
    UnsupportedLayoutError,
)
from kvdepot.gpu._layout import KVLayout
from kvdepot.gpu._version import __version__

__all__ = [
    "BlockIdError",
    "CopierClosedError",
    "CopyArgumentError",
    "CopyHandle",
    "CpuCopier",
    "CudaCopier",
    "CudaCopyHandle",
    "GpuError",
    "KVLayout",
    "NativeCopyError",
    "PoolBoundsError",
    "PoolDtypeError",
    "PoolReadOnlyError",
    "ReferenceCopier",
    "SlotSizeError",
    "UnsupportedLayoutError",
    "__version__",
    "compute_event",
    "gather",
    "open_copier",
    "scatter",
]
