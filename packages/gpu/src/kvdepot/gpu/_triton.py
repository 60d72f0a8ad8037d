"""A Triton kernel that copies equal-length segments between two buffers by offset tables.

On CUDA one buffer is the KV cache and the other the pool mapping, registered with
cudaHostRegister so the GPU reads and writes it directly (zero-copy over PCIe/NVLink-C2C):
one launch moves every segment of a plane group, with no per-segment CPU work. Under
`TRITON_INTERPRET=1` the same kernel runs on CPU tensors, which is how it is tested.

Triton is optional: `available()` says whether it can be imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

# Words each program copies per step. 1024 words of 8 bytes is 8 KiB in flight per
# program, enough to hide PCIe latency with a few programs per SM without spilling.
TILE_WORDS = 1024

_KERNELS: dict[bool, Any] = {}


def available() -> bool:
    """True when Triton can be imported (the `triton` extra is installed)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel() -> Any:
    """The jitted kernel, built on first use (Triton reads TRITON_INTERPRET when it jits)."""
    mode = _interpreting()
    kernel = _KERNELS.get(mode)
    if kernel is None:
        import triton
        import triton.language as tl

        def copy_segments(src, dst, src_offsets, dst_offsets, seg_words, TILE: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: PLR0917
            segment = tl.program_id(0)
            tile = tl.program_id(1)
            src_start = tl.load(src_offsets + segment)
            dst_start = tl.load(dst_offsets + segment)
            words = tile * TILE + tl.arange(0, TILE)
            mask = words < seg_words
            values = tl.load(src + src_start + words, mask=mask)
            tl.store(dst + dst_start + words, values, mask=mask)

        kernel = triton.jit(copy_segments)
        _KERNELS[mode] = kernel
    return kernel


class DevicePointer:
    """A raw device-accessible address that Triton accepts in place of a tensor.

    Used for the pool: host memory registered with cudaHostRegister is addressable from
    the GPU at the same virtual address (unified addressing), but torch has no CUDA
    tensor for it.
    """

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def copy_segments(src: Any, dst: Any, src_offsets: torch.Tensor, dst_offsets: torch.Tensor, seg_words: int) -> None:
    """Launch: for every i, dst[dst_offsets[i] : +seg_words] = src[src_offsets[i] : +seg_words].

    `src` and `dst` are tensors (or `DevicePointer`s) of the same word dtype; the offset
    tables are int64 tensors on the device the kernel runs on.
    """
    count = int(src_offsets.numel())
    if count == 0 or seg_words == 0:
        return
    tiles = -(-seg_words // TILE_WORDS)
    _kernel()[(count, tiles)](src, dst, src_offsets, dst_offsets, seg_words, TILE=TILE_WORDS)
